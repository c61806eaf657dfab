"""Why a call was not answered with a result: one tree, whatever door the call came through.

Backends and the call lifecycle raise these; engine and upstream failures are translated
into them below the doors (``kvgate.gateway.generation``), so no door knows which backend ran the
call. Each door maps the tree to its own wire in one function (JSON-RPC errors and tool errors
for MCP, ``{"error": …}`` bodies and statuses for OpenAI).

CallError                   the root
├── BadInput                the caller can fix it; ``field`` names what to change
│   └── NotFound            what it names (a model, a LoRA adapter) is not served here: 404
├── Rejected                refused at the transport (method, media type, body size or time,
│                           Origin/Host): an HTTP ``status``, before any call began
├── Refused                 not started now, nothing queued: 429 (this client's or tenant's
│                           own limit) or 503 (capacity), with ``retry_after_s``
├── DeadlineExceeded        the call ran past its deadline and was cancelled
└── GenerationFailed        the generation broke after it was admitted (an engine step failed);
    └── UpstreamFailed      a fleet upstream broke off the call or answered what cannot be
                            relayed (a bad gateway, not the caller's fault)
``kvgate.gateway.auth.challenge.Challenge`` (a refused credential) is a CallError too.
"""

from __future__ import annotations

import math


class CallError(Exception):
    """A call that ends without a result. ``reason``, when set, is counted in
    ``kvgate_rejected_requests_total{reason}``."""

    reason: str | None = None


class BadInput(CallError):
    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field  # the request field to change (OpenAI ``param``), when known


class NotFound(BadInput):
    pass


class Rejected(CallError):
    def __init__(self, status: int, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


class Refused(CallError):
    reason: str

    def __init__(self, status: int, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.status = status  # 429: this client's or tenant's own limit; 503: capacity
        self.reason = reason
        self.retry_after_s = max(1, math.ceil(retry_after_s))  # whole seconds, as HTTP says


class DeadlineExceeded(CallError):
    reason: str | None = "deadline"

    def __init__(self, timeout_s: float) -> None:
        super().__init__(f"Request timed out after {timeout_s:g} s; the generation was cancelled")
        self.timeout_s = timeout_s


class GenerationFailed(CallError):
    """Retrying may well succeed: the engine keeps serving, the fleet tries other upstreams."""


class UpstreamFailed(GenerationFailed):
    pass
