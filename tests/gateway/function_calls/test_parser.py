"""The tool-call parser on fixed replies of each family: whole, and streamed in pieces cut at
every position (and a character at a time), which must add up to the whole answer."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.gateway.function_calls.formats import HERMES, LLAMA3_JSON, MISTRAL, Family
from kvgate.gateway.function_calls.parser import (
    Arguments,
    CallParser,
    CallStart,
    Content,
    Event,
    FunctionCall,
    parse,
)


def ids() -> object:
    counter = itertools.count()
    return lambda: f"call-{next(counter)}"


# (family, reply, expected content, expected [(name, arguments text)])
CASES: list[tuple[Family, str, str | None, list[tuple[str, str]]]] = [
    (
        HERMES,
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris",'
        ' "unit": "c"}}\n</tool_call>',
        "Let me look.\n",
        [("get_weather", '{"city": "Paris", "unit": "c"}')],
    ),
    (
        HERMES,  # two calls, arguments before the name, braces and quotes inside strings
        '<tool_call>{"arguments": {"q": "a}\\"{b", "n": [1, {"x": null}]}, "name": "search"}'
        '</tool_call>\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        None,
        [("search", '{"q": "a}\\"{b", "n": [1, {"x": null}]}'), ("now", "{}")],
    ),
    (
        HERMES,  # arguments as JSON text, and a call with none: "{}"
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
        '<tool_call>{"name": "g"}</tool_call> done ✓',
        " done ✓",
        [("f", '{"a": 1}'), ("g", "{}")],
    ),
    (
        HERMES,  # an opener not followed by a call object is text
        "a <tool_call> not json </tool_call> and <tool_c",
        "a <tool_call> not json </tool_call> and <tool_c",
        [],
    ),
    (
        HERMES,  # an object without a name is text
        'x <tool_call>{"arguments": {"a": 1}}</tool_call>',
        'x <tool_call>{"arguments": {"a": 1}}</tool_call>',
        [],
    ),
    (
        LLAMA3_JSON,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; '
        '{"name": "get_time", "parameters": {"tz": "CET"}}',
        None,
        [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"tz": "CET"}')],
    ),
    (
        LLAMA3_JSON,
        '\n {"name": "f", "parameters": {"n": -1.5e3, "ok": true}}',
        None,
        [("f", '{"n": -1.5e3, "ok": true}')],
    ),
    (LLAMA3_JSON, 'The answer is {"name": "f"}.', 'The answer is {"name": "f"}.', []),
    (LLAMA3_JSON, '{"title": "not a call"}', '{"title": "not a call"}', []),
    (
        MISTRAL,
        'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}, '
        '{"name": "neg", "arguments": {"a": 3}}]',
        "Sure. ",
        [("add", '{"a": 1, "b": 2}'), ("neg", '{"a": 3}')],
    ),
    (
        MISTRAL,  # the marker is a special token a detokenizer may drop: a leading array
        ' [{"name": "add", "arguments": {"a": 1}}]',
        None,
        [("add", '{"a": 1}')],
    ),
    (
        MISTRAL,  # the marker at the very start
        '[TOOL_CALLS][{"name": "now", "arguments": {\t}}]',
        None,
        [("now", "{\t}")],
    ),
    (MISTRAL, "[1, 2] are numbers", "[1, 2] are numbers", []),
    (MISTRAL, "[TOOL", "[TOOL", []),
]


def accumulate(events: list[Event]) -> tuple[str, list[tuple[str, str]], list[str]]:
    """Content, calls and the order of event kinds per call, as a client accumulates them."""
    content, calls, order = "", [], []
    for event in events:
        if isinstance(event, Content):
            content += event.text
        elif isinstance(event, CallStart):
            assert event.index == len(calls)
            calls.append([event.name, ""])
            order.append("start")
        else:
            assert isinstance(event, Arguments) and event.index == len(calls) - 1
            calls[event.index][1] += event.text
    return content, [(n, a) for n, a in calls], order


@pytest.mark.parametrize(("family", "reply", "content", "calls"), CASES)
def test_whole_reply(
    family: Family, reply: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    parsed = parse(family, reply, ids())
    assert parsed.content == content
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert [c.id for c in parsed.calls] == [f"call-{i}" for i in range(len(calls))]
    for call in parsed.calls:
        json.loads(call.arguments)


@pytest.mark.parametrize(("family", "reply", "content", "calls"), CASES)
def test_split_anywhere_streams_the_same(
    family: Family, reply: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    whole = CallParser(family, ids())
    whole_content, _, _ = accumulate(whole.feed(reply) + whole.finish())
    assert whole_content.strip() == (content or "").strip()  # None: only whitespace
    for cut in range(len(reply) + 1):
        parser = CallParser(family, ids())
        events = parser.feed(reply[:cut]) + parser.feed(reply[cut:]) + parser.finish()
        streamed, streamed_calls, _ = accumulate(events)
        assert streamed_calls == calls, cut
        assert streamed == whole_content, cut
        assert parser.calls == parse(family, reply, ids()).calls


@pytest.mark.parametrize(("family", "reply", "content", "calls"), CASES)
def test_a_character_at_a_time(
    family: Family, reply: str, content: str | None, calls: list[tuple[str, str]]
) -> None:
    parser = CallParser(family, ids())
    events = [e for ch in reply for e in parser.feed(ch)] + parser.finish()
    streamed, streamed_calls, _ = accumulate(events)
    assert streamed_calls == calls
    assert streamed.strip() == (content or "").strip()
    names = [e for e in events if isinstance(e, CallStart)]
    assert [e.name for e in names] == [name for name, _ in calls]


def test_name_comes_before_any_arguments_fragment() -> None:
    reply = '<tool_call>{"arguments": {"a": 1}, "name": "late"}</tool_call>'
    parser = CallParser(HERMES, ids())
    events = [e for ch in reply for e in parser.feed(ch)] + parser.finish()
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["CallStart", "Arguments"]
    assert events[1] == Arguments(0, '{"a": 1}')


def test_text_is_not_held_back_longer_than_a_possible_opener() -> None:
    parser = CallParser(HERMES, ids())
    assert parser.feed("hello <tool") == [Content("hello ")]
    assert parser.feed("box>") == [Content("<toolbox>")]
    assert parser.feed("<tool_call>") == []
    assert parser.feed('{"name": "f"') == [CallStart(0, "call-0", "f")]


def test_a_reply_cut_short_keeps_the_call_so_far() -> None:
    parsed = parse(HERMES, '<tool_call>{"name": "f", "arguments": {"city": "Par')
    assert parsed.calls == [FunctionCall(parsed.calls[0].id, "f", '{"city": "Par')]
    assert parsed.content is None


@settings(max_examples=150, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_any_number_of_pieces_adds_up(case: tuple, cuts: list[int]) -> None:
    family, reply, _, calls = case
    points = sorted({min(c, len(reply)) for c in cuts})
    pieces = [reply[a:b] for a, b in zip([0, *points], [*points, len(reply)], strict=True)]
    parser = CallParser(family, ids())
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    _, streamed_calls, _ = accumulate(events)
    assert streamed_calls == calls


def test_call_ids_are_vllm_shaped_and_mistral_gets_nine_characters() -> None:
    (hermes,) = parse(HERMES, '<tool_call>{"name": "f"}</tool_call>').calls
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", hermes.id)
    (mistral,) = parse(MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {}}]').calls
    assert re.fullmatch(r"[A-Za-z0-9]{9}", mistral.id)
