"""The API process's face of an engine that runs in a process of its own.

``EngineClient`` offers what ``AsyncLLM`` offers the gateway (``kvgate.gateway.embedded.Engine``)
over one Unix socket to ``kvgate.engine.process.core_process``: prompts are tokenized, templated and checked
here (``PromptRules``, with the tokenizer and limits the engine sent when it connected), and
each request's news is detokenized and checked for stop strings here (``OutputProcessor``);
the engine process only schedules and computes. Nothing here imports torch.

A reader thread takes the engine's frames (one per step and connection) and hands each to the
event loop in one call, which wakes the requests it names. If the engine process dies the
client is not ready at once, every request in flight fails (``EngineStepError`` once started,
``EngineUnavailable`` while being admitted), and the reader reconnects to the same socket
until the supervisor has started the engine again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import kvgate.engine.process.ipc as ipc
from kvgate.engine.core.prompt_rules import Prompt, PromptRules
from kvgate.engine.errors import EngineStepError, EngineUnavailable
from kvgate.engine.output_processor import OutputCollector, OutputProcessor, OutputStream
from kvgate.engine.outputs import EmbeddingOutput, OutputKind, StepOutput
from kvgate.engine.process.ipc import Adapter, Hello, State
from kvgate.engine.request_options import DEFAULT_OPTIONS, RequestOptions
from kvgate.engine.sampling_params import SamplingParams, StructuredOutputs
from kvgate.engine.stats import EngineStats
from kvgate.engine.tokenization.tokenizer import Tokenizer

log = logging.getLogger("kvgate")
RECONNECT_PAUSE_S = 0.1
CALL_TIMEOUT_S = 600.0  # a grammar compile or an adapter load: bounded by the engine's own
COMPILED_MEMO = 4096  # grammar specs this client has had compiled (the engine's cache decides)
GONE = "the engine process exited"


class RemoteStream(OutputStream):
    """One request's outputs, as ``kvgate.engine.async_llm.RequestStream``; admitted after a round
    trip to the engine process."""

    def __init__(
        self,
        client: EngineClient,
        tag: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kind: OutputKind,
    ) -> None:
        loop = asyncio.get_running_loop()
        request_id = f"req-{tag}"
        super().__init__(
            request_id,
            OutputCollector(loop),
            OutputProcessor(request_id, prompt_token_ids, params, client.tokenizer, kind),
        )
        self._client, self._tag = client, tag
        self._admission: asyncio.Future[int] = loop.create_future()
        self._replica = -1

    @property
    def replica(self) -> int:
        return self._replica

    async def admitted(self) -> None:
        """Wait for the engine to admit it; raises what the engine refused it with."""
        if self._replica >= 0:
            return
        try:
            self._replica = await self._admission
        except BaseException:
            self._close(abort=False)
            raise

    def _release(self, abort: bool, reason: str) -> None:
        self._client._forget(self._tag, abort, reason)


class EngineClient:
    """``AsyncLLM``'s surface over the engine process at ``path``."""

    def __init__(self, path: str, connect_timeout_s: float = 600.0) -> None:
        """Connect (waiting up to ``connect_timeout_s`` for the engine to load its model)."""
        self.path = path
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._tags = itertools.count(1)
        self._streams: dict[int, tuple[asyncio.AbstractEventLoop, Any]] = {}
        self._calls: dict[int, Future[Any]] = {}
        self._compiled: OrderedDict[str, None] = OrderedDict()
        self._closed = False
        sock, hello, state = self._connect(time.monotonic() + connect_timeout_s)
        self._sock: socket.socket | None = sock
        self._hello, self._state = hello, state
        self.model_name = hello.model_name
        self.max_model_len = hello.limits.max_model_len
        self.prompts = PromptRules(hello.tokenizer, hello.limits)
        self._reader = threading.Thread(target=self._read, name="kvgate-engine-client", daemon=True)
        self._reader.start()

    # -- what the gateway reads ---------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._hello.tokenizer

    @property
    def default_sampling_fields(self) -> dict[str, Any]:
        return dict(self._hello.default_sampling_fields)

    @property
    def engine_pid(self) -> int:
        return self._hello.pid

    def stats(self) -> EngineStats:
        """The engine's stats as of its last state message (at most ``STATE_INTERVAL_S`` old:
        every API process reads the same engine)."""
        return self._state.stats

    def replicas_ready(self) -> list[bool]:
        if self._sock is None:
            return [False] * len(self._state.replicas_ready)
        return list(self._state.replicas_ready)

    def is_ready(self) -> bool:
        return not self._closed and self._sock is not None and all(self._state.replicas_ready)

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        tools: Sequence[dict[str, Any]] | None = None,
        documents: Sequence[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.prompts.chat_ids(messages, tools, documents, chat_template_kwargs)

    def checked_prompt(self, prompt: Prompt) -> list[int]:
        return self.prompts.checked_prompt(prompt)

    def encode_embedding_input(self, prompt: Prompt) -> list[int]:
        return self.prompts.embedding_ids(prompt)

    def grammar_compiled(self, spec: StructuredOutputs) -> bool:
        """Whether this client has had ``spec`` compiled (the engine compiles it again at
        admission in the rare case its cache has since let it go)."""
        with self._lock:
            return spec.digest in self._compiled

    def compile_grammar(self, spec: StructuredOutputs) -> None:
        """Compile in the engine process, where the matchers step with the tokens and one
        cache serves every API process (blocks: call it on a worker thread)."""
        self._call("compile_grammar", spec)
        with self._lock:
            self._compiled[spec.digest] = None
            if len(self._compiled) > COMPILED_MEMO:
                self._compiled.popitem(last=False)

    def add_lora(self, name: str, path: str, replace: bool = False) -> Adapter:
        """Load an adapter in the engine (blocks: call it on a worker thread)."""
        self._call("add_lora", name, path, replace)
        self._state = self._call("state")
        return Adapter(name, path)

    def remove_lora(self, name: str) -> bool:
        """Blocks for a round trip: call it on a worker thread."""
        removed: bool = self._call("remove_lora", name)
        self._state = self._call("state")
        return removed

    def list_loras(self) -> list[Adapter]:
        return list(self._state.adapters)

    # -- requests -----------------------------------------------------------------------------

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        options: RequestOptions = DEFAULT_OPTIONS,
    ) -> RemoteStream:
        """Send the request (call from the event loop); ``await stream.admitted()`` raises
        what ``AsyncLLM.submit`` would have raised at once."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        token_ids = self.prompts.checked_prompt(prompt)
        tag = next(self._tags)
        stream = RemoteStream(self, tag, token_ids, params, options.kind)
        self._register(tag, stream)
        self._send_or_fail(
            tag,
            (
                "submit",
                tag,
                token_ids,
                params,
                options.cache_key,
                options.cache_salt,
                options.lora_name,
            ),
        )
        return stream

    async def embed(
        self, prompt: Prompt, cache_key: str | None = None, cache_salt: str | None = None
    ) -> EmbeddingOutput:
        token_ids = self.prompts.embedding_ids(prompt)
        tag = next(self._tags)
        waiter = _EmbeddingWaiter()
        self._register(tag, waiter)
        self._send_or_fail(tag, ("embed", tag, token_ids, cache_key, cache_salt))
        finished = False
        try:
            await waiter.admission
            step = await waiter.collector.get()
            finished = True
        finally:
            self._forget(tag, abort=not finished)
        assert step.embedding is not None
        return EmbeddingOutput(
            f"embd-{tag}", token_ids, step.embedding, step.cached_tokens, step.replica
        )

    def shutdown(self) -> None:
        """Close the connection (the engine aborts this process's requests)."""
        self._closed = True
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
        self._fail_all(EngineUnavailable("the engine client has been shut down"))

    # -- plumbing -----------------------------------------------------------------------------

    def _register(self, tag: int, target: Any) -> None:
        if self._closed:
            raise RuntimeError("the engine has been shut down")
        if self._sock is None:
            raise EngineUnavailable(f"{GONE}; it is being started again")
        with self._lock:
            self._streams[tag] = (asyncio.get_running_loop(), target)

    def _send_or_fail(self, tag: int, message: Any) -> None:
        try:
            self._send(message)
        except (OSError, EngineUnavailable):
            with self._lock:
                self._streams.pop(tag, None)
            raise EngineUnavailable(f"{GONE}; it is being started again") from None

    def _send(self, message: Any) -> None:
        sock = self._sock
        if sock is None:
            raise EngineUnavailable(f"{GONE}; it is being started again")
        with self._send_lock:
            ipc.send(sock, message)

    def _forget(self, tag: int, abort: bool, reason: str = "abort") -> None:
        with self._lock:
            known = self._streams.pop(tag, None) is not None
        if abort and known:
            try:
                self._send(("abort", tag, reason))
            except (OSError, EngineUnavailable):
                pass  # the engine is gone, and its requests with it

    def _call(self, method: str, *args: Any) -> Any:
        tag = next(self._tags)
        future: Future[Any] = Future()
        with self._lock:
            self._calls[tag] = future
        try:
            self._send(("call", tag, method, args))
        except OSError:
            with self._lock:
                self._calls.pop(tag, None)
            raise EngineUnavailable(f"{GONE}; it is being started again") from None
        return future.result(CALL_TIMEOUT_S)

    def _connect(self, deadline: float) -> tuple[socket.socket, Hello, State]:
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(self.path)
                hello, state = None, None
                while hello is None or state is None:  # the engine's first messages
                    for _, _, value in ipc.receive(sock):
                        if isinstance(value, Hello):
                            hello = value
                        elif isinstance(value, State):
                            state = value
                return sock, hello, state
            except (OSError, EOFError):
                sock.close()
                if time.monotonic() > deadline or self._closed:
                    raise EngineUnavailable(f"no engine answers at {self.path}") from None
                time.sleep(RECONNECT_PAUSE_S)

    def _read(self) -> None:
        """The reader thread: frames to the event loops, and reconnection after a death."""
        while not self._closed:
            sock = self._sock
            assert sock is not None
            try:
                while True:
                    self._dispatch(ipc.receive(sock))
            except (EOFError, OSError):
                pass
            if self._closed:
                sock.close()
                return
            self._sock = None  # not ready from here on
            log.error("%s: failing the requests in flight, reconnecting", GONE)
            self._fail_all(None)
            sock.close()
            try:
                sock, hello, state = self._connect(float("inf"))
            except EngineUnavailable:
                return  # shut down while reconnecting
            if hello.model_name != self.model_name:
                log.error(
                    "the engine came back serving %s, not %s", hello.model_name, self.model_name
                )
            self._hello, self._state = hello, state
            self._sock = sock
            log.info("engine process %d connected again", hello.pid)

    def _dispatch(self, batch: list[tuple[str, Any, Any]]) -> None:
        """One frame: answers to calls here; request news to the loops, one wake-up each."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, str, Any]]] = {}
        with self._lock:
            for kind, tag, value in batch:
                if kind == "state":
                    self._state = value
                    continue
                call = self._calls.pop(tag, None) if kind in ("ok", "err") else None
                if call is not None:
                    if kind == "ok":
                        call.set_result(value)
                    else:
                        call.set_exception(value)
                    continue
                entry = self._streams.get(tag)
                if entry is not None:
                    by_loop.setdefault(entry[0], []).append((entry[1], kind, value))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that loop has closed
                pass

    def _fail_all(self, error: BaseException | None) -> None:
        """Every request and call in flight ends: the engine that held them is gone."""
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
            calls, self._calls = list(self._calls.values()), {}
        for call in calls:
            call.set_exception(error or EngineUnavailable(GONE))
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, str, Any]]] = {}
        for loop, target in streams:
            by_loop.setdefault(loop, []).append((target, "gone", error))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass


class _EmbeddingWaiter:
    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.admission: asyncio.Future[int] = loop.create_future()
        self.collector = OutputCollector(loop)


def _deliver(items: list[tuple[Any, str, Any]]) -> None:
    """On the event loop: each item to its request (admission, news, or its failure)."""
    for target, kind, value in items:
        admission = target._admission if isinstance(target, RemoteStream) else target.admission
        collector: OutputCollector = (
            target._collector if isinstance(target, RemoteStream) else target.collector
        )
        if kind == "ok":
            if not admission.done():
                admission.set_result(value)
        elif kind == "err":
            if not admission.done():
                admission.set_exception(value)
        elif kind == "out":
            assert isinstance(value, StepOutput)
            collector.put(value)
        elif kind == "fail":
            collector.put(value)
        elif kind == "gone":
            error = value or EngineUnavailable(f"{GONE}; it is being started again")
            if not admission.done():
                admission.set_exception(error)
            else:
                collector.put(value or EngineStepError(f"{GONE} during this request"))
