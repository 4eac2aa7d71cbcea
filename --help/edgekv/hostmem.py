"""Host heap policy: keep freed host memory inside the process so repeated temporaries never fault again.

glibc serves a request at or above ``M_MMAP_THRESHOLD`` (adjusted dynamically, at most 32 MiB on 64-bit
by default) with a fresh anonymous mapping and unmaps it on free, and it returns free memory at the top
of the heap to the kernel past ``M_TRIM_THRESHOLD``. A stream repeats the same allocations forever: every
frame pair's activations, every compression's score and gather temporaries. Under the defaults each
repetition maps those pages again, page-faults each one in and has the kernel zero it. Measured on the
2-core x86 VM, one infinipot_v compression at the Qwen2.5-VL-3B cache shape ([36 layers, 2 KV heads,
1536 slots, 128] fp32): ~22,400 minor faults and 71 ms median in-stream under the defaults; 0 faults and
44 ms with freed blocks retained.

``retain`` raises both thresholds once (``mallopt``), so freed blocks go back to the heap's free lists
and later requests reuse them: the process's resident memory settles at its working set after the first
frame pairs and compressions, then stays flat. (glibc 2.36 leaves a freed aligned block slightly too
small for the same aligned request, so the first few repetitions of a temporary still take new pages
until freed neighbours coalesce; measured: a 48 + 16 MiB pair of temporaries stops faulting after ~5
repetitions and resident memory is flat from then on.) That is what a fixed-budget
runtime wants — the memory a stream needs is claimed up front and kept, never handed back and re-faulted —
and it is what PyTorch's CUDA caching allocator already does for device memory. ``release`` leaves the C
library's defaults alone. The setting is per process (the allocator is shared by everything in it), so
it is applied once a Runtime has loaded its weights and engines — after one ``malloc_trim`` that hands
back whatever loading freed (a checkpoint converted on the host must not stay resident as free heap,
least of all on a Jetson, whose CPU and GPU share one memory) — and is not undone when the Runtime
goes; on a C library other than glibc it does nothing and says so.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import os
import platform

import torch

# mallopt parameters, from glibc's <malloc.h>
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Requests below this come from the heap and are reused after free; above it, mapped as before. Larger
# than any temporary of a Qwen2.5-VL-3B stream or compression. glibc 2.36 accepts it (mallopt returns 1);
# a C library that refuses keeps its defaults, and the returned description says so.
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1  # never trim the top of the heap on our account

_applied: str | None = None


@functools.lru_cache(maxsize=1)
def _glibc() -> ctypes.CDLL | None:
    libc_name, _ = platform.libc_ver()
    if libc_name != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def trim() -> bool:
    """Hand the heap's free pages back to the kernel now (glibc ``malloc_trim``); False where there is no glibc.

    For steps that free and allocate large blocks in turn, such as repacking every 4-bit linear of a model:
    the freed blocks sit between live ones, where the heap's top can never shrink past them, so without this
    the process's RSS climbs by everything freed (+1.6 GiB over the 3B repack, issue 29) until the next trim.
    ``malloc_trim(0)`` releases the free pages inside the heap too (``madvise``), wherever they are."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


def configure_host_memory(mode: str) -> str:
    """Apply ``model.host_memory`` (``retain`` | ``release``); return a one-line description for stats()."""
    global _applied
    if mode not in ("retain", "release"):
        raise ValueError(f"model.host_memory: expected 'retain' or 'release', got {mode!r}")
    if mode == "release":  # an earlier Runtime of this process may already have set retain: say so
        return _applied or "release (the C library's defaults)"
    libc = _glibc()
    if libc is None:
        return "release (host_memory: retain needs glibc's mallopt; this C library keeps its defaults)"
    # Every Runtime's loading garbage is handed back (the heap is never trimmed on its own once retained);
    # only the stream's own reuse is kept.
    libc.malloc_trim(0)
    if _applied is not None:
        return _applied
    ok = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _applied = ("retain (glibc: blocks below 1 GiB reused after free, heap never trimmed)" if ok
                else "release (glibc refused mallopt; its defaults stay)")
    return _applied


# ------------------------------------------------------------------------------------------- huge pages
HUGE_PAGE = 2 << 20  # x86-64 and aarch64 with 4 KiB base pages (Jetson's L4T kernels) both use 2 MiB
HUGE_MIN_BYTES = 64 << 20  # see weight_empty: below this the rounding to huge pages cost more memory than it was worth
_MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>, the same on x86-64 and aarch64
huge_pages = os.environ.get("EDGEKV_HUGE_PAGES", "1") != "0"  # read at each call: a bench may A/B it


def weight_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor for weights that are written once and then streamed for every token, backed by
    transparent huge pages where the kernel offers them (``madvise(MADV_HUGEPAGE)`` on the tensor's 2 MiB-aligned
    range; with THP set to ``madvise``, as on this x86 VM, nothing is huge without it). Why: a decode step streams
    every weight once, and the hardware prefetchers stop at each 4 KiB page; with 2 MiB pages a stream also walks
    512x fewer page-table entries. Measured on the 2-core x86 VM, one thread, the two layouts in one process, 20
    interleaved rounds: the bf16 kernel over the 3B ``lm_head`` (622 MB) 15.9 -> 18.1 GB/s best round, 14.8 -> 16.1
    median, faster in 19 of 20 rounds; the 4-bit kernel over 48 copies of a 3B ``gate_proj``'s tiles (541 MB) 14.1
    -> 15.5 best, 11.7 -> 12.2 median, faster in 13 of 20 (the host was shared: single rounds vary by +-20 %). The
    tensor's storage is up to one huge page larger than its bytes; the spare head and tail are never touched, so
    they take address space, not memory. Only tensors of ``HUGE_MIN_BYTES`` or more: advising every weight of 8 MiB
    or more (the 4-bit tiles, the vision tower's linears) cost memory — a 3B 4-bit load peaked at 3.98 GiB instead
    of 3.73 and stayed 0.12 GiB higher after the repack — for a gain lost in the noise of whole-token timings; at
    3B, 64 MiB and up is the tied embedding / ``lm_head`` alone (622 MB in bf16, a third of a 4-bit token's bytes).
    ``EDGEKV_HUGE_PAGES=0`` turns it off; smaller tensors and hosts without glibc get a plain ``torch.empty``."""
    nbytes = math.prod(shape) * dtype.itemsize
    libc = _glibc() if huge_pages and nbytes >= HUGE_MIN_BYTES else None
    if libc is None:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    region = raw[offset:offset + nbytes]
    libc.madvise(ctypes.c_void_p(region.data_ptr()), ctypes.c_size_t(nbytes - nbytes % HUGE_PAGE),
                 ctypes.c_int(_MADV_HUGEPAGE))  # refused (no THP in this kernel): the pages stay 4 KiB, no harm
    return region.view(dtype).view(shape)
