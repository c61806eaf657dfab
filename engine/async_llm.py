"""The asyncio face of the engine, used by the HTTP gateway.

Each replica steps in its own thread; outputs cross into the event loop with
``loop.call_soon_threadsafe`` onto one asyncio.Queue per request (bounded without a maxsize:
one item per token, so at most max_tokens + 1). Leaving the ``generate`` iterator early —
``aclose()``, task cancellation, a client gone — aborts the request at the next step boundary.

Admission: a request is placed only on a replica that is stepping and has fewer than
``max_waiting`` requests waiting; otherwise ``generate`` raises AdmissionRefused at once
(nothing queued), so a burst meets a clear refusal instead of an ever longer queue.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from engine.config import EngineConfig
from engine.engine_core import EngineCore, Prompt
from engine.errors import EngineStepError
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from engine.tokenizer import Tokenizer

_Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[RequestOutput | BaseException]"]


class AsyncLLM:
    def __init__(self, config: EngineConfig | None = None, **options: Any):
        """Load the model and start one step thread per replica. ``options`` build an
        EngineConfig when none is given."""
        self.config = config if config is not None else EngineConfig(**options)
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self.core = EngineCore(self.config, on_output=self._deliver)
        self._closed = False
        for replica in self.core.replicas:
            replica.start()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.tokenizer

    @property
    def model_name(self) -> str:
        return self.core.model_name

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        """Token ids of the conversation with the assistant's turn opened."""
        return self.core.tokenizer.encode_chat(list(messages), add_generation_prompt=True)

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        cache_key: str | None = None,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs, each with the delta since the previous one; the last has
        ``finished`` set. ``cache_salt`` keeps one tenant's cached blocks from another's.
        Raises ValueError for bad input and AdmissionRefused when no replica can take it,
        both before anything is queued; EngineStepError if the step computing it fails."""
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        request = self.core.make_request(prompt, params, cache_key, cache_salt)
        replica = self.core.admit(request)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            self._streams[request.request_id] = (loop, queue)
        finished = False
        try:
            replica.submit(request)  # refuses if the replica died since admit chose it
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    if isinstance(item, EngineStepError):
                        raise EngineStepError(f"engine replica {replica.index}: {item}") from item
                    raise RuntimeError(f"engine replica {replica.index}: {item}") from item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request.request_id, None)
            if not finished:
                replica.abort(request)

    def _deliver(self, request: Request, item: RequestOutput | BaseException) -> None:
        """Runs on a replica's step thread."""
        with self._lock:
            stream = self._streams.get(request.request_id)
        if stream is None:
            return
        loop, queue = stream
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop has closed
            pass

    def stats(self) -> EngineStats:
        return self.core.stats()

    def replicas_ready(self) -> list[bool]:
        """Per replica: stepping (not stalled past ``step_timeout_s``, not failed)."""
        return [r.available for r in self.core.replicas]

    def is_ready(self) -> bool:
        return not self._closed and all(self.replicas_ready())

    def shutdown(self) -> None:
        """Stop the step threads (idempotent)."""
        self._closed = True
        for replica in self.core.replicas:
            replica.stop()
        with self._lock:
            streams = list(self._streams.values())
        for loop, queue in streams:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, RuntimeError("engine shut down"))
            except RuntimeError:
                pass
