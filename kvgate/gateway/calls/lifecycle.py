"""What every call goes through, whichever door it came in by.

A door parses its own wire and renders its own answers; between the two, both walk the same
steps here: the transport checks every POST passes (Origin/Host, the body within its size
and time, its media type, JSON depth), then admission (the client's concurrency slot and the
tenant's budget), then the call itself under its deadline, cancelled when the client goes
away. Failures are ``kvgate.gateway.calls.errors`` (the door maps them); nothing here knows MCP,
OpenAI or which backend runs the call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Iterable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import orjson
from starlette.types import Receive

from kvgate.gateway.auth.budgets import Budgets
from kvgate.gateway.auth.identity import current as current_identity
from kvgate.gateway.calls.admission import ConcurrencyLimit, client_key, client_limited
from kvgate.gateway.calls.errors import BadInput, DeadlineExceeded, Rejected
from kvgate.gateway.http import io as http_io
from kvgate.gateway.http.security import OriginPolicy, refusal
from kvgate.gateway.settings import Settings
from kvgate.protocol.jsonrpc import nesting_depth

T = TypeVar("T")
JSON = "application/json"


@dataclass(frozen=True)
class Call:
    """One admitted call: its deadline (loop time) and the client it belongs to."""

    receive: Receive
    deadline: float
    timeout_s: float

    async def run(self, work: Awaitable[T]) -> T:
        """``work`` within the deadline (``DeadlineExceeded``), cancelled when the client goes
        away (``http_io.ClientGone``)."""
        try:
            return await http_io.until_disconnect(self.receive, http_io.before(self.deadline, work))
        except TimeoutError:
            raise DeadlineExceeded(self.timeout_s) from None

    async def watch(self, work: Awaitable[T]) -> T:
        """``work`` cancelled when the client goes away; a stream that has begun keeps the
        deadline itself, to end with an error event rather than a cut connection."""
        return await http_io.until_disconnect(self.receive, work)


class Lifecycle:
    """The limits both doors share: one per-client counter, one set of tenant budgets."""

    def __init__(self, settings: Settings, budgets: Budgets) -> None:
        self.settings = settings
        self.budgets = budgets
        self.origins = OriginPolicy(settings.host, settings.allowed_origins)
        self.clients = ConcurrencyLimit(settings.max_concurrency_per_client)

    def check_origin(self, raw_headers: Iterable[tuple[bytes, bytes]]) -> None:
        """A foreign or repeated Origin/Host is refused (403 / 400)."""
        refused = refusal(self.origins, raw_headers)
        if refused is not None:
            raise Rejected(refused[0], refused[1])

    async def read_body(self, receive: Receive, headers: Mapping[str, str]) -> bytes:
        """The body, within ``--max-body-bytes`` (413) and ``--body-timeout`` (408), of media
        type ``application/json`` (415)."""
        limit, timeout = self.settings.max_body_bytes, self.settings.body_timeout_s
        try:
            body = await http_io.read_bounded(receive, headers, limit, timeout)
        except http_io.BodyTooLarge:
            raise Rejected(413, f"Request body exceeds {limit} bytes", "body_too_large") from None
        except TimeoutError:
            raise Rejected(
                408, f"Request body not received within {timeout:g} s", "body_timeout"
            ) from None
        if http_io.media_type(headers.get("content-type")) != JSON:
            raise Rejected(415, "Unsupported Media Type: Content-Type must be application/json")
        return body

    def parse_object(self, raw: bytes) -> dict[str, Any]:
        """A body that must be one JSON object nested no deeper than ``--max-json-depth``."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise BadInput(f"The body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise BadInput("The body must be a JSON object")
        depth = self.settings.max_json_depth
        if raw.count(b"[") + raw.count(b"{") > depth and nesting_depth(body) > depth:
            raise BadInput(f"JSON nested deeper than {depth}")
        return body

    @asynccontextmanager
    async def admit(
        self,
        receive: Receive,
        headers: Mapping[str, str],
        cache_key: object = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[Call]:
        """Hold the client's slot (429 when it has its limit in flight) and take one request
        from the tenant's budget (429 when spent) for the call; its deadline is
        ``timeout_s`` (the server's ``--request-timeout`` by default) from now."""
        client = client_key(headers.get("authorization"), cache_key)
        if self.clients.full(client):
            raise client_limited(self.clients.limit)
        identity = current_identity()
        if identity is not None and self.budgets:
            await self.budgets.admit(identity.tenant)
        timeout = self.settings.request_timeout_s if timeout_s is None else timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        with self.clients.hold(client):
            yield Call(receive, deadline, timeout)
