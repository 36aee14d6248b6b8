"""The process's C heap (glibc ``malloc``): keep freed memory for reuse instead of handing it back to the system.

Every eager step builds its index tensors on the host, and PyTorch frees them at the end of the step. By default
glibc serves blocks of 128 KB and more with fresh ``mmap`` regions (the threshold then grows with what is freed, up
to 32 MB) and trims the top of the heap once more than twice that is free, so the next step's tensors land on pages
the kernel must fault in and zero again. On the lent H200 machine (a virtual machine) that cost showed as host ops
of a few microseconds taking milliseconds: the first 16-prompt prefill step of a batch-64 bench run started its
kernels ~70 ms late, and the first run after a warm-up gave its first token at 257 ms where later runs gave 178 ms;
with the heap kept, every run gave 176-180 ms (docs/performance.md 4.21). ``keep_freed_heap`` sets the mmap threshold
to 32 MB (the dynamic threshold's ceiling, and the largest glibc before 2.35 accepts) and the trim threshold to
``TRIM_BYTES``: freed memory stays with the process (at most
``TRIM_BYTES`` of free heap top before glibc trims), as a long-running server wants.

``LLM`` calls it once per process unless ``DEEPINFER_KEEP_HEAP=0``. It does nothing where the C library is not glibc
or a variable ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_`` already chose (the user's setting wins).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

ENV = "DEEPINFER_KEEP_HEAP"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_BYTES = 32 << 20  # HEAP_MAX_SIZE / 2 on 64-bit: glibc before 2.35 refuses a larger one
TRIM_BYTES = 1 << 30
_GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@functools.cache
def keep_freed_heap() -> bool:
    """Set glibc's mmap and trim thresholds once per process (module docstring); True where both took effect."""
    if os.environ.get(ENV, "1") == "0" or any(name in os.environ for name in _GLIBC_VARIABLES):
        return False
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    kept = bool(mallopt(M_MMAP_THRESHOLD, MMAP_BYTES)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_BYTES))
    logger.debug("glibc heap kept (mmap threshold %d, trim threshold %d): %s", MMAP_BYTES, TRIM_BYTES, kept)
    return kept


def _glibc_mallopt():
    """glibc's ``mallopt(int, int) -> int``, or None where the C library is another (musl, macOS, Windows)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.gnu_get_libc_version  # noqa: B018  (glibc only)
    except (OSError, AttributeError):
        return None
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt
