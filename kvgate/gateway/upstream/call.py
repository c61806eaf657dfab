"""One fleet call: its attempts on upstreams, and its stream relayed as ``TextDelta``s and a
``Completion``.

``connect`` opens the stream on the best untried upstream, trying the next choice on the ring
once when one fails; a failure before anything was yielded is retried the same way from inside
the stream, one after is ``UpstreamFailed``. That failover sends the request again to another
upstream, whatever the first one did with it: a generation has no effect beyond its answer,
and the first one's connection is closed, which aborts it there. The upstream being read is
held by a ``Lease`` (its in-flight count); ``UpstreamCall.aclose`` always releases it. All a
call knows of the fleet is a ``choice.Route``. Each try is an ``attempt.Attempt``: counted by
how it ended, timed, and traced as a child of the call's span.

The stream is read within bounds (``bounded``: lines, events, bytes) and no further than the
request asked: more than ``max_tokens`` + ``TOKEN_SLACK`` tokens, or ``EVENT_SLACK`` more
events than that (or ``bounded.LINES_PER_EVENT`` lines per such event, comments and blank
lines included), is a malformed reply; once ``max_tokens`` tokens or a ``finish_reason``
have come, the rest of the stream (finish, usage, ``[DONE]``) has ``TAIL_S`` to arrive —
an upstream that stalls or streams on after its answer is cut there (a 502 when it never
said it had finished, else the answer as it stands).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from kvgate.engine.errors import AdmissionRefused, EngineOverloaded, EngineUnavailable
from kvgate.gateway.calls.errors import UpstreamFailed
from kvgate.gateway.generation import Completion, GenerationRequest, TextDelta
from kvgate.gateway.ops import tracing
from kvgate.gateway.upstream import bounded, wire
from kvgate.gateway.upstream.attempt import CANCELLED, Attempt, outcome_of
from kvgate.gateway.upstream.choice import Route
from kvgate.gateway.upstream.failures import (
    TRANSPORT_ERRORS,
    AttemptFailed,
    Failure,
    transport_failure,
)
from kvgate.gateway.upstream.fleet_metrics import FleetMetrics
from kvgate.gateway.upstream.precise import PromptBlocks
from kvgate.gateway.upstream.upstream import Lease, Upstream

RETRIES = 1
TOKEN_SLACK = 8  # tokens past max_tokens an upstream may send (counted as it chunks them)
EVENT_SLACK = 16  # events beyond that: role, finish, usage, [DONE], empty deltas
TAIL_S = 1.5  # after the last token asked for: seconds for the stream's end to arrive


class UpstreamCall:
    """One call's attempts: the upstreams tried, the lease on the one streaming now, the
    retry left."""

    def __init__(
        self,
        route: Route,
        observed: FleetMetrics,
        token_ids: wire.TokenIds | None,
        request: GenerationRequest,
        hashes: list[bytes],
        wire_request: tuple[str, dict[str, Any], dict[str, str]],
    ) -> None:
        """``wire_request``: the upstream path, body and headers (``wire.request_body``)."""
        self.route, self.observed, self.token_ids = route, observed, token_ids
        self.request, self.hashes = request, hashes
        self.path, self.body, self.headers = wire_request
        self.tried: set[int] = set()
        self.retries = RETRIES
        self.lease: Lease | None = None
        self.attempt: Attempt | None = None  # the latest
        self.parent = tracing.current_span()  # the call's, for its attempts' spans
        self.last: AttemptFailed | None = None
        self.placed: Upstream | None = None  # the upstream the key's placement record names
        self.prompt: PromptBlocks | None = None  # its blocks, for precise routing

    @property
    def upstream(self) -> Upstream | None:
        """The upstream being read now."""
        return None if self.lease is None else self.lease.upstream

    async def connect(self) -> None:
        """Open the stream on the best untried upstream; on failure try the next once.
        Raises AdmissionRefused when none can take it, ValueError for a 4xx."""
        while True:
            try:
                upstream = self.route.choose(
                    self.hashes, self.request.cache_key, self.tried, self.placed, self.prompt
                )
            except EngineUnavailable:
                if self.last is not None and self.last.kind is Failure.OVERLOADED:  # pass it on
                    raise EngineOverloaded(str(self.last), self.last.retry_after_s) from None
                if self.last is not None and self.last.kind.gives_up:  # not a full fleet
                    raise UpstreamFailed(str(self.last)) from None
                raise
            self.tried.add(upstream.index)
            wire_request = (self.path, self.body, self.headers)
            attempt = self.attempt = Attempt(upstream, self.observed, wire_request, self.parent)
            try:
                self.lease = await upstream.open(self.path, self.body, attempt.headers)
            except AttemptFailed as failure:
                attempt.ended(failure.kind)
                self._retry_or_refuse(upstream, failure)
                continue
            except BaseException as exc:
                attempt.ended(outcome_of(exc))
                raise
            attempt.answered()
            return

    def _retry_or_refuse(self, upstream: Upstream, failure: AttemptFailed) -> None:
        self.route.failed(upstream, failure)
        self.last = failure.unraised()
        if self.retries == 0:
            if failure.kind.gives_up:
                raise UpstreamFailed(str(failure))
            refusal = EngineOverloaded if failure.kind is Failure.OVERLOADED else EngineUnavailable
            raise refusal(str(failure), failure.retry_after_s)
        self.retries -= 1
        self.observed.count("kvgate_upstream_retries", upstream=str(upstream.index))

    async def relay(self) -> AsyncGenerator[TextDelta | Completion]:
        sent = 0
        try:
            while True:
                try:
                    async for item in self._items():
                        if isinstance(item, TextDelta):
                            sent += 1
                        yield item
                    return
                except AttemptFailed as failure:
                    assert self.attempt is not None
                    self.attempt.ended(failure.kind)
                    upstream = self._release()
                    if sent:
                        self.route.failed(upstream, failure)
                        raise UpstreamFailed(f"{failure} after {sent} chunks") from None
                    try:
                        self._retry_or_refuse(upstream, failure)
                        await self.connect()
                    except (AdmissionRefused, ValueError) as exc:  # say what failed first
                        raise UpstreamFailed(f"{failure}; no retry: {exc}") from None
        finally:
            await self.aclose()

    def _items(self) -> AsyncIterator[TextDelta | Completion]:
        """The current upstream's answer as deltas then one Completion (AttemptFailed if it
        breaks, stalls past the read timeout, reports an error, runs past its bounds or ends
        early)."""
        assert self.lease is not None and self.lease.response is not None
        kind = self.lease.response.headers.get("content-type", "")
        return self._stream() if kind.startswith("text/event-stream") else self._whole()

    async def _whole(self) -> AsyncIterator[TextDelta | Completion]:
        """A non-streamed answer: read within the stream's budget, parsed once, checked as
        its chunks would be, relayed as one delta and the Completion."""
        lease = self.lease
        assert lease is not None and lease.response is not None
        upstream, asked = lease.upstream, self.request.params.max_tokens
        try:
            data = await bounded.read_within(lease.response, bounded.stream_budget(asked))
            if data is None:
                raise wire.StreamError("malformed answer from the upstream: over its budget")
            chunk = wire.parse_body(data)
            if chunk.tokens > asked + TOKEN_SLACK:
                raise wire.StreamError(f"over {chunk.tokens - 1} tokens for max_tokens {asked}")
            if chunk.finish_reason is None:
                raise wire.StreamError("malformed answer from the upstream: no finish_reason")
            calls = wire.ToolCalls()
            calls.add(chunk.tool_calls)
        except TRANSPORT_ERRORS as exc:
            raise transport_failure(exc, upstream.url) from None
        except wire.StreamError as exc:
            raise AttemptFailed(Failure.MALFORMED, f"upstream {upstream.url}: {exc}") from None
        if chunk.tokens:
            self._first_text()
            yield self._delta(chunk, chunk.tokens)
        reasoning = chunk.reasoning or None
        yield self._done(
            chunk.text, chunk.finish_reason, chunk.usage, chunk.tokens, calls, reasoning
        )

    def _done(
        self,
        text: str,
        finish: str,
        usage: dict[str, Any] | None,
        count: int,
        calls: wire.ToolCalls,
        reasoning: str | None,
    ) -> Completion:
        upstream = self.upstream
        assert upstream is not None
        upstream.breaker.success()
        usage = usage or {}
        done = Completion(
            text=text,
            finish_reason=finish,
            prompt_tokens=usage.get("prompt_tokens") or 0,
            completion_tokens=usage.get("completion_tokens") or count,
            cached_tokens=wire.cached_tokens(usage),
            replica=upstream.index,
            upstream=upstream.url,
            tool_calls=calls.calls or None,  # read into shape below (function_calls.reading)
            reasoning=reasoning,
        )
        assert self.attempt is not None
        self.attempt.finished(done)
        return done

    def _first_text(self) -> None:
        assert self.attempt is not None
        self.attempt.first_text()

    async def _stream(self) -> AsyncIterator[TextDelta | Completion]:
        lease = self.lease
        assert lease is not None and lease.response is not None
        upstream, text, count, events, finish, usage = lease.upstream, [], 0, 0, None, None
        calls, thought = wire.ToolCalls(), list[str]()
        asked = self.request.params.max_tokens
        most = asked + TOKEN_SLACK + EVENT_SLACK
        lines = bounded.sse_lines(
            lease.response.chunks(), bounded.stream_budget(asked), bounded.LINES_PER_EVENT * most
        )
        tail_at: float | None = None
        try:
            while True:
                try:
                    if tail_at is not None:
                        async with asyncio.timeout_at(tail_at):
                            line = await anext(lines)
                    elif self.request.streamed:  # the client's read timeout bounds silence
                        line = await anext(lines)
                    else:  # asked whole, sent as a stream: its silences bounded here
                        async with asyncio.timeout(upstream.read_timeout_s):
                            line = await anext(lines)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if tail_at is None:  # the read timeout: a transport failure
                        raise
                    if finish is None:
                        raise wire.StreamError(
                            f"no finish_reason within {TAIL_S:g} s of max_tokens {asked}"
                        ) from None
                    break  # answered: the connection is closed, not pooled
                chunk = wire.parse_line(line)
                if chunk is None:
                    continue
                events += 1
                if events > most:
                    raise wire.StreamError(f"over {events - 1} events for max_tokens {asked}")
                if chunk.done:  # read on to the body's end: a drained connection is pooled,
                    continue  # one left mid-body is closed (a TCP connect per call, ~0.5 ms)
                usage = chunk.usage or usage
                finish = chunk.finish_reason or finish
                if chunk.tokens:
                    if not count:
                        self._first_text()
                    count += chunk.tokens
                    if count > asked + TOKEN_SLACK:
                        raise wire.StreamError(f"over {count - 1} tokens for max_tokens {asked}")
                    text.append(chunk.text)
                    thought.append(chunk.reasoning)
                    calls.add(chunk.tool_calls)
                    yield self._delta(chunk, count)
                if tail_at is None and (finish is not None or count >= asked):
                    tail_at = asyncio.get_running_loop().time() + TAIL_S
        except TRANSPORT_ERRORS as exc:
            raise transport_failure(exc, upstream.url) from None
        except wire.StreamError as exc:
            raise AttemptFailed(Failure.MALFORMED, f"upstream {upstream.url}: {exc}") from None
        finally:
            await lines.aclose()
        if finish is None:
            raise AttemptFailed(Failure.RESET, f"upstream {upstream.url} ended the stream early")
        yield self._done("".join(text), finish, usage, count, calls, "".join(thought) or None)

    def _delta(self, chunk: wire.Chunk, count: int) -> TextDelta:
        token_ids, tool_calls = self.token_ids, chunk.tool_calls or None
        final = chunk.finish_reason is not None  # the body's end follows (the stream's tail)
        if not chunk.logprobs or token_ids is None or self.request.params.logprobs is None:
            return TextDelta(chunk.text, count, [], None, tool_calls, chunk.reasoning, final)
        ids, entries = token_ids.entries(chunk.logprobs)
        return TextDelta(chunk.text, count, ids, entries, tool_calls, chunk.reasoning, final)

    def _release(self) -> Upstream:
        lease, self.lease = self.lease, None
        assert lease is not None
        lease.release()
        return lease.upstream

    async def aclose(self) -> None:
        """The call is done or abandoned: its lease released (an unfinished stream's
        connection dropped, which aborts the request upstream), an unfinished attempt
        counted as cancelled."""
        if self.attempt is not None:
            self.attempt.ended(CANCELLED)
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()
