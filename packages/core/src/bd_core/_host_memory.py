"""Host memory for XLA:CPU: back malloc's large blocks with transparent huge pages.

XLA:CPU allocates each execution's temporaries as one block (678 MiB for the headline train step
of BENCHMARKS.md) with `posix_memalign`. glibc serves a block that large with a fresh `mmap` and
unmaps it when the execution ends, so every step faults all of it in again, one 4 KiB page at a
time: 174k page faults and 0.27-0.31 s of kernel time in a 0.6-0.7 s step on a 2-core CPU. glibc's
tunable `glibc.malloc.hugetlb=1` (glibc >= 2.35) makes malloc ask for transparent huge pages for
what it maps, so the same block takes a few hundred 2 MiB faults (the headline step's process
peaked at 0.97x the default's RSS). It matters where the kernel's THP mode is `madvise`, the usual
default: under `always` malloc's blocks get huge pages anyway, under `never` they cannot.

glibc reads tunables once, when a process starts, so a running process cannot switch them on for
itself: `with_huge_page_malloc(env)` puts the tunable into an environment for the processes started
from it. The pipeline's flow does this to `os.environ`, so every step process Metaflow starts on
this machine has it (a pod on Kubernetes needs it in its own environment), and the Makefile adds it
for `make run`, `make test` and `make bench`. It does nothing under an older glibc or off glibc
(musl, macOS). A value for it that is already set (e.g. `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` to
turn it off) is kept.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb"
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# The tunables this process started with, as far as Python can tell: taken when bd_core is imported,
# before `with_huge_page_malloc(os.environ)` can change them. (/proc/self/environ is no witness:
# glibc rewrites its copy of GLIBC_TUNABLES there while parsing it.)
_START_TUNABLES = os.environ.get("GLIBC_TUNABLES", "")


def _hugetlb_value(glibc_tunables: str) -> str | None:
    """The value `GLIBC_TUNABLES` gives `glibc.malloc.hugetlb` (the last one wins, as in glibc)."""
    values = [t.split("=", 1)[1] for t in glibc_tunables.split(":") if t.startswith(f"{HUGE_PAGE_TUNABLE}=")]
    return values[-1] if values else None


def with_huge_page_malloc(env: MutableMapping[str, str]) -> None:
    """Add `glibc.malloc.hugetlb=1` to `env`'s `GLIBC_TUNABLES` (keeping its other tunables) unless
    it sets that tunable already. Processes started with `env` get it; this one does not."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if _hugetlb_value(tunables) is None:
        env["GLIBC_TUNABLES"] = f"{tunables}:{HUGE_PAGE_TUNABLE}=1" if tunables else f"{HUGE_PAGE_TUNABLE}=1"


def thp_mode() -> str:
    """The kernel's transparent-huge-page mode (`always`, `madvise`, `never`), or "" if unknown."""
    try:
        text = _THP_MODE.read_text()
    except OSError:
        return ""
    return text[text.find("[") + 1:text.find("]")] if "[" in text else ""


def tunable_takes_effect() -> bool:
    """Whether `glibc.malloc.hugetlb=1` changes what this machine's malloc does: glibc >= 2.35 and
    the THP mode `madvise`."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # pyright: ignore[reportOptionalMemberAccess]
        major, minor = (int(part) for part in version.split(".")[:2])
    except (AttributeError, ValueError, OSError):
        return False
    return name == "glibc" and (major, minor) >= (2, 35) and thp_mode() == "madvise"


def huge_page_malloc_active() -> bool:
    """Whether this process's malloc backs its large blocks with transparent huge pages: the THP
    mode is `always`, or the tunable takes effect here and the process started with it."""
    # Only 1 asks for transparent huge pages; other values ask for reserved hugetlbfs pages.
    return thp_mode() == "always" or (tunable_takes_effect() and _hugetlb_value(_START_TUNABLES) == "1")
