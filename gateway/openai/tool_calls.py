"""Tool calling on ``/v1/chat/completions``: the request's ``tools`` / ``tool_choice`` /
``parallel_tool_calls``, and the calls in the answer (``message.tool_calls``, streamed as
``delta.tool_calls``).

As vLLM does today, tools are rendered into the prompt even with ``tool_choice: "none"``
(the reply is then plain content, never parsed); ``auto`` parses whatever the model writes;
``required`` and a named function hold the reply to calls by a grammar in the model family's
own syntax. ``finish_reason`` is ``tool_calls`` when a reply that stopped holds calls.
``parallel_tool_calls: false`` keeps at most one call (the grammar stops after it; in ``auto``
later calls are dropped). In fleet mode (no ``family``) the upstream does all of that, and
its calls (``TextDelta.tool_calls``, ``Completion.tool_calls``) are relayed as it wrote them.
"""

from __future__ import annotations

from typing import Any

from gateway.function_calls import functions as spec
from gateway.function_calls import parser as calls
from gateway.function_calls.formats import Family
from gateway.generation import Completion
from gateway.openai.errors import bad_request
from gateway.openai.requests import Sampling

DEPRECATED = ("functions", "function_call")


def chat_tools(body: dict[str, Any]) -> spec.Functions | None:
    """The request's tools (None without any); a 400 naming the field when they are bad."""
    for name in DEPRECATED:
        if body.get(name) is not None:
            raise bad_request(f"'{name}' is deprecated and not served: use 'tools'", name)
    try:
        return spec.Functions.of(
            body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
        )
    except spec.FunctionsError as exc:
        raise bad_request(str(exc), exc.param) from None


def apply(
    body: dict[str, Any], sampling: Sampling, family: Family | None
) -> tuple[spec.Functions | None, ToolReplies | None]:
    """Reads the tool fields into ``sampling`` (a forced choice's constraint; special tokens
    kept when calls are parsed, as markers may be ones): the tools and the reader of the
    calls in the reply (None with ``tool_choice: none``, or without a ``family``: the
    backend reads them itself)."""
    tools = chat_tools(body)
    if tools is None or family is None:
        return tools, None
    constraint = family.constraint(tools)
    if constraint is not None:
        if "structured_outputs" in sampling.fields:
            raise bad_request(
                "a 'required' or named 'tool_choice' is already a constraint: drop "
                "'response_format' / 'structured_outputs'",
                "tool_choice",
            )
        sampling.fields["structured_outputs"] = constraint
    if not tools.parsed:
        return tools, None
    sampling.fields["skip_special_tokens"] = False
    return tools, ToolReplies(tools, family)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    try:
        return spec.template_messages(messages)
    except spec.FunctionsError as exc:
        raise bad_request(str(exc), exc.param) from None


def relayed(text: str, done: Completion) -> tuple[dict[str, Any], str]:
    """The ``message`` and finish reason of a reply whose calls the backend read."""
    assert done.tool_calls is not None
    return _message(calls.relayed(text, done.tool_calls)), relayed_finish_reason(done)


def relayed_finish_reason(done: Completion) -> str:
    """``tool_calls`` for a reply that stopped after calls (vLLM says ``stop`` after a named
    one), streamed or not."""
    return calls.finish_reason(done.finish_reason, bool(done.tool_calls))


def _message(parsed: calls.Parsed) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.calls
        ]
    return message


class ToolReplies:
    """Reads each choice's calls out of its text, whole or as it streams."""

    def __init__(self, tools: spec.Functions, family: Family) -> None:
        self.tools, self.family = tools, family
        self._parsers: dict[int, calls.CallParser] = {}

    def message(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """A whole reply's ``message`` and its finish reason."""
        parsed = calls.parse(self.family, text)
        found = parsed.calls if self.tools.parallel else parsed.calls[:1]
        message = _message(calls.Parsed(parsed.content, found))
        return message, calls.finish_reason(finish_reason, bool(found))

    def delta(
        self, index: int, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """One chunk's ``delta`` (content and/or tool call fragments) for new ``text``; the
        last one (``finish_reason`` given) flushes what the parser held back."""
        parser = self._parsers.setdefault(index, calls.CallParser(self.family))
        events = parser.feed(text)
        if finish_reason is not None:
            events += parser.finish()
        content = "".join(e.text for e in events if isinstance(e, calls.Content))
        entries: dict[int, dict[str, Any]] = {}
        for event in events:
            if isinstance(event, calls.Content) or (event.index and not self.tools.parallel):
                continue
            entry = entries.setdefault(
                event.index, {"index": event.index, "function": {"arguments": ""}}
            )
            if isinstance(event, calls.CallStart):
                entry.update(id=event.id, type="function")
                entry["function"]["name"] = event.name
            else:
                entry["function"]["arguments"] += event.text
        delta: dict[str, Any] = {}
        if content:
            delta["content"] = content
        if entries:
            delta["tool_calls"] = list(entries.values())
        if finish_reason is not None:
            finish_reason = calls.finish_reason(finish_reason, bool(parser.calls))
        return delta, finish_reason
