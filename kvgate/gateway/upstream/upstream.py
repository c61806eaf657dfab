"""One upstream engine server: its pooled HTTP/1.1 client, breaker, in-flight count and
last scraped load figures.

``open`` sends a generation and returns a ``Lease`` on the upstream holding the response,
once the upstream has answered 200 —
an event stream when the body asked to stream, one JSON answer (or an event stream, which is
read the same way) when it did not; anything else is an ``AttemptFailed`` with its kind
(``failures.Failure``) or, for a 400/422 with an OpenAI error body, a ValueError carrying
the upstream's message (the caller's input was at fault; not retried); a 404 whose error
names ``model`` is an ``UnknownAdapter`` (the caller's LoRA adapter is not served there).

The client keeps no cookies, follows no redirect, asks
for no content coding (and decodes none), and sends ``--upstream-api-key`` as
``Authorization: Bearer`` on every request (calls, checks, scrapes).

The client is ``http1.Pool``: on benchmarks/fleet.py's overhead path (c=32 POSTs to an
instant upstream) it spends 0.02 ms of CPU per call where aiohttp spent 0.12 ms and httpx
1.1 ms (httpcore's pool scans every connection per request). Each upstream has two: one for
calls and proxied requests, capped at ``http1.MAX_CONNECTIONS``, and a small one for health
checks and scrapes, so that calls filling the first never make a check wait (and fail).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from kvgate.engine.errors import UnknownAdapter
from kvgate.gateway.upstream import bounded, http1
from kvgate.gateway.upstream.failures import (
    TRANSPORT_ERRORS,
    AttemptFailed,
    Failure,
    transport_failure,
)
from kvgate.gateway.upstream.health import Breaker
from kvgate.gateway.upstream.routing import Load
from kvgate.gateway.upstream.scrape import Scraped

OVERLOADED = (429, 503)
CLIENTS_FAULT = (400, 422)  # with an OpenAI error body: the caller's input was refused
ERROR_BODY_BYTES = 64 << 10


def headers(api_key: str | None) -> dict[str, str]:
    """What every request to an upstream carries."""
    if api_key is None:
        return dict(bounded.HEADERS)
    return {**bounded.HEADERS, "authorization": f"Bearer {api_key}"}


class Upstream:
    def __init__(
        self,
        index: int,
        url: str,
        breaker: Breaker,
        connect_timeout_s: float,
        read_timeout_s: float,
        api_key: str | None = None,
    ) -> None:
        self.index = index
        self.url = url
        self.breaker = breaker
        self._in_flight = 0  # this gateway's calls here: counted by their leases alone
        self.scraped: Scraped | None = None
        self._queued = 0.0  # the waiting figure of the scrape before the last
        self._scraped_at = 0.0
        self.read_timeout_s = read_timeout_s
        self.pool = http1.Pool(url, headers(api_key), connect_timeout_s, "application/json")
        self._checks = http1.Pool(url, headers(api_key), connect_timeout_s, max_connections=2)

    async def post(
        self, path: str, content: bytes, headers: dict[str, str] | None = None, whole: bool = False
    ) -> http1.Response:
        """A JSON POST's response, its body unread (the caller closes it); ``whole``: an
        answer that comes in one piece, with no bound on the silence before it (the call's
        deadline bounds it; a stalled upstream fails its checks)."""
        timeout = None if whole else self.read_timeout_s
        try:
            return await self.pool.request("POST", path, content, headers or None, timeout)
        except TRANSPORT_ERRORS as exc:
            raise transport_failure(exc, self.url) from None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    async def open(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Lease:
        """The call counted here from now until its lease is released; released at once
        when it fails to open."""
        lease = Lease(self)
        try:
            lease.response = await self._answered(path, body, headers)
        except BaseException:
            lease.release()
            raise
        return lease

    async def _answered(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> http1.Response:
        streamed = bool(body.get("stream"))
        response = await self.post(path, orjson.dumps(body), headers, whole=not streamed)
        status = response.status
        if status == 200 and not _readable(response, streamed):
            response.close()
            kind = response.headers.get("content-type", "none")
            answer = "an event stream" if streamed else "JSON or an event stream"
            raise AttemptFailed(
                Failure.MALFORMED, f"upstream {self.url}: a 200 that is not {answer} ({kind:.64})"
            )
        if status == 200:
            return response
        try:
            detail = await bounded.read_head(response, ERROR_BODY_BYTES)
        except TRANSPORT_ERRORS as exc:
            raise transport_failure(exc, self.url) from None
        finally:
            response.close()
        message = _error_message(detail.decode(errors="replace"))
        where = f"upstream {self.url}"
        if status in OVERLOADED:
            raise AttemptFailed(
                Failure.OVERLOADED,
                f"{where}: {message or status}",
                retry_after(response.headers.get("retry-after")),
            )
        if status >= 500:
            raise AttemptFailed(Failure.STATUS_5XX, f"{where}: {message or f'HTTP {status}'}")
        if status in CLIENTS_FAULT and message is not None:
            raise ValueError(message[:500])
        if status == 404 and message is not None and _names_model(detail):
            raise UnknownAdapter(str(body.get("model")))  # an adapter the upstream lacks
        raise AttemptFailed(Failure.STATUS, f"{where} answered HTTP {status}")

    def observe(self, scraped: Scraped | None) -> None:
        """A scrape's figures (None: it had none, or failed)."""
        self._queued = self.scraped.waiting if self.scraped is not None else 0.0
        self.scraped, self._scraped_at = scraped, time.monotonic()

    def load(self, max_age_s: float) -> Load:
        """This gateway's calls here, refined by the last scrape unless it is older than
        ``max_age_s`` (a stale figure is no figure)."""
        scraped = self.scraped
        if scraped is None or time.monotonic() - self._scraped_at > max_age_s:
            return Load(self._in_flight)
        return Load(
            self._in_flight,
            min(scraped.waiting, self._queued),
            scraped.running,
            scraped.kv_usage,
        )

    async def get_text(self, path: str, timeout_s: float, limit: int) -> str:
        """A GET's body of at most ``limit`` bytes (AttemptFailed on a transport error, a
        non-2xx answer or a body over the limit)."""
        try:
            async with asyncio.timeout(timeout_s):
                response = await self._checks.request("GET", path)
                try:
                    if not 200 <= response.status < 300:
                        raise AttemptFailed(
                            Failure.STATUS_5XX, f"{path} answered {response.status}"
                        )
                    body = await bounded.read_within(response, limit)
                finally:
                    response.close()
        except TRANSPORT_ERRORS as exc:
            raise transport_failure(exc, self.url) from None
        if body is None:
            raise AttemptFailed(Failure.MALFORMED, f"{path}: a body over {limit} bytes, or coded")
        return body.decode(errors="replace")

    async def check(self, path: str, timeout_s: float) -> None:
        """One active health check: any 2xx within ``timeout_s`` passes."""
        await self.get_text(path, timeout_s, bounded.MAX_BODY_BYTES)

    async def aclose(self) -> None:
        await asyncio.gather(self.pool.aclose(), self._checks.aclose())


