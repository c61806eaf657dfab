"""Paged KV cache and attention over it (layout and contracts: docs/architecture.md).

The names below load their modules on first use (``kvgate.engine._lazy``); inside the engine, import
them from the modules that define them.
"""

import typing

import kvgate.engine._lazy as _lazy

if typing.TYPE_CHECKING:
    from kvgate.engine.attention.backend import (
        BACKEND_NAMES,
        AttentionBackend,
        get_attention_backend,
    )
    from kvgate.engine.attention.kv_cache import (
        FP8_DTYPE,
        KVCache,
        allocate_kv_caches,
        cache_scheme,
        kv_bytes_per_token,
        resolve_cache_dtype,
    )
    from kvgate.engine.attention.metadata import AttentionMetadata
    from kvgate.engine.attention.torch_backend import paged_attention, write_kv

__all__ = [
    "BACKEND_NAMES",
    "FP8_DTYPE",
    "AttentionBackend",
    "AttentionMetadata",
    "KVCache",
    "allocate_kv_caches",
    "cache_scheme",
    "get_attention_backend",
    "kv_bytes_per_token",
    "paged_attention",
    "resolve_cache_dtype",
    "write_kv",
]

__getattr__, __dir__ = _lazy.exports(
    __name__,
    {
        "kvgate.engine.attention.backend": (
            "BACKEND_NAMES",
            "AttentionBackend",
            "get_attention_backend",
        ),
        "kvgate.engine.attention.kv_cache": (
            "FP8_DTYPE",
            "KVCache",
            "allocate_kv_caches",
            "cache_scheme",
            "kv_bytes_per_token",
            "resolve_cache_dtype",
        ),
        "kvgate.engine.attention.metadata": ("AttentionMetadata",),
        "kvgate.engine.attention.torch_backend": ("paged_attention", "write_kv"),
    },
)
