"""Freed host memory stays in the engine process on a CPU device.

glibc's malloc serves blocks above its mmap threshold (adjusted as the process runs, up to 32 MB)
with fresh pages from the kernel and returns them on free, and trims the heap's top once it holds
more than twice that threshold. A CPU step's activations are such blocks (a 2048-row prefill chunk
of the ~76M bf16 Llama: 16 MB for one layer's gate/up output), so every step's were new pages,
faulted in and zeroed by the kernel: ~38,000 faults and ~50 ms of kernel time per step
(docs/engine.md). With both thresholds fixed high, freed blocks go back to the heap and the next
step reuses them; the heap then keeps the largest step's working set for the life of the process,
as a caching allocator does. Set once, when an engine starts on the CPU, and logged.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # only blocks of 1 GB or more (a KV pool) get pages of their own
TRIM_THRESHOLD = (1 << 31) - 1  # the heap's free top is kept (mallopt takes an int)


def keep_freed_memory() -> bool:
    """Fix glibc malloc's mmap and trim thresholds for this process; False where the C library is not
    glibc (nothing changed)."""
    if platform.libc_ver()[0] != "glibc":
        log.info("host memory: not glibc, its allocator left as it is")
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(mallopt(param, value) == 1
             for param, value in ((_M_MMAP_THRESHOLD, MMAP_THRESHOLD), (_M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    log.info("host memory: freed blocks %s", "kept for reuse (glibc malloc's mmap and trim thresholds fixed "
             "high)" if ok else "returned to the kernel (glibc refused the thresholds)")
    return ok
