"""One OpenAI answer built from its choices' items: the whole body, or its stream chunks.

In a stream each delta goes out as it comes, but for a choice's final one
(``TextDelta.final``), held until its Completion, which follows at once: ``finish_reason``
rides on the last content chunk (never a chunk of its own). Holding every delta until the
next item would make every token, the first included, wait one engine step more. Function calls
arrive already read (``TextDelta.tool_calls``, ``Completion.tool_calls``): the chat answer
only words them as ``message.tool_calls`` / ``delta.tool_calls``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from kvgate.engine.tokenization.tokenizer import Tokenizer
from kvgate.gateway.calls.errors import BadInput
from kvgate.gateway.function_calls.parser import FunctionCall
from kvgate.gateway.function_calls.reading import content
from kvgate.gateway.generation import Completion, Stream, TextDelta
from kvgate.gateway.openai.requests import Sampling
from kvgate.gateway.openai.responses import (
    Choice,
    Envelope,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    usage_of,
)


class Answer:
    kind: str

    def __init__(self, envelope: Envelope, sampling: Sampling, token_text: TokenText) -> None:
        self.envelope, self.sampling, self.token_text = envelope, sampling, token_text
        self.top: int | None = sampling.fields.get("logprobs")
        self.done: dict[int, Completion] = {}
        self._held: dict[int, TextDelta] = {}
        self._prompts = 1

    def body(self, choices: list[Choice]) -> dict[str, Any]:
        out = [self.choice(c) for c in choices]
        done = [c.done for c in choices if c.done is not None]
        return self.envelope.wrap(self.kind, out, usage=usage_of(done, self._prompts))

    def chunks(self, index: int, item: TextDelta | Completion) -> list[dict[str, Any]]:
        held = self._held.pop(index, None)
        if isinstance(item, TextDelta):
            out = [] if held is None else [self.chunk(index, held, None)]
            if item.final:
                self._held[index] = item
            else:
                out.append(self.chunk(index, item, None))
            return out
        self.done[index] = item
        last = held if held is not None else TextDelta("", item.completion_tokens, [], None)
        return [self.chunk(index, last, item.finish_reason)]

    def usage_chunk(self) -> dict[str, Any]:
        done = [self.done[i] for i in sorted(self.done)]
        return self.envelope.wrap(self.kind, [], usage=usage_of(done, self._prompts))

    def choice(self, choice: Choice) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, index: int, delta: TextDelta, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError


class CompletionsAnswer(Answer):
    kind = "text_completion"

    def __init__(
        self,
        envelope: Envelope,
        sampling: Sampling,
        token_text: TokenText,
        prompts: list[str | list[int]],
        echo: bool,
        tokenizer: Tokenizer | None,
    ) -> None:
        super().__init__(envelope, sampling, token_text)
        self.prompts, self.echo, self._prompts = prompts, echo, len(prompts)
        self.tokenizer = tokenizer
        # Per choice, the text streamed so far: a chunk's text_offset continues from it, as
        # vLLM's do, so the offsets do not depend on how tokens were grouped into chunks.
        self._streamed: dict[int, int] = {}

    def _prompt_text(self, index: int) -> str:
        prompt = self.prompts[index // self.sampling.n]
        if isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            raise BadInput("'echo' of token ids needs --tokenizer in fleet mode", "echo")
        return self.tokenizer.decode(prompt)

    def _logprobs(self, ids: list[int], entries: list[dict[int, float]], offset: int) -> Any:
        if self.top is None:
            return None
        return completion_logprobs(ids, entries, self.top, self.token_text, offset)

    def choice(self, choice: Choice) -> dict[str, Any]:
        assert choice.done is not None
        prefix = self._prompt_text(choice.index) if self.echo else ""
        return {
            "index": choice.index,
            "text": prefix + "".join(choice.text),
            "logprobs": self._logprobs(choice.token_ids, choice.logprobs, len(prefix)),
            "finish_reason": choice.done.finish_reason,
        }

    def chunk(self, index: int, delta: TextDelta, finish_reason: str | None) -> dict[str, Any]:
        offset = self._streamed.get(index, 0)
        self._streamed[index] = offset + len(delta.text)
        choice = {
            "index": index,
            "text": delta.text,
            "logprobs": self._logprobs(delta.token_ids, delta.logprobs or [], offset),
            "finish_reason": finish_reason,
        }
        return self.envelope.wrap(self.kind, [choice])


class ChatAnswer(Answer):
    kind = "chat.completion"

    def __init__(self, envelope: Envelope, sampling: Sampling, token_text: TokenText) -> None:
        super().__init__(envelope, sampling, token_text)
        self._opened: set[int] = set()

    def _logprobs(self, ids: list[int], entries: list[dict[int, float]]) -> Any:
        if self.top is None:
            return None
        return chat_logprobs(ids, entries, self.top, self.token_text)

    def choice(self, choice: Choice) -> dict[str, Any]:
        done = choice.done
        assert done is not None
        message: dict[str, Any] = {"role": "assistant", "content": content(done)}
        if done.reasoning is not None:  # vLLM 0.32's name (``reasoning_content`` is gone)
            message["reasoning"] = done.reasoning
        if done.tool_calls:
            message["tool_calls"] = [_call(c) for c in done.tool_calls]
        return {
            "index": choice.index,
            "message": message,
            "logprobs": self._logprobs(choice.token_ids, choice.logprobs),
            "finish_reason": done.finish_reason,
            "stop_reason": done.stop_reason,
        }

    def chunks(self, index: int, item: TextDelta | Completion) -> list[dict[str, Any]]:
        """The first chunk of each choice carries the role, as the OpenAI API sends it."""
        chunks = []
        if index not in self._opened:
            self._opened.add(index)
            role = {"index": index, "delta": {"role": "assistant", "content": ""}}
            chunks.append(self._wrap({**role, "logprobs": None, "finish_reason": None}))
        return chunks + [c for c in super().chunks(index, item) if not _empty(c)]

    def chunk(self, index: int, delta: TextDelta, finish_reason: str | None) -> dict[str, Any]:
        fields: dict[str, Any] = {"content": delta.text} if delta.text else {}
        if delta.reasoning:
            fields["reasoning"] = delta.reasoning
        if delta.tool_calls:
            fields["tool_calls"] = delta.tool_calls
        choice = {
            "index": index,
            "delta": fields,
            "logprobs": self._logprobs(delta.token_ids, delta.logprobs or []),
            "finish_reason": finish_reason,
        }
        if finish_reason is not None:
            choice["stop_reason"] = self.done[index].stop_reason
        return self._wrap(choice)

    def usage_chunk(self) -> dict[str, Any]:
        return {**super().usage_chunk(), "object": "chat.completion.chunk"}

    def _wrap(self, choice: dict[str, Any]) -> dict[str, Any]:
        return self.envelope.wrap("chat.completion.chunk", [choice])


def _call(call: FunctionCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _empty(chunk: dict[str, Any]) -> bool:
    """A chunk with nothing to say (the tokens of a call's tags are not content)."""
    choice = chunk["choices"][0]
    return not choice["delta"] and choice["finish_reason"] is None and choice["logprobs"] is None


async def prepend(
    head: TextDelta | Completion, rest: Stream
) -> AsyncGenerator[TextDelta | Completion]:
    yield head
    async for item in rest:
        yield item


async def collect(streams: list[Stream]) -> list[Choice]:
    """Drain every choice concurrently into its accumulated ``Choice``."""

    async def drain(index: int, stream: Stream) -> Choice:
        choice = Choice(index)
        async for item in stream:
            if isinstance(item, TextDelta):
                choice.add(item)
            else:
                choice.done = item
        return choice

    if len(streams) == 1:  # the usual call: no task to gather it in
        return [await drain(0, streams[0])]
    return list(await asyncio.gather(*(drain(i, s) for i, s in enumerate(streams))))


async def merged(streams: list[Stream]) -> AsyncGenerator[tuple[int, TextDelta | Completion]]:
    """Every choice's items as they come, tagged with the choice index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, TextDelta | Completion] | BaseException | None] = asyncio.Queue(
        maxsize=len(streams)
    )

    async def pump(index: int, stream: Stream) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put(None)
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            got = await queue.get()
            if got is None:
                running -= 1
            elif isinstance(got, BaseException):
                raise got
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
