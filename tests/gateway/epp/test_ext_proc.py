"""``kvgate epp`` spoken to directly over ext_proc, as a proxy would: the subset hint, the
refusals, the endpoints file, and the hostile cases (a stalled stream, a flood of streams)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvgate.gateway.epp.wire import ProcessingMode
from tests.gateway.epp import stack
from tests.gateway.upstream.processes import Process, running

DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
MAX_STREAMS = 4
IDLE_S = 1.0


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("epp-direct")


@pytest.fixture(scope="module")
def upstreams(log_dir: Path) -> Iterator[list[Process]]:
    with running(stack.recording_upstreams(log_dir)) as started:
        yield started


@pytest.fixture(scope="module")
def members_file(log_dir: Path, upstreams: list[Process]) -> Path:
    path = log_dir / "endpoints.txt"
    path.write_text("# the pool\n" + "\n".join(u.base for u in upstreams[:2]) + "\n")
    return path


@pytest.fixture(scope="module")
def picker(log_dir: Path, members_file: Path) -> Iterator[Process]:
    flags = ("--endpoints-file", str(members_file), "--epp-max-streams", str(MAX_STREAMS))
    process = stack.epp(log_dir, [], *flags, "--epp-idle-timeout", str(IDLE_S)).start()
    try:
        stack.wait_serving(process)
        yield process
    finally:
        process.stop()


def pick(port: int, body: dict, path: str = "/v1/chat/completions", **kw: object) -> str | None:
    answers = asyncio.run(
        stack.process(
            port,
            [stack.headers_message(path, False, **kw), stack.body_message(stack.json_body(body))],  # type: ignore[arg-type]
        )
    )
    return stack.destination(answers[-1])


def test_both_body_modes_name_the_same_endpoint(picker: Process, upstreams: list[Process]) -> None:
    body = stack.json_body(stack.chat("modes", cache_key="modes"))
    buffered = asyncio.run(
        stack.process(
            picker.port,
            [stack.headers_message("/v1/chat/completions", False), stack.body_message(body)],
        )
    )
    assert buffered[0].WhichOneof("response") == "request_headers"
    assert stack.destination(buffered[0]) is None  # headers continue; the body answers
    duplex = asyncio.run(
        stack.process(
            picker.port,
            [
                stack.headers_message("/v1/chat/completions", False, DUPLEX),
                stack.body_message(body[:10], end=False),
                stack.body_message(body[10:]),
            ],
        )
    )
    # full duplex: the headers' answer waits for the body, which is given back whole
    assert [a.WhichOneof("response") for a in duplex] == ["request_headers", "request_body"]
    assert duplex[1].request_body.response.body_mutation.streamed_response.body == body
    assert stack.destination(buffered[1]) == stack.destination(duplex[0])
    assert stack.destination(duplex[0]) in {stack.endpoint(u) for u in upstreams[:2]}


def test_the_subset_hint_is_obeyed(picker: Process, upstreams: list[Process]) -> None:
    first, second = (stack.endpoint(u) for u in upstreams[:2])
    for i in range(8):
        body = stack.chat("subset", cache_key=f"subset-{i}")
        assert pick(picker.port, body, subset=[second]) == second
        assert pick(picker.port, body, subset=[first, "10.9.9.9:1"]) == first
    answer = asyncio.run(
        stack.process(
            picker.port, [stack.headers_message("/v1/models", True, subset=["10.9.9.9:1"])]
        )
    )
    assert answer[0].immediate_response.status.code == 503
    assert b"subset" in answer[0].immediate_response.body


def test_a_request_without_a_body_is_routed_on_its_headers(picker: Process) -> None:
    answers = asyncio.run(stack.process(picker.port, [stack.headers_message("/v1/models", True)]))
    assert stack.destination(answers[0]) is not None


def test_the_endpoints_file_is_followed(
    picker: Process, members_file: Path, upstreams: list[Process]
) -> None:
    third = stack.endpoint(upstreams[2])
    original = members_file.read_text()
    try:
        members_file.write_text(original + upstreams[2].base + "\n")
        deadline = time.monotonic() + 10
        keys = [f"file-{i}" for i in range(24)]
        while third not in {pick(picker.port, stack.chat("f", cache_key=k)) for k in keys}:
            assert time.monotonic() < deadline, "the third member never took a key"
            time.sleep(0.2)
        members_file.write_text(upstreams[0].base + "\n")
        deadline = time.monotonic() + 10
        while {pick(picker.port, stack.chat("f", cache_key=k)) for k in keys} != {
            stack.endpoint(upstreams[0])
        }:
            assert time.monotonic() < deadline, "departed members were still picked"
            time.sleep(0.2)
    finally:
        members_file.write_text(original)
    deadline = time.monotonic() + 10
    while len({pick(picker.port, stack.chat("f", cache_key=k)) for k in keys}) != 2:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_a_stalled_stream_is_ended(picker: Process) -> None:
    started = time.monotonic()
    answers = asyncio.run(
        stack.process(
            picker.port,
            [
                stack.headers_message("/v1/chat/completions", False, DUPLEX),
                stack.body_message(b"{", end=False),
            ],
            hold_s=10 * IDLE_S,
        )
    )
    took = time.monotonic() - started
    assert answers == []  # nothing picked for a body that never ended
    assert IDLE_S <= took < 5 * IDLE_S, took


def test_a_flood_of_streams_is_bounded(picker: Process) -> None:
    """Past ``--epp-max-streams`` a stream is answered 429 at once; past twice that gRPC
    itself refuses it, which the client sees as an RPC error (RESOURCE_EXHAUSTED, or INTERNAL
    where the refusal beat its first message): which a stream meets depends on how many
    refused ones have closed when it arrives. Either way at most the cap is served, and the
    picker still answers afterwards."""

    async def flood() -> list[list | BaseException]:
        held = [
            stack.process(
                picker.port,
                [stack.headers_message("/v1/chat/completions", False, DUPLEX)],
                hold_s=IDLE_S / 2,
            )
            for _ in range(MAX_STREAMS * 8)
        ]
        return await asyncio.gather(*held, return_exceptions=True)

    answers = asyncio.run(flood())
    exhausted = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
    failed = [a for a in answers if isinstance(a, BaseException) and a not in exhausted]
    assert not failed, failed
    refused = [
        a
        for a in answers
        if isinstance(a, list) and a and a[0].immediate_response.status.code == 429
    ]
    assert len(refused) + len(exhausted) >= MAX_STREAMS * 7, answers
    assert refused and b"too many" in refused[0][0].immediate_response.body
    # the flood gone, picks resume
    assert pick(picker.port, stack.chat("after the flood")) is not None


def test_a_body_that_is_not_a_call_routes_keyless(picker: Process) -> None:
    for body in (b"not json", b"[1, 2]", b'{"method": "tools/list"}'):
        answers = asyncio.run(
            stack.process(
                picker.port, [stack.headers_message("/mcp", False), stack.body_message(body)]
            )
        )
        assert stack.destination(answers[-1]) is not None
