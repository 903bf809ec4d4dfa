"""Host memory for XLA:CPU: reuse freed buffers instead of mapping fresh pages every execution.

XLA:CPU allocates each execution's temporaries as one block (678 MiB for the headline train step
of BENCHMARKS.md) with `posix_memalign`, on one of its worker threads. glibc serves a block that
large with a fresh `mmap` and gives it back with `munmap` when the execution ends, so every step
page-faults all of it again: 174k faults and ~0.28 s of kernel time in a 0.65 s step on a 2-core
CPU. `reuse_host_memory()` makes glibc serve every allocation from the main heap (one arena, no
`mmap`) and never trim it, so a step reuses the pages the previous one freed. The price: the
process keeps its peak host memory until it exits, and threads share one malloc arena.

glibc reads these settings when a thread first allocates, so call it before the first JAX
computation; later calls return True but leave the running threads' arenas as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV_SWITCH = "BDLM_HOST_MALLOC"  # "0" leaves glibc's defaults alone
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc's <malloc.h> option numbers


def reuse_host_memory() -> bool:
    """Keep freed host memory for reuse (module docstring). Returns whether the settings were
    applied: False off glibc (macOS, musl), or when the environment sets `BDLM_HOST_MALLOC=0`."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; trim only past 2 GiB of free memory at the heap's top.
    return all(mallopt(option, value) == 1 for option, value in
               ((_M_TRIM_THRESHOLD, 2**31 - 1), (_M_MMAP_MAX, 0), (_M_ARENA_MAX, 1)))
