"""A real Envoy, ``kvgate epp`` and upstream processes on loopback for the EPP tests.

Envoy runs the example configuration (``examples/deploy/envoy/envoy.yaml``) with its ports
moved to free ones, in either body mode; the picker is ``python -m kvgate epp``; the upstreams
are ``recording_upstream`` processes. Everything started here is stopped by its own PID.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvgate.gateway.epp import wire
from kvgate.gateway.epp.wire import HeaderMap, HeaderValue, Metadata, ProcessingMode
from tests.gateway.live_server import free_port
from tests.gateway.upstream.processes import REPO_ROOT, Process

ENVOY = shutil.which("envoy")
EXAMPLE = REPO_ROOT / "examples/deploy/envoy/envoy.yaml"
RECORDING = ("-m", "tests.gateway.upstream.recording_upstream")
MODEL = "recording-upstream-model"
FLEET_FLAGS = ("--upstream-health-interval", "0.25", "--upstream-unhealthy-after", "2")


def recording_upstreams(log_dir: Path, count: int = 3) -> list[Process]:
    return [Process(log_dir, command=RECORDING, model=None) for _ in range(count)]


def epp(log_dir: Path, upstreams: list[Process], *flags: str, port: int | None = None) -> Process:
    urls = [f for u in upstreams for f in ("--upstream", u.base)]
    command = ("-m", "kvgate", "epp")
    return Process(log_dir, *urls, *FLEET_FLAGS, *flags, command=command, model=None, port=port)


def serving(port: int, timeout_s: float = 1.0) -> bool:
    """Does the picker on ``port`` answer gRPC health with SERVING?"""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            answer = stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)


def wait_serving(picker: Process, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while not serving(picker.port):
        assert picker.process is not None and picker.process.poll() is None, picker.log()
        assert time.monotonic() < deadline, f"the picker did not serve: {picker.log()[-2000:]}"
        time.sleep(0.1)


class Envoy:
    """Envoy running the example configuration, its ports moved; ``mode``: the body mode."""

    def __init__(self, log_dir: Path, epp_port: int, mode: str = "FULL_DUPLEX_STREAMED") -> None:
        self.port, self.admin = free_port(), free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        text = EXAMPLE.read_text()
        for old, new in (("9002", epp_port), ("8081", self.port), ("9901", self.admin)):
            assert f"port_value: {old} " in text, old
            text = text.replace(f"port_value: {old} ", f"port_value: {new} ")
        if mode != "FULL_DUPLEX_STREAMED":
            text = text.replace(
                "request_body_mode: FULL_DUPLEX_STREAMED", f"request_body_mode: {mode}"
            )
            text = text.replace("request_trailer_mode: SEND", "request_trailer_mode: SKIP")
        self.config = log_dir / f"envoy-{self.port}.yaml"
        self.config.write_text(text)
        self.log_path = log_dir / f"envoy-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 20) -> Envoy:
        assert ENVOY is not None
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                [ENVOY, "-c", str(self.config), "--disable-hot-restart", "-l", "warning"],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, self.log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, "envoy did not become ready"
            try:
                if httpx.get(f"http://127.0.0.1:{self.admin}/ready", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def chat(text: str, cache_key: str | None = None, stream: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 1,
        "stream": stream,
    }
    if cache_key is not None:
        body["cache_key"] = cache_key
    return body


def served_by(response: httpx.Response) -> str:
    """The ``host:port`` that answered (Envoy's header, or a fleet gateway's URL)."""
    value = response.headers["x-kvgate-upstream"]
    return value.split("://", 1)[-1]


def endpoint(process: Process) -> str:
    return f"{process.host}:{process.port}"


# -- ext_proc spoken directly, as Envoy would ------------------------------------------------


def headers_message(
    path: str, end: bool, mode: int = ProcessingMode.BUFFERED, subset: list[str] | None = None
) -> wire.ProcessingRequest:
    headers = HeaderMap(
        headers=[
            HeaderValue(key=":method", raw_value=b"POST"),
            HeaderValue(key=":path", raw_value=path.encode()),
        ]
    )
    message = wire.ProcessingRequest(
        request_headers=wire.HttpHeaders(headers=headers, end_of_stream=end),
        protocol_config=wire.ProtocolConfiguration(request_body_mode=mode),
    )
    if subset is not None:
        metadata = Metadata()
        hint = metadata.filter_metadata["envoy.lb.subset_hint"]
        hint.get_or_create_list("x-gateway-destination-endpoint-subset").extend(subset)
        message.metadata_context.CopyFrom(metadata)
    return message


def body_message(body: bytes, end: bool = True) -> wire.ProcessingRequest:
    return wire.ProcessingRequest(request_body=wire.HttpBody(body=body, end_of_stream=end))


async def process(
    port: int, messages: list[wire.ProcessingRequest], hold_s: float = 0.0
) -> list[wire.ProcessingResponse]:
    """Send ``messages`` on one stream (then keep it open ``hold_s``); every answer."""

    async def requests() -> AsyncIterator[wire.ProcessingRequest]:
        for message in messages:
            yield message
        if hold_s:
            await asyncio.sleep(hold_s)

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(
            wire.PROCESS,
            request_serializer=wire.ProcessingRequest.SerializeToString,
            response_deserializer=wire.ProcessingResponse.FromString,
        )
        return [answer async for answer in call(requests(), timeout=30)]


def destination(answer: wire.ProcessingResponse) -> str | None:
    """The endpoint a pick names in its header mutation (checked equal to its metadata)."""
    phase = answer.WhichOneof("response")
    if phase not in ("request_headers", "request_body"):
        return None
    common = getattr(answer, phase).response
    found = [
        h.header.raw_value.decode()
        for h in common.header_mutation.set_headers
        if h.header.key == "x-gateway-destination-endpoint"
    ]
    if not found:
        return None
    meta = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert meta["x-gateway-destination-endpoint"].string_value == found[0]
    return found[0]


def json_body(body: dict[str, Any]) -> bytes:
    return orjson.dumps(body)


@contextmanager
def stopped_after(processes: list[Any]) -> Iterator[None]:
    try:
        yield
    finally:
        for item in reversed(processes):
            item.stop()
