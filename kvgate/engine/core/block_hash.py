"""Chained sha256 block hashes: the identity of a block of 16 cached tokens.

A block's hash covers its parent's hash, so equal hashes mean an equal whole prefix, not
just equal last 16 tokens:

    root = sha256(model id, KV dtype + scale scheme, block size, tenant salt[, LoRA adapter])
    h0   = sha256(root ‖ tokens[0:16]  ‖ extras)
    h1   = sha256(h0   ‖ tokens[16:32] ‖ extras)

Token ids are packed as little-endian int32, so every process on every machine computes the
same bytes (never Python's ``hash()``, which is salted per process). The router hashes a
prompt with the same functions the block pool matches against.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BLOCK_SIZE = 16


def _field(value: str | bytes) -> bytes:
    """Length-prefixed, so ("ab", "c") and ("a", "bc") never collide."""
    data = value.encode() if isinstance(value, str) else value
    return len(data).to_bytes(4, "little") + data


def root_hash(
    model_id: str,
    cache_scheme: str,
    block_size: int = BLOCK_SIZE,
    salt: str | bytes | None = None,
    adapter: bytes | None = None,
) -> bytes:
    """Parent of a prompt's first block: blocks from another model, KV representation,
    block size, tenant or LoRA adapter (its name and weights' hash) can never match. The base
    model's roots are those of a root with no adapter field at all."""
    digest = hashlib.sha256(b"kvgate-block-v1")
    for part in (model_id, cache_scheme, str(block_size), b"" if salt is None else salt):
        digest.update(_field(part))
    digest.update(b"\x01" if salt is not None else b"\x00")
    if adapter is not None:
        digest.update(b"lora" + _field(adapter))
    return digest.digest()


def hash_block(parent: bytes, token_ids: Sequence[int], extras: bytes = b"") -> bytes:
    """sha256(parent ‖ token ids as little-endian int32 ‖ extras)."""
    return hashlib.sha256(parent + struct.pack(f"<{len(token_ids)}i", *token_ids) + extras).digest()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    root: bytes,
    block_size: int = BLOCK_SIZE,
) -> list[bytes]:
    """Append the hashes of the full blocks of ``token_ids`` not yet in ``hashes`` (in place)."""
    parent = hashes[-1] if hashes else root
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


def block_hashes(
    token_ids: Sequence[int], root: bytes, block_size: int = BLOCK_SIZE
) -> list[bytes]:
    """Hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    return extend_block_hashes([], token_ids, root, block_size)
