"""Host memory policy of a serving process (glibc malloc): what `jaxserve serve` and
`jaxserve generate` set up before they load a model (issue 26, notes/issue26_rss.md).

XLA:CPU takes every buffer (step temporaries, outputs, the KV pool) from malloc. glibc
serves a request of at least `M_MMAP_THRESHOLD` bytes with its own mmap and unmaps it on
free, but by default that threshold is dynamic: each free of an mmapped chunk raises it
to the chunk's size (up to 32 MiB) and the trim threshold to twice that. After warm-up
and the first prefill steps (temporaries of 10-15 MiB) every later step's large buffers
therefore come from the heaps of XLA's worker threads, which keep them; at 16 x 2048
tokens that cost ~55 MiB of peak RSS while serving (SmolLM2 Q4_1, f16 KV:
1225 -> 1170 MiB). Fixing the threshold (a `mallopt` call) turns the dynamic adjustment
off, so buffers of at least `MMAP_THRESHOLD_BYTES` go back to the OS when XLA frees them.
Unlike glibc's MALLOC_MMAP_THRESHOLD_ variable read at start-up, the call leaves the trim
threshold where earlier frees in this process (imports) may have raised it.

Only the command-line entry points call `fix_mmap_threshold`: it changes the whole
process's allocator, which a library (`LLM(...)` in someone else's program) should not
do behind its caller's back; such a caller may call it too.
"""

from __future__ import annotations

import ctypes
import gc
import logging

logger = logging.getLogger(__name__)

# glibc's <malloc.h> parameter number of M_MMAP_THRESHOLD.
M_MMAP_THRESHOLD = -3
# 4 MiB: a decode step's buffers (< 2 MiB at 16 rows) stay in malloc's heaps (no mmap
# per step); prefill temporaries, the head's logits and the like are returned.
# Measured peak RSS while serving (16 x 2048 tokens): 128 KiB 1170, 1 MiB 1173,
# 4 MiB 1176, glibc's dynamic default 1225 MiB.
MMAP_THRESHOLD_BYTES = 4 << 20


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc malloc's mmap threshold at `nbytes` (no dynamic growth); True if set.

    False, with a debug log, where libc has no `mallopt` (not glibc) or refuses the value
    (glibc's limit is 32 MiB on 64-bit); the process then keeps its allocator's default.
    """
    try:
        ok = ctypes.CDLL(None).mallopt(M_MMAP_THRESHOLD, ctypes.c_int(nbytes)) == 1
    except (OSError, AttributeError, ctypes.ArgumentError, OverflowError):
        ok = False
    if not ok:
        logger.debug("mallopt(M_MMAP_THRESHOLD, %d) unavailable or refused", nbytes)
    return ok


def release_host_memory() -> None:
    """Collect garbage and return free glibc heap pages to the OS (malloc_trim; a no-op
    where libc has no malloc_trim)."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
