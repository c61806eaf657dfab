"""Runs the inference tools ``generate``, ``chat`` and ``tokenize`` (their schemas: ``schemas/``).

``start`` validates a call's arguments and starts its generation (the engine admits it or
refuses at once); what it returns is the call as an async iterator: zero or more
``Progress`` updates (one per chunk of new text), then the ``CallToolResult`` body. The JSON
path drains it; the SSE path forwards each item. Closing it early (a client gone) aborts the
request and frees its KV blocks. Anything the caller can fix — bad arguments, a prompt that
does not fit, bad sampling values, a schema the engine cannot enforce, a JSON reply cut short
by max_tokens — is a tool error (``isError``) whose text says what to change. With
``json_schema`` the result's ``structuredContent.json`` holds the reply parsed; with ``tools``
(``chat``), ``structuredContent.tool_calls`` holds the calls in the reply.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from engine import EngineStepError
from gateway.catalog.catalog import ToolSpec
from gateway.function_calls.functions import template_messages
from gateway.generation import Completion, GenerationRequest, Generations, TextDelta
from gateway.mcp.tool_use import ToolUse

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
# Tool argument -> the engine's structured_outputs field (constrained decoding).
STRUCTURED_FIELDS = {"json_schema": "json", "regex": "regex", "choice": "choice"}
DEFAULT_MAX_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Progress:
    tokens: int  # tokens generated so far
    text: str  # the text new since the previous update


def tool_error(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True}


class ToolRunner:
    def __init__(self, generations: Generations) -> None:
        self.generations = generations
        self.model_name = generations.model_name

    async def start(
        self, spec: ToolSpec, arguments: Mapping[str, Any], size: int = 0
    ) -> AsyncIterator[Progress | dict[str, Any]]:
        """The call's items; raises ``engine.AdmissionRefused`` when the engine is full.
        ``size`` (the request body's bytes) moves the validation of large arguments off the
        event loop: a 1 MiB message list takes the validator about a second."""
        validator = spec.validator
        problems = await self.generations.off_loop(size, validator.problems, arguments)
        if problems:
            return _only(
                tool_error(f"Invalid arguments for tool '{spec.name}': " + "; ".join(problems))
            )
        arguments = validator.with_integers(arguments)
        if spec.name == "tokenize":
            try:
                ids = await self.generations.tokenize(arguments["text"])
            except ValueError as exc:  # too long to fit (TooManyTokens), an upstream's refusal
                return _only(tool_error(f"Invalid arguments for tool 'tokenize': {exc}"))
            return _only(self._tokenized(ids))
        constraint = {v: arguments[k] for k, v in STRUCTURED_FIELDS.items() if k in arguments}
        if len(constraint) > 1:
            return _only(
                tool_error(
                    f"Invalid arguments for tool '{spec.name}': give at most one of "
                    f"{', '.join(STRUCTURED_FIELDS)}"
                )
            )
        try:
            calls = ToolUse.of(arguments, self.generations.tool_family)
            forced = calls.constraint if calls is not None else None
            if forced is not None:
                if constraint:
                    raise ValueError(
                        "a required or named tool_choice is a constraint already: drop "
                        f"{', '.join(STRUCTURED_FIELDS)}"
                    )
                constraint = forced
            params = self.generations.sampling_params(
                {
                    "max_tokens": DEFAULT_MAX_TOKENS,
                    **{k: arguments[k] for k in SAMPLING_FIELDS if k in arguments},
                    **({"structured_outputs": constraint} if constraint else {}),
                    **({"skip_special_tokens": False} if calls and calls.parsed else {}),
                }
            )
            messages = arguments.get("messages")
            request = GenerationRequest(
                params,
                prompt=arguments.get("prompt"),
                messages=None if messages is None else template_messages(messages),
                tools=None if calls is None else calls.tools,
                chat_template_kwargs=arguments.get("chat_template_kwargs"),
                cache_key=arguments.get("cache_key"),
            )
            generation = await self.generations.start(request)
        except ValueError as exc:
            return _only(tool_error(f"Invalid arguments for tool '{spec.name}': {exc}"))
        return self._items(generation, "json_schema" in arguments, calls)

    async def _items(
        self,
        generation: AsyncIterator[TextDelta | Completion],
        parse_json: bool,
        calls: ToolUse | None,
    ) -> AsyncIterator[Progress | dict[str, Any]]:
        try:
            async with aclosing(generation):
                async for item in generation:
                    if isinstance(item, TextDelta):
                        if item.text:  # progress is text: a token still held back waits
                            yield Progress(item.tokens, item.text)
                    else:
                        yield self._result(item, parse_json, calls)
        except (EngineStepError, RuntimeError) as exc:
            yield tool_error(f"Generation failed: {exc}; retry the call")

    def _result(self, done: Completion, parse_json: bool, calls: ToolUse | None) -> dict[str, Any]:
        structured: dict[str, Any] = {
            "text": done.text,
            "finish_reason": done.finish_reason,
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "cached_tokens": done.cached_tokens,
            "model": self.model_name,
            "replica": done.replica,
        }
        if done.upstream is not None:
            structured["upstream"] = done.upstream
        if done.stop_reason is not None:
            structured["stop_reason"] = done.stop_reason
        if calls is not None:
            structured.update(calls.result(done))
        if parse_json:
            try:
                structured["json"] = json.loads(done.text)
            except ValueError:  # only a cut-short reply: the grammar allows nothing else
                return tool_error(
                    f"The reply stopped ({done.finish_reason}) before its JSON was complete: "
                    f"raise max_tokens (or drop stop strings). Partial reply: {done.text}"
                )
        return {
            "content": [{"type": "text", "text": done.text}],
            "structuredContent": structured,
            "isError": False,
        }

    def _tokenized(self, ids: list[int]) -> dict[str, Any]:
        structured = {"token_ids": ids, "count": len(ids), "model": self.model_name}
        summary = f"{len(ids)} tokens: {ids}"
        return {
            "content": [{"type": "text", "text": summary}],
            "structuredContent": structured,
            "isError": False,
        }


async def _only(result: dict[str, Any]) -> AsyncIterator[Progress | dict[str, Any]]:
    yield result
