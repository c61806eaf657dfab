"""One log line per call (``--no-access-log`` turns it off), never its prompt or its reply::

    openai /v1/chat/completions status=200 outcome=ok tokens_in=12 tokens_out=64
        ttft=0.031s duration=0.412s tenant=acme
    mcp tools/call generate status=200 outcome=tool_error tokens_in=9 tokens_out=0
        ttft=- duration=0.004s tenant=-

(each one line). ``AccessLog`` wraps the app: it opens a ``CallRecord`` for every HTTP request
(in a context variable) and reads the status the answer starts with; a door names the call
(``called``: its route or MCP method, tool, outcome and tenant) and
``kvgate.gateway.calls.generations`` counts its tokens and times its first one (``counted``), so the
line comes out whichever door and backend served it. Requests no door named (``/metrics``,
``/healthz``, probes) write nothing. uvicorn's own access log stays off (``serve_app``): one
line per call, not two.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvgate.gateway.auth.identity import current as current_identity
from kvgate.gateway.generation import Completion, Stream, TextDelta

log = logging.getLogger("kvgate.access")


@dataclass
class CallRecord:
    started: float = field(default_factory=time.perf_counter)
    api: str = ""  # the door: openai or mcp ("" until a door names the call)
    method: str = ""  # its route or MCP method
    tool: str = ""
    outcome: str = ""
    tenant: str = ""
    status: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    first_token: float | None = None  # perf_counter when its first token came

    def line(self, ended: float) -> str:
        name = f"{self.api} {self.method}" + (f" {self.tool}" if self.tool else "")
        ttft = "-" if self.first_token is None else f"{self.first_token - self.started:.3f}s"
        return (
            f"{name} status={self.status} outcome={self.outcome} tokens_in={self.prompt_tokens}"
            f" tokens_out={self.completion_tokens} ttft={ttft}"
            f" duration={ended - self.started:.3f}s tenant={self.tenant or '-'}"
        )


_record: ContextVar[CallRecord | None] = ContextVar("kvgate_call_record", default=None)


def current() -> CallRecord | None:
    """The record of the call being served; None when the access log is off."""
    return _record.get()


def called(api: str, method: str, tool: str | None, outcome: str) -> None:
    """A door names the call it served (with the tenant it ran for)."""
    record = _record.get()
    if record is None:
        return
    identity = current_identity()
    record.api, record.method, record.tool, record.outcome = api, method, tool or "", outcome
    record.tenant = identity.tenant if identity is not None else ""


async def counted(items: Stream, record: CallRecord) -> AsyncGenerator[TextDelta | Completion]:
    """``items`` (a generation's deltas, then its completion) passed on, counted into
    ``record``: when the first one came, and the completion's token counts (an ``n > 1``
    call's choices add up)."""
    async with aclosing(items):
        async for item in items:
            if record.first_token is None:
                record.first_token = time.perf_counter()
            if isinstance(item, Completion):
                record.prompt_tokens += item.prompt_tokens
                record.completion_tokens += item.completion_tokens
            yield item


class AccessLog:
    """ASGI middleware: a ``CallRecord`` per HTTP request, and its line once answered."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = CallRecord()
        reset = _record.set(record)

        async def answering(message: Message) -> None:
            if message["type"] == "http.response.start":
                record.status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, answering)
        finally:
            _record.reset(reset)
            if record.api:
                log.info("%s", record.line(time.perf_counter()))
