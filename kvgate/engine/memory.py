"""How an engine process holds memory: large blocks on transparent huge pages, and freed
activations kept in the heap for the next step instead of handed back to the OS.

A decode step reads K/V blocks scattered over the cache; on 4 KiB pages each block costs a TLB
miss that the hardware prefetcher will not cross (`benchmarks/decode_attention.py`, Zen 4: bf16
4.44 -> 2.53 ms a step with huge pages). A prefill step's activations are tens of MiB each, and
glibc unmaps blocks that large when they are freed: the next step faults them in again, zeroed
by the kernel (a 2,000-token prefill on huge pages: ~5,000 faults and 10% of its time in
``clear_page``; held in the heap: ~5 faults). Light: no torch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
from collections.abc import Callable
from typing import Any

# glibc's mallopt parameters and the block size below which freed memory stays in the heap.
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
HELD_BYTES = 1 << 30


def glibc(name: str) -> Callable[..., Any] | None:
    """The C library's function ``name`` where it is glibc's (``malloc_trim``, ``mallopt``),
    else None."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


def prepare() -> None:
    """Before the process's first large torch allocation. PyTorch reads
    ``THP_MEM_ALLOC_ENABLE`` at that allocation; ``THP_MEM_ALLOC_ENABLE=0`` opts out."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    mallopt = glibc("mallopt")
    if mallopt is not None:
        mallopt(M_MMAP_THRESHOLD, HELD_BYTES)
        mallopt(M_TRIM_THRESHOLD, HELD_BYTES)


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the OS at once: after a load that freed far more
    than a step will use again."""
    gc.collect()
    trim = glibc("malloc_trim")
    if trim is not None:
        trim(0)


def freeze_long_lived() -> None:
    """In the engine's own process, once it is built: the model, tokenizer and caches live as
    long as the process, so the cyclic collector need never traverse them again (vLLM's engine
    process freezes its heap the same way). bench55m loaded: a full collection 150 ms unfrozen,
    0 frozen; unfrozen, one lands inside a step now and then. Not for a user's process (the
    offline ``LLM``): objects frozen there and dropped later in a cycle are never freed."""
    gc.collect()
    gc.freeze()
