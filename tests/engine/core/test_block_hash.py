import hashlib
import struct
import subprocess
import sys

from kvgate.engine.core.block_hash import (
    BLOCK_SIZE,
    block_hashes,
    extend_block_hashes,
    hash_block,
    root_hash,
)

ROOT = root_hash("model-a", "float32")


def test_block_hash_is_sha256_of_parent_tokens_as_le_int32_and_extras():
    tokens = list(range(BLOCK_SIZE))
    expected = hashlib.sha256(ROOT + struct.pack("<16i", *tokens) + b"x").digest()
    assert hash_block(ROOT, tokens, b"x") == expected


def test_only_full_blocks_are_hashed_and_the_chain_covers_the_whole_prefix():
    tokens = list(range(40))
    chain = block_hashes(tokens, ROOT)
    assert len(chain) == 2
    assert chain[1] == hash_block(hash_block(ROOT, tokens[:16]), tokens[16:32])
    # same second block after a different first block: different hash
    other = block_hashes([99] + tokens[1:], ROOT)
    assert other[1] != chain[1]


def test_extending_incrementally_equals_hashing_at_once():
    tokens = list(range(70))
    partial = block_hashes(tokens[:20], ROOT)
    assert extend_block_hashes(partial, tokens, ROOT) == block_hashes(tokens, ROOT)


def test_root_separates_model_cache_scheme_block_size_and_tenant():
    roots = {
        ROOT,
        root_hash("model-b", "float32"),
        root_hash("model-a", "bfloat16"),
        root_hash("model-a", "float32", block_size=32),
        root_hash("model-a", "float32", salt="tenant-1"),
        root_hash("model-a", "float32", salt="tenant-2"),
        root_hash("model-a", "float32", salt=""),
    }
    assert len(roots) == 7


def test_hashes_are_identical_across_processes():
    code = (
        "from kvgate.engine.core.block_hash import block_hashes, root_hash;"
        "print(block_hashes(list(range(48)), root_hash('m', 'fp8', salt='t'))[-1].hex())"
    )
    runs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": str(seed), "PATH": ""},
        ).stdout
        for seed in (1, 2)
    }
    assert len(runs) == 1 and next(iter(runs)).strip()
