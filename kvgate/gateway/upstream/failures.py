"""Why one attempt on an upstream failed, and what each cause means to the fleet.

An ``AttemptFailed`` is the fleet's own: one request to one upstream went wrong, and the call
may still go on elsewhere. What a client sees is decided from its ``Failure`` kind by the call
(``UpstreamFailed``, a refusal, or a retry on the next upstream), and the kind is the
``kind`` label of ``kvgate_upstream_errors``.

Only what says the upstream itself is unwell counts against its breaker (``Failure.breaks``):
a transport failure, a timeout, a 5xx, an answer no upstream should give. What a reply says —
which a caller's prompt may steer (``malformed``) — or an overload answer never takes an
upstream out for everyone.
"""

from __future__ import annotations

from enum import StrEnum

from kvgate.gateway.upstream.http1 import ConnectError

# What a failing upstream connection raises: the client's errors (OSErrors) and timeouts.
TRANSPORT_ERRORS = (TimeoutError, OSError)


class Failure(StrEnum):
    CONNECT = "connect"  # no connection: refused, unresolvable, TLS failed, timed out
    TIMEOUT = "timeout"  # silent past the read timeout
    RESET = "reset"  # the connection broke, or the stream ended before its answer did
    STATUS_5XX = "status_5xx"  # a 5xx other than an overload answer (or a failed check)
    OVERLOADED = "overloaded"  # 429 or 503: busy, not broken
    STATUS = "status"  # an answer no upstream should give: a redirect, 401, 404, ...
    MALFORMED = "malformed"  # a reply whose content is wrong

    @property
    def breaks(self) -> bool:
        """Does it count against the upstream's health?"""
        return self not in (Failure.OVERLOADED, Failure.MALFORMED)

    @property
    def gives_up(self) -> bool:
        """Is the call, once out of retries, a failure (502) rather than a full fleet (503)?
        The upstream answered, wrongly: a client trying again later gains nothing."""
        return self in (Failure.STATUS, Failure.MALFORMED)


class AttemptFailed(Exception):
    """One request to one upstream failed (``kind``); ``retry_after_s`` for an overload."""

    def __init__(self, kind: Failure, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.kind = kind
        self.retry_after_s = retry_after_s

    @property
    def breaks(self) -> bool:
        return self.kind.breaks

    def unraised(self) -> AttemptFailed:
        """The same failure, never raised: one caught holds the frames it came through (a
        call's stream buffers among them, kept until the cyclic GC runs; under an endless
        line, +300 MiB), so a failure kept for later is this copy."""
        return AttemptFailed(self.kind, str(self), self.retry_after_s)


def transport_failure(exc: BaseException, url: str) -> AttemptFailed:
    """A transport error or timeout (``TRANSPORT_ERRORS``) as the failure it is."""
    if isinstance(exc, TimeoutError):
        kind = Failure.TIMEOUT
    elif isinstance(exc, ConnectError | ConnectionRefusedError):
        kind = Failure.CONNECT
    else:
        kind = Failure.RESET
    return AttemptFailed(kind, f"upstream {url}: {type(exc).__name__} {exc}".strip())