class Lease:
    """One call's hold on an upstream: it counts in the upstream's ``in_flight`` (routing's
    load) from its making until ``release``, which also closes the response opened under it
    (an unfinished one drops its connection, which aborts the request upstream). Released
    once, however many times ``release`` is called: a call held across its start and its
    stream, closed from either, never counts twice or goes below zero."""

    __slots__ = ("upstream", "response", "_held")

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.response: http1.Response | None = None
        self._held = True
        upstream._in_flight += 1

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        self.upstream._in_flight -= 1
        if self.response is not None:
            self.response.close()


def _readable(response: http1.Response, streamed: bool) -> bool:
    """Is a 200 one the call can read: an event stream, or (not streamed) JSON; uncoded."""
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    wanted = ("text/event-stream",) if streamed else ("text/event-stream", "application/json")
    return kind in wanted and bounded.coded(response) is None


def _error_message(detail: str) -> str | None:
    """The message of an OpenAI-shaped error body (``{"error": {"message": …}}``, or vLLM's
    flat ``{"object": "error", "message": …}``); None for any other body."""
    try:
        body = orjson.loads(detail)
    except orjson.JSONDecodeError:
        return None
    error = body.get("error", body) if isinstance(body, dict) else None
    if isinstance(error, dict):
        message = error.get("message") or error.get("detail")
        return message if isinstance(message, str) and message else None
    return error if isinstance(error, str) and error else None


def _names_model(detail: bytes) -> bool:
    """Whether an OpenAI error body blames its ``model`` (vLLM's 404 for an unknown one)."""
    try:
        error = orjson.loads(detail).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("param") == "model"


def retry_after(value: str | None) -> float:
    """A ``Retry-After`` header's seconds (1 when absent or not a number of seconds)."""
    try:
        return max(float(value or 1), 0.0)
    except ValueError:
        return 1.0
