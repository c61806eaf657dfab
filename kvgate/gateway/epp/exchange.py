"""One ext_proc stream: one HTTP request as Envoy shows it to the picker, answered.

Envoy opens a stream per request and sends its phases in order; which ones, and how the body
comes, its ``processing_mode`` says (the first message carries it as ``protocol_config``):

```
BUFFERED               headers ─► continue        body (whole) ─► pick: header + metadata
FULL_DUPLEX_STREAMED   headers ─► (held)          body chunks… end ─► pick: header + metadata,
                                                                  then the body given back
no body (GET)          headers (end of stream) ─► pick
```

Full-duplex is how the Gateway API Inference Extension configures Envoy: the picker must
hold the headers' answer until it has read the body it routes by, then give the body back
(Envoy forwards only what the processor returns). Bounds: the body kept is at most
``max_body_bytes`` (beyond: 413 at once), and a stream silent for ``idle_timeout_s`` is ended
(a stalled client's body, or a proxy gone quiet); the lease on the pick is released when the
stream ends, however it ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvgate.gateway.epp import messages, wire
from kvgate.gateway.epp.picker import Picker, Refusal
from kvgate.gateway.epp.wire import ProcessingMode
from kvgate.gateway.upstream.upstream import Lease

FULL_DUPLEX = ProcessingMode.FULL_DUPLEX_STREAMED
TOO_LARGE = Refusal(413, "request body over the picker's limit")


class Exchange:
    """The state of one stream: the mode, the request's path, its body so far, the pick."""

    def __init__(self, picker: Picker, max_body_bytes: int, idle_timeout_s: float) -> None:
        self.picker = picker
        self.max_body_bytes, self.idle_timeout_s = max_body_bytes, idle_timeout_s
        self.duplex = False
        self.path = ""
        self.subset: list[str] | None = None
        self.chunks: list[bytes] = []
        self.size = 0
        self.lease: Lease | None = None

    async def run(
        self, incoming: AsyncIterator[wire.ProcessingRequest]
    ) -> AsyncIterator[wire.ProcessingResponse]:
        """The answers to ``incoming``, until Envoy ends the stream (or it idles, or a refusal
        ends the request)."""
        try:
            while True:
                try:
                    async with asyncio.timeout(self.idle_timeout_s):
                        request = await anext(incoming)
                except (StopAsyncIteration, TimeoutError):
                    return
                for response in await self._answer(request):
                    yield response
                    if response.HasField("immediate_response"):
                        return
        finally:
            if self.lease is not None:
                self.lease.release()

    async def _answer(self, request: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        phase = request.WhichOneof("request")
        if phase == "request_headers":
            return await self._headers(request)
        if phase == "request_body":
            return await self._body(request.request_body)
        if phase == "request_trailers":
            if self.duplex and self.lease is None:  # the body ended with trailers
                return [*await self._routed_duplex(), messages.CONTINUE_TRAILERS]
            return [messages.CONTINUE_TRAILERS]
        if phase == "response_headers":
            return [messages.CONTINUE_RESPONSE_HEADERS]
        if phase == "response_body":  # only where a proxy is set to send it: given back as is
            body = request.response_body
            streamed = wire.StreamedBodyResponse(body=body.body, end_of_stream=body.end_of_stream)
            mutation = wire.BodyMutation(streamed_response=streamed) if self.duplex else None
            common = wire.CommonResponse(body_mutation=mutation)
            return [wire.ProcessingResponse(response_body=wire.BodyResponse(response=common))]
        return []

    async def _headers(self, request: wire.ProcessingRequest) -> list[wire.ProcessingResponse]:
        if request.HasField("protocol_config"):
            self.duplex = request.protocol_config.request_body_mode == FULL_DUPLEX
        self.subset = messages.subset_hint(request)
        headers = request.request_headers
        for header in headers.headers.headers:
            if header.key == ":path":
                self.path = header.raw_value.decode(errors="replace") or header.value
                break
        if headers.end_of_stream:  # no body: routed on the path alone
            return [await self._pick(b"", messages.routed_headers)]
        if self.duplex:
            return []  # answered once the body is in
        return [messages.CONTINUE_HEADERS]

    async def _body(self, body: wire.HttpBody) -> list[wire.ProcessingResponse]:
        self.size += len(body.body)
        if self.size > self.max_body_bytes:
            return [messages.refused(TOO_LARGE)]
        self.chunks.append(body.body)
        if not body.end_of_stream:
            return []  # full duplex: more to come (buffered bodies come whole)
        if not self.duplex:
            return [await self._pick(self._whole(), messages.routed_body)]
        return await self._routed_duplex()

    def _whole(self) -> bytes:
        whole = b"".join(self.chunks)
        self.chunks = []
        return whole

    async def _routed_duplex(self) -> list[wire.ProcessingResponse]:
        """The held headers answered with the pick, then the body given back."""
        whole = self._whole()
        answer = await self._pick(whole, messages.routed_headers)
        if answer.HasField("immediate_response"):
            return [answer]
        return [answer, messages.streamed_body(whole)]

    async def _pick(self, body: bytes, routed: messages.Routed) -> wire.ProcessingResponse:
        picked = await self.picker.pick(self.path, body, self.subset)
        if isinstance(picked, Refusal):
            return messages.refused(picked)
        self.lease = picked
        return routed(self.picker.endpoint_of(picked.upstream))
