"""``kvgate epp``: the picker served over gRPC, ext_proc v3 and gRPC health on one port.

Startup is fleet mode's (``Fleet.connect``: every upstream's ``/v1/models`` asked once, the
tokenizer loaded when given), then the fleet's background work runs as in a gateway: health
checks, ``/metrics`` scrapes, DNS refreshes, KV-event subscriptions; an ``--endpoints-file``
is followed besides (``endpoints``). gRPC health says ``SERVING`` while some member is
available, so a proxy's health checks (or Kubernetes' gRPC probe) take a picker with no
routable member out.

Streams beyond ``--epp-max-streams`` are answered 429 at once, with a reason, and gRPC itself
refuses past twice that (``RESOURCE_EXHAUSTED``: the proxy's failure mode), so a flood of
streams holds bounded memory.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvgate.gateway.epp import endpoints, messages, wire
from kvgate.gateway.epp.exchange import Exchange
from kvgate.gateway.epp.picker import Picker, Refusal
from kvgate.gateway.ops.metrics import Metrics
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstream.fleet import Fleet

logger = logging.getLogger("kvgate.epp")
BUSY = Refusal(429, "too many requests in flight at the endpoint picker")
# One message may carry more than a whole body the picker keeps: Envoy sends what it has read
# at once, up to its own buffer (1 MiB by default). It is read, then refused as over the limit.
LARGEST_MESSAGE = 4 << 20
MESSAGE_SLACK = 64 * 1024  # a body message's framing beyond its bytes
DRAIN_S = 5.0


class Processor:
    """The ext_proc service (its ``Process`` method registered by ``wire.handler``): one
    ``Exchange`` per stream, at most ``max_streams`` at once."""

    def __init__(self, picker: Picker, settings: Settings) -> None:
        self.picker = picker
        self.max_body_bytes = settings.max_body_bytes
        self.idle_timeout_s = settings.epp_idle_timeout_s
        self.max_streams = settings.epp_max_streams
        self.open = 0

    async def Process(  # noqa: N802 - the gRPC method's name
        self,
        request_iterator: AsyncIterator[wire.ProcessingRequest],
        context: grpc.aio.ServicerContext[wire.ProcessingRequest, wire.ProcessingResponse],
    ) -> AsyncIterator[wire.ProcessingResponse]:
        if self.open >= self.max_streams:
            yield messages.refused(BUSY)
            return
        self.open += 1
        try:
            exchange = Exchange(self.picker, self.max_body_bytes, self.idle_timeout_s)
            async for response in exchange.run(request_iterator):
                yield response
        finally:
            self.open -= 1


def connect(settings: Settings) -> Fleet:
    """The fleet, its members from ``--upstream`` and the endpoints file as it is now."""
    listed = list(settings.upstream)
    if settings.endpoints_file is not None:
        listed += endpoints.read(settings.endpoints_file)
    return Fleet.connect(replace(settings, upstream=tuple(dict.fromkeys(listed))))


async def serve(settings: Settings, fleet: Fleet) -> None:
    """Serve until SIGTERM or SIGINT, then drain for up to ``DRAIN_S``."""
    metrics = Metrics(model_name=fleet.model_name)
    await fleet.open(metrics)
    picker = Picker(fleet)
    largest = max(settings.max_body_bytes, LARGEST_MESSAGE) + MESSAGE_SLACK
    server = grpc.aio.server(
        maximum_concurrent_rpcs=2 * settings.epp_max_streams,
        options=[
            ("grpc.max_receive_message_length", largest),
            ("grpc.max_send_message_length", largest),
            ("grpc.so_reuseport", 0),
        ],
    )
    server.add_generic_rpc_handlers((wire.handler(Processor(picker, settings).Process),))
    checks = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    address = f"{host}:{settings.port}"
    server.add_insecure_port(address)
    tasks: list[asyncio.Task[None]] = [asyncio.create_task(_report(fleet, checks))]
    if settings.endpoints_file is not None:
        follower = endpoints.EndpointsFile(
            settings.endpoints_file, settings.upstream, fleet.members
        )
        tasks.append(asyncio.create_task(follower.follow()))
    await server.start()
    logger.info("kvgate epp on %s: %d upstream(s)", address, len(fleet.upstreams))
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        await stopping.wait()
    finally:
        await checks.enter_graceful_shutdown()
        await server.stop(DRAIN_S)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await fleet.aclose()


async def _report(fleet: Fleet, checks: health.aio.HealthServicer) -> None:
    """gRPC health follows the members': SERVING while one is available."""
    serving, unknown = health_pb2.HealthCheckResponse.SERVING, None
    last = unknown
    while True:
        available = any(u.breaker.available() for u in fleet.upstreams)
        status = serving if available else health_pb2.HealthCheckResponse.NOT_SERVING
        if status != last:
            for name in ("", wire.SERVICE):
                await checks.set(name, status)
            last = status
        await asyncio.sleep(0.25)


def main(settings: Settings) -> None:
    """``kvgate epp``: connect the fleet (FleetConfigError when it cannot be), then serve."""
    fleet = connect(settings)
    asyncio.run(serve(settings, fleet))
