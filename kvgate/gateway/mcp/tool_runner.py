"""Runs the inference tools ``generate``, ``chat`` and ``tokenize`` (their schemas: ``kvgate/schemas/``).

``start`` validates a call's arguments and starts its generation (the backend admits it or
refuses at once: ``Refused`` propagates, a JSON-RPC error); what it returns is the call as an
async iterator: zero or more ``Progress`` updates (one per chunk of new text), then the
``CallToolResult`` body. The JSON path drains it; the SSE path forwards each item. Closing it
early (a client gone) aborts the request and frees its KV blocks. Anything the caller can fix
— bad arguments, a prompt that does not fit, bad sampling values, a schema the engine cannot
enforce, a JSON reply cut short by max_tokens — is a tool error (``isError``) whose text says
what to change; so is a generation that broke. With ``json_schema`` the result's
``structuredContent.json`` holds the reply parsed; with ``tools`` (``chat``),
``structuredContent.tool_calls`` holds the calls the reply made (read below the doors, the
same for both backends), their arguments parsed into objects (the text as written if a reply
cut short left it unfinished). ``model`` names a LoRA adapter to answer with (an unknown one
is a tool error); the result's ``model`` says which answered.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from kvgate.gateway.calls.errors import BadInput, GenerationFailed
from kvgate.gateway.calls.generations import Generations
from kvgate.gateway.catalog.catalog import ToolSpec
from kvgate.gateway.function_calls.functions import Functions, template_messages
from kvgate.gateway.function_calls.parser import FunctionCall
from kvgate.gateway.generation import (
    Completion,
    GenerationRequest,
    Stream,
    TextDelta,
    TokenizeRequest,
)
from kvgate.gateway.mcp.errors import failed_call, tool_error

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
# Tool argument -> the engine's structured_outputs field (constrained decoding).
STRUCTURED_FIELDS = {"json_schema": "json", "regex": "regex", "choice": "choice"}
DEFAULT_MAX_TOKENS = 64


@dataclass(frozen=True, slots=True)
class Progress:
    tokens: int  # tokens generated so far
    text: str  # the text new since the previous update


Items = AsyncGenerator[Progress | dict[str, Any]]


class ToolRunner:
    def __init__(
        self, generations: Generations, observe: Callable[[int, float], None] | None = None
    ) -> None:
        """``observe(completion_tokens, seconds)`` hears of every finished generation (how
        fast calls run: ``kvgate.gateway.tasks`` predicts from it)."""
        self.generations = generations
        self.model_name = generations.model_name
        self.observe = observe

    async def start(self, spec: ToolSpec, arguments: Mapping[str, Any], size: int = 0) -> Items:
        """The call's items; raises ``Refused`` when the backend cannot take it now.
        ``size`` (the request body's bytes) moves the validation of large arguments off the
        event loop: a 1 MiB message list takes the validator about a second, 128 tools' JSON
        Schemas in 1 MiB several."""
        validator = spec.validator
        problems = await self.generations.off_loop(size, validator.problems, arguments)
        if problems:
            return _only(
                tool_error(f"Invalid arguments for tool '{spec.name}': " + "; ".join(problems))
            )
        arguments = validator.with_integers(arguments)
        try:
            if spec.name == "tokenize":
                tokenized = await self.generations.tokenize(TokenizeRequest(arguments["text"]))
                return _only(self._tokenized(tokenized.ids))
            # a large call's tools (JSON Schemas to check) and messages are read on a worker
            request = await self.generations.off_loop(size, self._request, arguments)
            generation = await self.generations.start(request)
        except BadInput as exc:
            return _only(failed_call(spec.name, exc))
        model = request.adapter or self.model_name
        return self._items(spec.name, generation, "json_schema" in arguments, model)

    def _request(self, arguments: Mapping[str, Any]) -> GenerationRequest:
        constraint = {v: arguments[k] for k, v in STRUCTURED_FIELDS.items() if k in arguments}
        if len(constraint) > 1:
            raise BadInput(f"give at most one of {', '.join(STRUCTURED_FIELDS)}")
        functions = Functions.of(
            arguments.get("tools"),
            arguments.get("tool_choice"),
            arguments.get("parallel_tool_calls"),
        )
        messages = arguments.get("messages")
        model = arguments.get("model")
        params = self.generations.sampling_params(
            {
                **{k: arguments[k] for k in SAMPLING_FIELDS if k in arguments},
                **({"structured_outputs": constraint} if constraint else {}),
            },
            defaults={"max_tokens": DEFAULT_MAX_TOKENS},  # a default: it stops at the context
        )
        return GenerationRequest(
            params,
            prompt=arguments.get("prompt"),
            messages=None if messages is None else template_messages(messages),
            functions=functions,
            chat_template_kwargs=arguments.get("chat_template_kwargs"),
            cache_key=arguments.get("cache_key"),
            adapter=None if model == self.model_name else model,
        )

    async def _items(self, tool: str, generation: Stream, parse_json: bool, model: str) -> Items:
        started = time.perf_counter()
        try:
            async with aclosing(generation):
                async for item in generation:
                    if isinstance(item, TextDelta):
                        if item.text:  # progress is text: a token still held back waits
                            yield Progress(item.tokens, item.text)
                    else:
                        if self.observe is not None:
                            self.observe(item.completion_tokens, time.perf_counter() - started)
                        yield self._result(item, parse_json, model)
        except GenerationFailed as exc:
            yield failed_call(tool, exc)

    def _result(self, done: Completion, parse_json: bool, model: str) -> dict[str, Any]:
        structured: dict[str, Any] = {
            "text": done.text,
            "finish_reason": done.finish_reason,
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            "cached_tokens": done.cached_tokens,
            "model": model,
            "replica": done.replica,
        }
        if done.upstream is not None:
            structured["upstream"] = done.upstream
        if done.stop_reason is not None:
            structured["stop_reason"] = done.stop_reason
        if done.reasoning is not None:
            structured["reasoning"] = done.reasoning
        if done.tool_calls is not None:
            structured["tool_calls"] = [_call(c) for c in done.tool_calls]
        if parse_json:
            try:
                structured["json"] = model_json(done.text)
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


def _call(call: FunctionCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": _arguments(call.arguments)},
    }


def model_json(text: str) -> Any:
    """A reply's JSON as a value the answer can carry: an integer past 64 bits (valid JSON, and
    a grammar allows any number of digits) becomes a float, as a JavaScript client reads it; the
    text content keeps every digit. Such an integer failed the whole answer's encoding."""
    return json.loads(text, parse_int=_json_int)


def _json_int(digits: str) -> int | float:
    # 20 characters hold every 64-bit integer; longer text is not read as an int at all
    # (Python refuses past 4,300 digits, and the conversion is quadratic).
    if len(digits) <= 20:
        value = int(digits)
        if -(2**63) <= value < 2**64:
            return value
    return float(digits)


def _arguments(text: str) -> Any:
    try:
        value = model_json(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


async def _only(result: dict[str, Any]) -> Items:
    yield result
