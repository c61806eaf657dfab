"""Function calls read once, below the doors, whichever backend wrote them.

A chat that gives the model functions gets a ``FunctionCalling``: it adds what the engine
needs to the sampling params (a forced choice's constraint — refused beside another
structured output —, special tokens kept, as call markers may be ones), and reads the reply's
stream into the same shapes for both backends: each ``TextDelta``'s ``text`` is content only
and its ``tool_calls`` the OpenAI ``delta.tool_calls`` entries for calls that began or grew;
the ``Completion``'s ``text`` is the content, ``tool_calls`` the whole calls, and
``finish_reason`` is ``tool_calls`` when a reply that stopped made calls. The embedded engine's
text is parsed in the model family's syntax (``parser``: a streamed answer adds up to the
whole one), at most one call kept unless ``parallel_tool_calls``; a fleet's upstreams render
and read calls themselves, so theirs are relayed as they came. ``tool_choice: none`` renders
the tools and reads no calls (``Completion.tool_calls`` stays None), as vLLM does.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from kvgate.engine.sampling_params import SamplingParams
from kvgate.gateway.calls.errors import BadInput
from kvgate.gateway.function_calls import parser
from kvgate.gateway.function_calls.formats import Family
from kvgate.gateway.function_calls.functions import Functions
from kvgate.gateway.generation import Completion, Stream, TextDelta

Items = AsyncGenerator[TextDelta | Completion]


@dataclass(frozen=True)
class FunctionCalling:
    functions: Functions
    family: Family | None  # None: the backend reads the calls itself (a fleet)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with what reading calls needs (BadInput naming ``tool_choice`` when a
        forced choice meets another constraint)."""
        if self.family is None:
            return params
        changes: dict[str, Any] = {}
        constraint = self.family.constraint(self.functions)
        if constraint is not None:
            if params.structured_outputs is not None:
                raise BadInput(
                    "a 'required' or named 'tool_choice' is already a constraint: drop the "
                    "other structured output ('response_format' / 'structured_outputs', or "
                    "json_schema, regex, choice)",
                    "tool_choice",
                )
            changes["structured_outputs"] = constraint
        if self.functions.parsed:
            changes["skip_special_tokens"] = False
        return replace(params, **changes) if changes else params

    def read(self, stream: Stream) -> Stream:
        """The reply's stream with its calls read (as it is with ``tool_choice: none``)."""
        if not self.functions.parsed:
            return stream
        if self.family is None:
            return _relayed(stream)
        functions = self.functions
        return _parsed(
            stream, parser.CallParser(self.family), functions.parallel, functions.choice.forced
        )


def content(done: Completion) -> str | None:
    """The reply's content as the OpenAI API gives it: None when it was only calls, or only
    thinking (as vLLM's reasoning parsers give it)."""
    only_else = done.tool_calls or done.reasoning is not None
    return None if only_else and not done.text.strip() else done.text


async def _parsed(stream: Stream, calls: parser.CallParser, parallel: bool, forced: bool) -> Items:
    """A forced choice's grammar admits nothing but calls, so no text of it is content (a
    reply cut short inside a call's opening tag is not an answer)."""
    said: list[str] = []
    async with aclosing(stream):
        async for item in stream:
            if isinstance(item, TextDelta):
                text, entries = _split(calls.feed(item.text), parallel, forced)
                said.append(text)
                yield replace(item, text=text, tool_calls=entries)
                continue
            text, entries = _split(calls.finish(), parallel, forced)  # what was held back
            if text or entries:
                said.append(text)
                yield TextDelta(text, item.completion_tokens, [], None, entries, final=True)
            found = calls.calls if parallel else calls.calls[:1]
            reason = parser.finish_reason(item.finish_reason, bool(found))
            yield replace(item, text="".join(said), tool_calls=found, finish_reason=reason)


async def _relayed(stream: Stream) -> Items:
    async with aclosing(stream):
        async for item in stream:
            if isinstance(item, Completion):
                found = item.tool_calls or []
                reason = parser.finish_reason(item.finish_reason, bool(found))
                item = replace(item, tool_calls=found, finish_reason=reason)
            yield item


def _split(
    events: list[parser.Event], parallel: bool, forced: bool
) -> tuple[str, list[dict[str, Any]] | None]:
    """Content text and ``delta.tool_calls`` entries (one per call that began or grew)."""
    text = "" if forced else "".join(e.text for e in events if isinstance(e, parser.Content))
    entries: dict[int, dict[str, Any]] = {}
    for event in events:
        if isinstance(event, parser.Content) or (event.index and not parallel):
            continue
        entry = entries.setdefault(
            event.index, {"index": event.index, "function": {"arguments": ""}}
        )
        if isinstance(event, parser.CallStart):
            entry.update(id=event.id, type="function")
            entry["function"]["name"] = event.name
        else:
            entry["function"]["arguments"] += event.text
    return text, list(entries.values()) or None
