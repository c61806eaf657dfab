"""From step-thread token deltas to the reader's ``RequestOutput``, off the step thread.

Two pieces, after vLLM v1's output processor:

- ``OutputCollector``: the hand-off from a replica's step thread to one reader. The step
  thread ``put``s each request's ``StepOutput``; what the reader has not taken yet is merged
  into one pending item, so a reader far slower than generation holds O(1) items, not one per
  token. An error is final and replaces whatever was pending.
- ``OutputProcessor``: per request, in the reader's thread or task: detokenizes, applies stop
  strings (holding back text that may still become one), flushes held-back text at the end,
  and builds outputs of the requested ``OutputKind``. When a stop string matches it reports
  ``stopped`` and the caller aborts the request in the engine.

``OutputStream`` joins the two for one request's reader: the async iterator that
``kvgate.engine.async_llm`` (engine in this process) and ``kvgate.engine.process.core_client`` (engine in a process
of its own) hand out, each saying only how a request is let go of in its engine.
"""

from __future__ import annotations

import asyncio
import threading

from kvgate.engine.outputs import OutputKind, RequestOutput, StepOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.tokenization.tokenizer import Tokenizer


class OutputCollector:
    """One request's pending news, shared by a step thread (``put``) and an asyncio reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: StepOutput | BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: StepOutput | BaseException) -> None:
        """Step thread: merge ``item`` into what is pending; wake the reader if it was empty."""
        with self._lock:
            pending = self._pending
            if isinstance(pending, BaseException):
                return  # the request has already failed: nothing after that matters
            if isinstance(pending, StepOutput) and isinstance(item, StepOutput):
                pending.merge(item)
                return
            self._pending = item
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:  # the reader's event loop has closed
            pass

    @property
    def num_pending(self) -> int:
        """Items waiting for the reader: 0 or 1, however far behind it is."""
        return 0 if self._pending is None else 1

    async def get(self) -> StepOutput:
        """The merged news since the last call (raises the request's error, if it failed)."""
        while True:
            with self._lock:
                item, self._pending = self._pending, None
                if item is None:
                    self._ready.clear()
            if isinstance(item, BaseException):
                raise item
            if item is not None:
                return item
            await self._ready.wait()


class OutputProcessor:
    """Detokenization, stop strings and output shaping for one request."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Tokenizer,
        kind: OutputKind = OutputKind.CUMULATIVE,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.kind = kind
        self.stop = list(params.stop)
        self.min_tokens = params.min_tokens
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self._detokenizer = tokenizer.incremental(prompt_token_ids, params.skip_special_tokens)
        self._want_logprobs = params.logprobs is not None
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, float]] | None = [] if self._want_logprobs else None
        self.text = ""
        self.stopped = False  # a stop string matched: the engine must abort the request
        self.finished = False
        self._sent_tokens = 0
        self._sent_chars = 0

    def process(self, step: StepOutput) -> RequestOutput | None:
        """Apply one (merged) step delta; the output to hand out, or None when there is none
        for this kind (nothing visible yet, or FINAL_ONLY before the end)."""
        if self.finished:
            return None
        new_ids = step.new_token_ids
        self.token_ids.extend(new_ids)
        if self.logprobs is not None and step.new_logprobs is not None:
            self.logprobs.extend(step.new_logprobs)
        finish_reason = step.finish_reason
        # Text for every token but a final stop/EOS token, which is never shown (a stop with a
        # stop_reason ended on a dropped token: its last token is text).
        ended_by_token = finish_reason == "stop" and step.stop_reason is None
        shown = new_ids[:-1] if step.finished and ended_by_token else new_ids
        new_text = self._detokenizer.push(shown) if shown else ""
        if step.finished:
            new_text += self._detokenizer.flush()
        if new_text:
            self.text += new_text
            may_stop = len(self.token_ids) >= self.min_tokens
            if self.stop and may_stop and self._trim_stop_string(len(new_text)):
                self.stopped = True
                finish_reason = "stop"
        self.finished = step.finished or self.stopped
        return self._output(finish_reason if self.finished else None, step)

    def _trim_stop_string(self, new_chars: int) -> bool:
        """Cut the text before the earliest stop string that the new text completed."""
        start = max(0, len(self.text) - new_chars - self._hold)
        hits = [i for stop in self.stop if (i := self.text.find(stop, start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def _output(self, finish_reason: str | None, step: StepOutput) -> RequestOutput | None:
        visible = len(self.text)
        if self.stop and not self.finished:  # a stop string may still begin in this tail
            visible -= self._hold
        visible = max(visible, self._sent_chars)
        kind = self.kind
        if kind is OutputKind.FINAL_ONLY and not self.finished:
            return None
        if kind is OutputKind.DELTA:
            token_ids = self.token_ids[self._sent_tokens :]
            text = self.text[self._sent_chars : visible]
            logprobs = None if self.logprobs is None else self.logprobs[self._sent_tokens :]
            if not (token_ids or text or self.finished):
                return None
        else:
            token_ids, text = list(self.token_ids), self.text[:visible]
            logprobs = None if self.logprobs is None else list(self.logprobs)
        self._sent_tokens, self._sent_chars = len(self.token_ids), visible
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            token_ids=token_ids,
            text=text,
            num_output_tokens=len(self.token_ids),
            finished=self.finished,
            finish_reason=finish_reason,  # type: ignore[arg-type]
            stop_reason=step.stop_reason if self.finished and not self.stopped else None,
            cached_tokens=step.cached_tokens,
            replica=step.replica,
            logprobs=logprobs,
        )


class OutputStream:
    """One request's outputs, as an async iterator; ``aclose`` aborts it in the engine."""

    def __init__(
        self, request_id: str, collector: OutputCollector, processor: OutputProcessor
    ) -> None:
        self.request_id = request_id
        self._collector, self._processor = collector, processor
        self._done = False

    @property
    def num_buffered(self) -> int:
        """Outputs waiting for this reader: at most 1, however slow it is."""
        return self._collector.num_pending

    async def admitted(self) -> None:
        """Wait until the engine has admitted the request (raises what refused it)."""

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        await self.admitted()
        while not self._done:
            try:
                step = await self._collector.get()
            except Exception as exc:  # the step computing it failed: its blocks are freed
                self._close(abort=False)
                error = self._step_error(exc)
                if error is exc:
                    raise
                raise error from exc
            output = self._processor.process(step)
            if self._processor.finished:
                # A stop string ends it here: the engine may have run on, so abort it there.
                self._close(abort=not step.finished, reason="stop")
            if output is not None:
                return output
        raise StopAsyncIteration

    async def aclose(self) -> None:
        self._close(abort=True)

    def _close(self, abort: bool, reason: str = "abort") -> None:
        if self._done:
            return
        self._done = True
        self._release(abort, reason)

    def _release(self, abort: bool, reason: str) -> None:
        """Forget the request here, and abort it in the engine when ``abort``: it ended for
        ``reason`` ("abort": let go of; "stop": a stop string), as the engine counts it."""
        raise NotImplementedError

    def _step_error(self, exc: Exception) -> Exception:
        """What the reader gets when the step computing its request failed with ``exc``."""
        return exc
