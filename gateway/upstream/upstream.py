"""One upstream engine server: its pooled HTTP/1.1 client, breaker, in-flight count and
last scraped load figures.

``open_stream`` sends a streamed generation and returns the response once the upstream has
answered 200 with an event stream; anything else is an ``UpstreamFailure`` with its kind
(``connect``, ``timeout``, ``reset``, ``status_5xx``, ``overloaded`` for 429/503, ``status``
for an answer no upstream should give: a redirect, 401, 404, …; ``malformed`` for a reply
whose content is wrong) or, for a 400/422 with an OpenAI error body, a ValueError carrying
the upstream's message (the caller's input was at fault; not retried); a 404 whose error
names ``model`` is an ``UnknownAdapter`` (the caller's LoRA adapter is not served there).

Only transport failures, timeouts, 5xx and unexpected statuses count against the breaker
(``UpstreamFailure.breaks``): what a reply says — which a caller's prompt may steer — never
takes an upstream out for everyone. The client keeps no cookies, follows no redirect, asks
for no content coding, and sends ``--upstream-api-key`` as ``Authorization: Bearer`` on
every request (calls, checks, scrapes).
"""

from __future__ import annotations

import time
from http.cookiejar import Cookie, CookieJar
from typing import Any

import httpx
import orjson

from engine.errors import UnknownAdapter
from gateway.upstream import bounded
from gateway.upstream.health import Breaker
from gateway.upstream.routing import Load
from gateway.upstream.scrape import Scraped

OVERLOADED = (429, 503)
CLIENTS_FAULT = (400, 422)  # with an OpenAI error body: the caller's input was refused
NOT_COUNTED = frozenset(("overloaded", "malformed"))
ERROR_BODY_BYTES = 64 << 10


class UpstreamFailure(Exception):
    def __init__(self, kind: str, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s

    @property
    def breaks(self) -> bool:
        """Does it count against the upstream's health (an overload answer does not)?"""
        return self.kind not in NOT_COUNTED


class NoCookies(CookieJar):
    """A cookie jar that keeps nothing: an upstream's ``Set-Cookie`` never reaches another
    call (or another tenant's)."""

    def set_cookie(self, cookie: Cookie) -> None:
        pass

    def extract_cookies(self, response: Any, request: Any) -> None:
        pass


def headers(api_key: str | None) -> dict[str, str]:
    """What every request to an upstream carries."""
    if api_key is None:
        return dict(bounded.HEADERS)
    return {**bounded.HEADERS, "authorization": f"Bearer {api_key}"}


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
        api_key: str | None = None,
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
            headers=headers(api_key),
            cookies=NoCookies(),
            follow_redirects=False,
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
        status = response.status_code
        if status == 200 and not _event_stream(response):
            await response.aclose()
            kind = response.headers.get("content-type", "none")
            raise UpstreamFailure(
                "malformed", f"upstream {self.url}: a 200 that is no event stream ({kind:.64})"
            )
        if status == 200:
            return response
        try:
            detail = await bounded.read_head(response, ERROR_BODY_BYTES)
        except httpx.TransportError as exc:
            raise failure_of(exc, self.url) from None
        finally:
            await response.aclose()
        message = _error_message(detail.decode(errors="replace"))
        where = f"upstream {self.url}"
        if status in OVERLOADED:
            raise UpstreamFailure(
                "overloaded", f"{where}: {message or status}", _retry_after(response)
            )
        if status >= 500:
            raise UpstreamFailure("status_5xx", f"{where}: {message or f'HTTP {status}'}")
        if status in CLIENTS_FAULT and message is not None:
            raise ValueError(message[:500])
        if status == 404 and message is not None and _names_model(detail):
            raise UnknownAdapter(str(body.get("model")))  # an adapter the upstream lacks
        raise UpstreamFailure("status", f"{where} answered HTTP {status}")

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

    async def get_text(self, path: str, timeout_s: float, limit: int) -> str:
        """A GET's body of at most ``limit`` bytes (UpstreamFailure on a transport error, a
        non-2xx answer or a body over the limit)."""
        try:
            request = self.client.build_request("GET", path, timeout=timeout_s)
            response = await self.client.send(request, stream=True)
            try:
                if not response.is_success:
                    raise UpstreamFailure("status_5xx", f"{path} answered {response.status_code}")
                body = await bounded.read_within(response, limit)
            finally:
                await response.aclose()
        except httpx.TransportError as exc:
            raise failure_of(exc, self.url) from None
        if body is None:
            raise UpstreamFailure("malformed", f"{path}: a body over {limit} bytes, or coded")
        return body.decode(errors="replace")

    async def check(self, path: str, timeout_s: float) -> None:
        """One active health check: any 2xx within ``timeout_s`` passes."""
        await self.get_text(path, timeout_s, bounded.MAX_BODY_BYTES)

    async def aclose(self) -> None:
        await self.client.aclose()


def _event_stream(response: httpx.Response) -> bool:
    kind = response.headers.get("content-type", "").split(";")[0].strip().lower()
    return kind == "text/event-stream" and bounded.coded(response) is None


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


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(float(response.headers.get("retry-after", "1")), 0.0)
    except ValueError:
        return 1.0
