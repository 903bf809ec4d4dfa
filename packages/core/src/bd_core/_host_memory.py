"""Host memory for XLA:CPU: back malloc's large blocks with transparent huge pages.

XLA:CPU allocates each execution's temporaries as one block (678 MiB for the headline train step
of BENCHMARKS.md) with `posix_memalign`. glibc serves a block that large with a fresh `mmap` and
unmaps it when the execution ends, so every step faults all of it in again, one 4 KiB page at a
time: 174k page faults and ~0.27 s of kernel time in a 0.6 s step on a 2-core CPU. glibc's tunable
`glibc.malloc.hugetlb=1` (glibc >= 2.35) makes malloc ask for transparent huge pages for what it
maps, so the same block takes a few hundred 2 MiB faults; the process's memory use is unchanged.

glibc reads tunables once, when a process starts, so a running process cannot switch them on for
itself: `with_huge_page_malloc(env)` puts the tunable into an environment for the processes started
from it. The pipeline's flow does this to `os.environ`, so every Metaflow step process has it, and
the Makefile exports it for `make run`, `make test` and `make bench`. It does nothing where the
kernel's THP mode is `never`, under an older glibc, or off glibc (musl, macOS). A tunable for it
that is already set (e.g. `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` to turn it off) is kept.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def with_huge_page_malloc(env: MutableMapping[str, str]) -> None:
    """Add `glibc.malloc.hugetlb=1` to `env`'s `GLIBC_TUNABLES` (keeping its other tunables) unless
    it sets that tunable already. Processes started with `env` get it; this one does not."""
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.split("=")[0] == HUGE_PAGE_TUNABLE for t in tunables):
        env["GLIBC_TUNABLES"] = ":".join([*tunables, f"{HUGE_PAGE_TUNABLE}=1"])


def huge_page_malloc_active() -> bool:
    """Whether this process started with malloc on transparent huge pages: the tunable set to a
    nonzero value in its environment, glibc >= 2.35, and the kernel's THP mode not `never`."""
    values = [t.split("=", 1)[1] for t in os.environ.get("GLIBC_TUNABLES", "").split(":")
              if t.startswith(f"{HUGE_PAGE_TUNABLE}=")]
    if not values or values[-1] in ("", "0"):
        return False
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # pyright: ignore[reportOptionalMemberAccess]
        major, minor = (int(part) for part in version.split(".")[:2])
        mode = _THP_MODE.read_text()
    except (AttributeError, ValueError, OSError):
        return False
    return name == "glibc" and (major, minor) >= (2, 35) and "[never]" not in mode
