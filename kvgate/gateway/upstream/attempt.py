"""One attempt of a fleet call on one upstream, as an operator sees it: counted once by how
it ended, timed, and traced.

An attempt starts when its upstream is chosen and ends once (``Attempt.ended``): ``ok`` (its
answer finished), a ``failures.Failure`` kind, ``refused`` (the upstream refused the caller's
input: a 4xx), ``cancelled`` (the client left first) or ``error`` (anything else). A finished
one adds the upstream's own usage and its latency to the fleet's figures (``fleet_metrics``).

With tracing on, an attempt is a CLIENT span under the call's SERVER span (the GenAI
semantic conventions, with the upstream's ``server.address`` and ``server.port``), in error
unless it ended ``ok`` or ``cancelled``. Its request carries the span's own ``traceparent``,
so an upstream that traces makes its span a child of this attempt: a retried call reads as
two attempts, each with what the upstream did under it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from kvgate.gateway.generation import Completion
from kvgate.gateway.ops import tracing
from kvgate.gateway.upstream.fleet_metrics import FleetMetrics
from kvgate.gateway.upstream.upstream import Upstream

OK, REFUSED, CANCELLED, ERROR = "ok", "refused", "cancelled", "error"
OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion"}


def outcome_of(exc: BaseException) -> str:
    """How an attempt ended that raised ``exc`` (other than an ``AttemptFailed``)."""
    if isinstance(exc, ValueError):  # a 4xx the caller's input earned (UnknownAdapter too)
        return REFUSED
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return CANCELLED
    return ERROR


class Attempt:
    """One request of a call to one upstream. ``headers``: the call's, with this attempt's
    ``traceparent`` when traced."""

    __slots__ = ("upstream", "asked", "headers", "outcome", "_observed", "_started", "_span")

    def __init__(
        self,
        upstream: Upstream,
        observed: FleetMetrics,
        wire_request: tuple[str, dict[str, Any], dict[str, str]],
        parent: tracing.Span | None,
    ) -> None:
        """``wire_request``: the upstream path, body and headers; ``parent``: the call's span."""
        path, body, headers = wire_request
        self.upstream, self._observed = upstream, observed
        self.asked = str(body["model"])
        self.outcome: str | None = None
        self._started = time.perf_counter()
        operation = OPERATIONS[path]
        self._span = tracing.client_span(
            f"{operation} {self.asked}",
            parent,
            {
                "gen_ai.operation.name": operation,
                "gen_ai.request.model": self.asked,
                "gen_ai.request.max_tokens": body["max_tokens"],
                "server.address": upstream.pool.host,
                "server.port": upstream.pool.port,
                "kvgate.upstream.index": upstream.index,
            },
        )
        self.headers = headers
        if self._span is not None:
            self.headers = dict(headers)
            tracing.inject(self.headers, self._span)

    def answered(self) -> None:
        """The upstream took the request (a 200): the model it was asked for is one it serves."""
        self._observed.served(self.asked)

    def first_text(self) -> None:
        """The upstream's first text arrived."""
        self._observed.ttft.of(*self._labels()).observe(time.perf_counter() - self._started)

    def finished(self, done: Completion) -> None:
        """The upstream's answer ended, with this usage."""
        labels = self._labels()
        observed = self._observed
        observed.e2e.of(*labels).observe(time.perf_counter() - self._started)
        observed.prompt_tokens.of(*labels).inc(done.prompt_tokens)
        observed.generation_tokens.of(*labels).inc(done.completion_tokens)
        tracing.annotate(self._span, **_usage(done))
        self.ended(OK)

    def ended(self, outcome: str) -> None:
        """Count and end the attempt, once: later calls change nothing."""
        if self.outcome is not None:
            return
        self.outcome = outcome
        self._observed.requests.of(*self._labels(), outcome).inc()
        if self._span is not None:
            self._span.set_attribute("kvgate.upstream.outcome", outcome)
            tracing.end(self._span, None if outcome in (OK, CANCELLED) else outcome)

    def _labels(self) -> tuple[str, str]:
        return str(self.upstream.index), self._observed.model(self.asked)


def _usage(done: Completion) -> dict[str, Any]:
    return {
        "gen_ai.usage.input_tokens": done.prompt_tokens,
        "gen_ai.usage.output_tokens": done.completion_tokens,
        "gen_ai.response.finish_reasons": [done.finish_reason],
    }
