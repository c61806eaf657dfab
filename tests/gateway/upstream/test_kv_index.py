"""The per-upstream block index and its subscriber, against a hostile publisher: content
keys recomputed from token ids, tenants apart, a size cap, and malformed, oversized or
flooding batches costing bounded memory."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from kvgate.engine.process import kv_wire
from kvgate.gateway.upstream.kv_index import BlockIndex, request_keys
from kvgate.gateway.upstream.kv_subscriber import EventSource, KVSubscriber
from tests.gateway.live_server import free_port

TOKENS = list(range(100, 164))  # four 16-token blocks


def stored(
    hashes: list[bytes], tokens: list[int], parent: bytes | None = None, salt: str | None = None
) -> kv_wire.BlockStored:
    extras = [(salt,)] + [None] * (len(hashes) - 1) if salt else None
    return kv_wire.BlockStored(hashes, parent, tokens, 16, None, "GPU", None, extras)


def hashes(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]


def test_keys_come_from_content_and_chain_through_parents() -> None:
    index = BlockIndex(100)
    first, second = hashes(2), hashes(2, 1)
    assert index.stored(stored(first, TOKENS[:32]))
    assert index.stored(stored(second, TOKENS[32:], parent=first[-1]))
    assert index.match(request_keys(TOKENS + [1, 2], 16, None, None), 0) == 4
    assert index.match(request_keys([7] + TOKENS[1:], 16, None, None), 0) == 0
    index.removed([first[1]])
    assert index.match(request_keys(TOKENS, 16, None, None), 0) == 1


def test_a_tenants_salted_blocks_never_match_another_tenant() -> None:
    index = BlockIndex(100)
    assert index.stored(stored(hashes(4), TOKENS, salt="tenant-a"))
    assert index.match(request_keys(TOKENS, 16, None, "tenant-a"), 0) == 4
    assert index.match(request_keys(TOKENS, 16, None, "tenant-b"), 0) == 0
    assert index.match(request_keys(TOKENS, 16, None, None), 0) == 0


def test_a_batch_as_vllm_publishes_it_on_cpu() -> None:
    """vLLM 0.32's own shape, as its CPU build sent it (test_fleet_vllm_events.py follows a
    real one): hashes the low 64 bits of its sha256 as unsigned ints (past int64's range),
    128-token blocks, ``extra_keys`` of None per block, and fields kvgate does not read."""
    big = [(1 << 64) - 1 - n for n in range(2)]
    ids = [0] + list(range(3, 258))
    common = {"medium": "GPU", "group_idx": 0, "locality": None}
    payload = msgspec.msgpack.encode(
        [
            1796607653.8,
            [
                {"type": "BlockStored", "block_hashes": big, "parent_block_hash": None,
                 "token_ids": ids, "block_size": 128, "lora_id": None, "lora_name": None,
                 "extra_keys": [None, None], "session_id": None, **common},
                {"type": "BlockRemoved", "block_hashes": big[1:], **common},
            ],
        ]
    )  # fmt: skip
    index = BlockIndex(100)
    store, remove = kv_wire.decode(payload).events
    assert isinstance(store, kv_wire.BlockStored) and isinstance(remove, kv_wire.BlockRemoved)
    assert index.stored(store) and index.block_size == 128
    assert index.match(request_keys(ids + [9] * 40, 128, None, None), 0) == 2
    index.removed(remove.block_hashes)
    assert index.match(request_keys(ids, 128, None, None), 0) == 1


def test_inconsistent_or_unchainable_events_are_dropped() -> None:
    index = BlockIndex(100)
    assert not index.stored(stored(hashes(4), TOKENS[:60]))  # tokens do not fill the blocks
    assert not index.stored(stored(hashes(1), TOKENS[:16], parent=b"unknown" * 4))
    assert len(index) == 0


def test_the_index_is_capped_and_speculation_expires() -> None:
    index = BlockIndex(8)
    for n in range(50):  # a flood of claimed blocks
        index.stored(stored(hashes(4, n), [n] * 64))
    assert len(index) == 8
    keys = request_keys(list(range(500, 564)), 16, None, None)
    index.speculate(keys, now=10.0)
    assert index.match(keys, 11.0) == 4 and index.match(keys, 20.0) == 0


@pytest.fixture
def hostile() -> Iterator[tuple[zmq.Socket[bytes], KVSubscriber, str]]:
    port = free_port()
    context = zmq.Context()
    pub = context.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    url = "http://upstream.test:8000"
    subscriber = KVSubscriber([EventSource.parse(f"{url}=tcp://127.0.0.1:{port}")], 64)
    subscriber.start()
    yield pub, subscriber, url
    subscriber.close()
    context.destroy(linger=0)


def wait_until(condition: object, what: str) -> None:
    deadline = time.monotonic() + 5
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_eviction_odds_grow_with_the_removals_against_the_blocks_held() -> None:
    index = BlockIndex(100)
    blocks = hashes(4)
    assert index.stored(stored(blocks, TOKENS))
    assert index.eviction_odds(0.0) == 0.0  # a cache that only stores keeps what it holds
    assert index.stored(stored(hashes(4, 1), TOKENS, parent=blocks[-1]))
    index.removed(blocks[2:], now=100.0)  # 2 of 8 gone, 6 held: older blocks go first
    assert index.eviction_odds(100.0) == pytest.approx(math.exp(-6 / 2))
    assert index.eviction_odds(110.0) == pytest.approx(math.exp(-6 / (2 / math.e)), rel=1e-6)
    index.removed(hashes(4, 1), now=100.0)  # 6 gone of 8 stored, 2 held: likely lost
    assert index.eviction_odds(100.0) == pytest.approx(math.exp(-2 / 6))
    index.clear()
    assert index.eviction_odds(100.0) == 0.0


def test_a_hostile_publisher_costs_bounded_memory(
    hostile: tuple[zmq.Socket[bytes], KVSubscriber, str],
) -> None:
    pub, subscriber, url = hostile
    wait_until(lambda: subscriber.live_index(url) is not None, "no connection")
    seq = iter(range(10_000))

    def send(payload: bytes) -> None:
        pub.send_multipart((b"", kv_wire.seq_bytes(next(seq)), payload))

    send(b"\xc1 not msgpack")
    send(kv_wire.encode(kv_wire.EventBatch(0.0, [stored(hashes(1), [1 << 40] * 16)])))
    send(b"\x91" + b"\xdc\xff\xff" * 10)  # a batch that claims huge arrays
    pub.send_multipart((b"", b"short", b""))  # framing that is not the protocol's
    for n in range(40):  # a flood of claims: the index keeps 64 blocks at most
        events = [stored(hashes(4, n), [n] * 64)]
        send(kv_wire.encode(kv_wire.EventBatch(0.0, list(events))))
    wait_until(lambda: subscriber.states()[url].counts.get("batches", 0) >= 40, "flood not read")
    index = subscriber.live_index(url)
    assert index is not None and len(index) == 64
    assert subscriber.states()[url].counts.get("malformed", 0) >= 3
    read = subscriber.states()[url].counts.get("batches", 0)
    pub.send_multipart((b"", kv_wire.seq_bytes(99), b"x" * (5 << 20)))  # over the cap
    time.sleep(0.3)
    # dropped by ZMQ, never decoded
    assert subscriber.states()[url].counts.get("batches", 0) == read
