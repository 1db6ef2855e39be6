"""Host memory for an engine on a CPU device: freed blocks stay in the process, and the bytes every
step streams (packed weights, the KV pool) lie on transparent huge pages.

glibc's malloc serves blocks above its mmap threshold (adjusted as the process runs, up to 32 MB)
with fresh pages from the kernel and returns them on free, and trims the heap's top once it holds
more than twice that threshold. A CPU step's activations are such blocks (a 2048-row prefill chunk
of the ~76M bf16 Llama: 16 MB for one layer's gate/up output), so every step's were new pages,
faulted in and zeroed by the kernel: ~38,000 faults and ~50 ms of kernel time per step
(docs/engine.md). With both thresholds fixed high, freed blocks go back to the heap and the next
step reuses them; the heap then keeps the largest step's working set for the life of the process,
as a caching allocator does. Set once, when an engine starts on the CPU, and logged.

A decode step streams every weight once, and one core's read rate is bound by how many misses it
keeps in flight: on 4 KB pages each page is a new TLB entry and the hardware prefetchers stop at its
edge, so 2 MB pages stream faster (docs/engine.md has the measurements). Linux gives huge pages to
an anonymous private mapping advised MADV_HUGEPAGE (its default mode, `madvise`), so
huge_page_tensors maps one such region for a set of tensors and hands out aligned views of it.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import platform
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)
MMAP_THRESHOLD = 1 << 30  # only blocks of 1 GB or more (a KV pool) get pages of their own
TRIM_THRESHOLD = (1 << 31) - 1  # the heap's free top is kept (mallopt takes an int)
HUGE_PAGE = 2 << 20
ALIGN = 64  # each tensor of an arena starts on a cache line
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_logged_mode = False


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


def transparent_huge_pages() -> str:
    """The kernel's transparent huge page mode (always, madvise or never); "unavailable" elsewhere."""
    try:
        text = THP_MODE.read_text()
    except OSError:
        return "unavailable"
    return next((word[1:-1] for word in text.split() if word.startswith("[")), "unavailable")


def huge_page_tensors(sizes: list[tuple[int, torch.dtype]]) -> list[torch.Tensor]:
    """One flat tensor of each (elements, dtype), zeroed, all in one anonymous mapping advised for
    transparent huge pages and aligned to them (each tensor to a cache line). The tensors keep the
    mapping alive; its pages are committed as they are first written. Where Linux cannot advise
    (another OS, an old kernel), the same tensors on ordinary pages."""
    global _logged_mode
    offsets, total = [], 0
    for numel, dtype in sizes:
        offsets.append(total)
        total += -(-numel * dtype.itemsize // ALIGN) * ALIGN
    if total == 0:
        return [torch.empty(0, dtype=dtype) for _, dtype in sizes]
    region = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    advised = False
    if advice is not None:
        try:
            region.madvise(advice)
            advised = True
        except OSError:
            pass
    if not _logged_mode:
        _logged_mode = True
        mode = transparent_huge_pages()
        log.info("host memory: packed weights and the KV pool %s (transparent huge pages: %s)",
                 "advised onto huge pages" if advised and mode in ("always", "madvise")
                 else "on ordinary pages", mode)
    flat = torch.frombuffer(region, dtype=torch.uint8)  # holds the mapping for as long as a view lives
    start = (-flat.data_ptr()) % HUGE_PAGE
    return [flat[start + offset:start + offset + numel * dtype.itemsize].view(dtype)
            for offset, (numel, dtype) in zip(offsets, sizes, strict=True)]
