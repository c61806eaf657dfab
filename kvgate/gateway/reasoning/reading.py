"""Thinking read once, below the doors, whichever backend wrote it (as function calls are).

With a reasoning parser on, ``Reasoning`` does two things to a request of the embedded
engine: its structured output (a ``response_format``, vLLM's ``structured_outputs``, a forced
tool call's structural tag) is held only after the thinking — the grammar first admits a
thinking block of free text up to ``</think>`` (for qwen3 an optional one, as the template
may have closed the thinking already), then the constraint, which is where vLLM starts
enforcing a grammar (once it has seen the reasoning end) —, and its reply's stream is split:
each ``TextDelta``'s ``reasoning`` is the thinking, ``text`` what follows it (where function
calls are then read), the ``Completion``'s ``reasoning`` the whole thinking. A fleet's
upstreams split their own replies (``reasoning`` relayed by ``kvgate.gateway.upstream``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from kvgate.engine.sampling_params import SamplingParams, StructuredOutputs, choice_grammar
from kvgate.gateway.generation import Completion, Stream, TextDelta
from kvgate.gateway.reasoning.parser import END, START, ReasoningFormat, ThinkParser

Items = AsyncGenerator[TextDelta | Completion]


@dataclass(frozen=True)
class Reasoning:
    form: ReasoningFormat

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` whose structured output, if any, applies after the thinking."""
        spec = params.structured_outputs
        if spec is None:
            return params
        thinking = {
            "type": "tag",
            "begin": "" if self.form.opened_by_template else START,
            "content": {"type": "any_text"},
            "end": END,
        }
        answer = _format(spec)
        after: dict[str, Any] = {"type": "sequence", "elements": [thinking, answer]}
        if not self.form.opened_by_template:
            after = {"type": "or", "elements": [after, answer]}
        tag = {"type": "structural_tag", "format": after}
        return replace(params, structured_outputs=StructuredOutputs(structural_tag=tag))

    def read(self, stream: Stream) -> Stream:
        return _split(stream, self.form.parser())


def _format(spec: StructuredOutputs) -> dict[str, Any]:
    """A structured output as an element of an xgrammar structural tag."""
    value: Any = spec.document
    if spec.kind == "json":
        return {"type": "json_schema", "json_schema": value}
    if spec.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.kind == "regex":
        return {"type": "regex", "pattern": value}
    if spec.kind == "choice":
        return {"type": "grammar", "grammar": choice_grammar(value)}
    if spec.kind == "grammar":
        return {"type": "grammar", "grammar": value}
    return value["format"] if isinstance(value, dict) and "format" in value else value  # type: ignore[no-any-return]


async def _split(stream: Stream, parser: ThinkParser) -> Items:
    thought: list[str] = []
    said: list[str] = []
    async with aclosing(stream):
        async for item in stream:
            if isinstance(item, TextDelta):
                part = parser.feed(item.text)
                thought.append(part.reasoning)
                said.append(part.content)
                yield replace(item, text=part.content, reasoning=part.reasoning)
                continue
            part = parser.finish()  # what was held back
            if part.reasoning or part.content:
                thought.append(part.reasoning)
                said.append(part.content)
                yield TextDelta(
                    part.content,
                    item.completion_tokens,
                    [],
                    None,
                    reasoning=part.reasoning,
                    final=True,
                )
            reasoning = "".join(thought) if parser.thought else None
            yield replace(item, text="".join(said), reasoning=reasoning)
