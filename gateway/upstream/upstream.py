"""One upstream engine server: its pooled HTTP/1.1 client, breaker, in-flight count and
last scraped load figures.

``open_stream`` sends a streamed generation and returns the response once the upstream has
answered 200; anything else is an ``UpstreamFailure`` with its kind (``connect``,
``timeout``, ``reset``, ``status_5xx``, ``overloaded`` for 429/503) or, for a 4xx, a
ValueError carrying the upstream's message (the caller's input was at fault; not retried).
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import orjson

from gateway.upstream.health import Breaker
from gateway.upstream.routing import Load
from gateway.upstream.scrape import Scraped

OVERLOADED = (429, 503)


class UpstreamFailure(Exception):
    def __init__(self, kind: str, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s

    @property
    def breaks(self) -> bool:
        """Does it count against the upstream's health (an overload answer does not)?"""
        return self.kind != "overloaded"


def failure_of(exc: httpx.TransportError, url: str) -> UpstreamFailure:
    if isinstance(exc, httpx.TimeoutException):
        kind = "timeout"
    elif isinstance(exc, httpx.ConnectError):
        kind = "connect"
    else:
        kind = "reset"
    return UpstreamFailure(kind, f"upstream {url}: {type(exc).__name__} {exc}".strip())


class Upstream:
    def __init__(
        self,
        index: int,
        url: str,
        breaker: Breaker,
        connect_timeout_s: float,
        read_timeout_s: float,
    ) -> None:
        self.index = index
        self.url = url
        self.breaker = breaker
        self.in_flight = 0
        self.scraped: Scraped | None = None
        self._queued = 0.0  # the waiting figure of the scrape before the last
        self._scraped_at = 0.0
        self.client = httpx.AsyncClient(
            base_url=url,
            timeout=httpx.Timeout(read_timeout_s, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        )

    async def open_stream(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> httpx.Response:
        request = self.client.build_request(
            "POST",
            path,
            content=orjson.dumps(body),
            headers={"content-type": "application/json", **headers},
        )
        try:
            response = await self.client.send(request, stream=True)
        except httpx.TransportError as exc:
            raise failure_of(exc, self.url) from None
        if response.status_code == 200:
            return response
        try:
            detail = (await response.aread()).decode(errors="replace")[:500]
        except httpx.TransportError as exc:
            raise failure_of(exc, self.url) from None
        finally:
            await response.aclose()
        message = _error_message(detail) or f"HTTP {response.status_code}"
        if response.status_code in OVERLOADED:
            raise UpstreamFailure(
                "overloaded", f"upstream {self.url}: {message}", _retry_after(response)
            )
        if response.status_code >= 500:
            raise UpstreamFailure("status_5xx", f"upstream {self.url}: {message}")
        raise ValueError(message)

    def observe(self, scraped: Scraped | None) -> None:
        """A scrape's figures (None: it had none, or failed)."""
        self._queued = self.scraped.waiting if self.scraped is not None else 0.0
        self.scraped, self._scraped_at = scraped, time.monotonic()

    def load(self, max_age_s: float) -> Load:
        """This gateway's calls here, refined by the last scrape unless it is older than
        ``max_age_s`` (a stale figure is no figure)."""
        scraped = self.scraped
        if scraped is None or time.monotonic() - self._scraped_at > max_age_s:
            return Load(self.in_flight)
        return Load(
            self.in_flight,
            min(scraped.waiting, self._queued),
            scraped.running,
            scraped.kv_usage,
        )

    async def get_text(self, path: str, timeout_s: float) -> str:
        """A GET's body (UpstreamFailure on a transport error or a non-2xx answer)."""
        try:
            response = await self.client.get(path, timeout=timeout_s)
        except httpx.TransportError as exc:
            raise failure_of(exc, self.url) from None
        if not response.is_success:
            raise UpstreamFailure("status_5xx", f"{path} answered {response.status_code}")
        return response.text

    async def check(self, path: str, timeout_s: float) -> None:
        """One active health check: any 2xx within ``timeout_s`` passes."""
        await self.get_text(path, timeout_s)

    async def aclose(self) -> None:
        await self.client.aclose()


def _error_message(detail: str) -> str | None:
    """The message of an OpenAI-shaped error body (``{"error": {"message": …}}``)."""
    try:
        body = orjson.loads(detail)
    except orjson.JSONDecodeError:
        return detail.strip() or None
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict):
        return str(error.get("message") or error.get("detail") or error)
    return str(error)


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(float(response.headers.get("retry-after", "1")), 0.0)
    except ValueError:
        return 1.0
