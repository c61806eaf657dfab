"""The inference tools ``generate``, ``chat`` and ``tokenize``, run against the engine.

A call is an async iterator: zero or more ``Progress`` updates (one per chunk of new text),
then the ``CallToolResult`` body. The JSON path drains it; the SSE path forwards each item.
Leaving the iterator early (a client gone) closes the engine stream, which aborts the request
and frees its KV blocks. Anything the caller can fix — bad arguments, a prompt that does not
fit, bad sampling values — is a tool error (``isError``) whose text says what to change.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Protocol

from engine import RequestOutput, SamplingParams
from gateway import tracing
from protocol.errors import invalid_params
from protocol.headers import HeaderParam, header_params
from schemas.validation import ArgumentValidator

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop")
DEFAULT_MAX_TOKENS = 64
OPERATIONS = {"generate": "text_completion", "chat": "chat"}  # gen_ai.operation.name


class Engine(Protocol):
    """The part of ``engine.AsyncLLM`` the tools use."""

    model_name: str

    @property
    def tokenizer(self) -> Any: ...

    def apply_chat_template(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def generate(
        self, prompt: str | list[int], params: SamplingParams, cache_key: str | None = None
    ) -> AsyncIterator[RequestOutput]: ...


@dataclass(frozen=True, slots=True)
class Progress:
    tokens: int  # tokens generated so far
    text: str  # the text new since the previous update


@dataclass(frozen=True)
class ToolSpec:
    name: str
    validator: ArgumentValidator
    header_params: tuple[HeaderParam, ...]


def tool_error(text: str) -> dict[str, Any]:
    return {"content": [{"type": "text", "text": text}], "isError": True}


class InferenceTools:
    def __init__(self, engine: Engine, definitions: list[dict[str, Any]]) -> None:
        self.engine = engine
        self.specs = {
            d["name"]: ToolSpec(
                d["name"],
                ArgumentValidator(d["name"], d["inputSchema"]),
                header_params(d["inputSchema"]),
            )
            for d in definitions
        }

    def spec(self, name: Any) -> ToolSpec:
        """The tool called ``name``; an unknown tool is a protocol error (-32602)."""
        spec = self.specs.get(name) if isinstance(name, str) else None
        if spec is None:
            raise invalid_params(f"Unknown tool: {name}", data={"name": name})
        return spec

    async def call(
        self, spec: ToolSpec, arguments: Mapping[str, Any]
    ) -> AsyncIterator[Progress | dict[str, Any]]:
        problems = spec.validator.problems(arguments)
        if problems:
            yield tool_error(f"Invalid arguments for tool '{spec.name}': " + "; ".join(problems))
            return
        if spec.name == "tokenize":
            yield self._tokenize(arguments["text"])
            return
        try:
            prompt = self._prompt(spec.name, arguments)
            params = SamplingParams(
                **{
                    "max_tokens": DEFAULT_MAX_TOKENS,
                    **{k: arguments[k] for k in SAMPLING_FIELDS if k in arguments},
                }
            )
        except ValueError as exc:
            yield tool_error(f"Invalid arguments for tool '{spec.name}': {exc}")
            return
        async for item in self._generate(spec.name, prompt, params, arguments.get("cache_key")):
            yield item

    def _prompt(self, tool: str, arguments: Mapping[str, Any]) -> str | list[int]:
        if tool == "generate":
            return arguments["prompt"]
        try:
            return self.engine.apply_chat_template(arguments["messages"])
        except Exception as exc:  # a template may refuse a conversation it cannot format
            raise ValueError(f"messages: the chat template rejected them ({exc})") from exc

    async def _generate(
        self, tool: str, prompt: str | list[int], params: SamplingParams, cache_key: str | None
    ) -> AsyncIterator[Progress | dict[str, Any]]:
        last: RequestOutput | None = None
        operation, model = OPERATIONS[tool], self.engine.model_name
        try:
            with (
                tracing.span(
                    "kvgate.route",
                    **{"kvgate.tool": tool, "kvgate.cache_key.set": cache_key is not None},
                ) as route,
                tracing.span(
                    f"{operation} {model}",
                    route,
                    **{
                        "gen_ai.operation.name": operation,
                        "gen_ai.request.model": model,
                        "gen_ai.request.max_tokens": params.max_tokens,
                    },
                ) as run,
            ):
                async with aclosing(
                    self.engine.generate(prompt, params, cache_key=cache_key)
                ) as stream:
                    async for out in stream:
                        if last is None:  # the replica chosen, and how much of the prompt it had
                            tracing.annotate(
                                route,
                                **{
                                    "kvgate.replica": out.replica,
                                    "kvgate.cached_tokens": out.cached_tokens,
                                },
                            )
                        last = out
                        if out.delta_text:
                            yield Progress(len(out.token_ids), out.delta_text)
                if last is not None:
                    tracing.annotate(
                        run,
                        **{
                            "gen_ai.usage.input_tokens": len(last.prompt_token_ids),
                            "gen_ai.usage.output_tokens": len(last.token_ids),
                            "gen_ai.response.finish_reasons": [last.finish_reason or "stop"],
                        },
                    )
        except ValueError as exc:
            if last is not None:
                raise
            yield tool_error(f"Invalid arguments for tool '{tool}': {exc}")
            return
        except RuntimeError as exc:
            yield tool_error(f"Generation failed: {exc}; retry the call")
            return
        assert last is not None and last.finished
        yield self._completion(last)

    def _completion(self, out: RequestOutput) -> dict[str, Any]:
        structured = {
            "text": out.text,
            "finish_reason": out.finish_reason or "stop",
            "prompt_tokens": len(out.prompt_token_ids),
            "completion_tokens": len(out.token_ids),
            "cached_tokens": out.cached_tokens,
            "model": self.engine.model_name,
            "replica": out.replica,
        }
        return {
            "content": [{"type": "text", "text": out.text}],
            "structuredContent": structured,
            "isError": False,
        }

    def _tokenize(self, text: str) -> dict[str, Any]:
        ids = list(self.engine.tokenizer.encode(text))
        structured = {"token_ids": ids, "count": len(ids), "model": self.engine.model_name}
        summary = f"{len(ids)} tokens: {ids}"
        return {
            "content": [{"type": "text", "text": summary}],
            "structuredContent": structured,
            "isError": False,
        }
