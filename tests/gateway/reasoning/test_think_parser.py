"""The reasoning parsers on fixed replies: whole, and streamed in two pieces cut at every
position (and a character at a time, and three pieces at every pair of cuts for the short
ones), which must add up to the whole answer."""

from __future__ import annotations

import pytest

from kvgate.gateway.reasoning.parser import DEEPSEEK_R1, QWEN3, ReasoningFormat, resolve, split

# (format, reply, expected reasoning (None: it did not think), expected content)
CASES: list[tuple[ReasoningFormat, str, str | None, str]] = [
    (QWEN3, "<think>Paris, surely.</think>\n\nParis.", "Paris, surely.", "\n\nParis."),
    (QWEN3, "\n<think>\nhm <thin </think</think>ok", "\nhm <thin </think", "ok"),
    (QWEN3, "Paris.", None, "Paris."),  # no <think>: all content
    (QWEN3, "Paris </think> then", None, "Paris </think> then"),
    (QWEN3, "<think>cut short by max_tokens", "cut short by max_tokens", ""),
    (QWEN3, "<thi", None, "<thi"),  # a tag that never completed is content
    (QWEN3, "", None, ""),
    (QWEN3, "<think></think>", "", ""),
    (DEEPSEEK_R1, "The template opened it.</think>Answer ✓", "The template opened it.", "Answer ✓"),
    (DEEPSEEK_R1, "<think>own tag</think>A", "own tag", "A"),
    (DEEPSEEK_R1, "never closed <think", "never closed <think", ""),
    (DEEPSEEK_R1, "x</thi", "x</thi", ""),
    (DEEPSEEK_R1, "</think>", "", ""),
]


def streamed(form: ReasoningFormat, pieces: list[str]) -> tuple[str | None, str]:
    parser = form.parser()
    parts = [parser.feed(p) for p in pieces] + [parser.finish()]
    reasoning = "".join(p.reasoning for p in parts)
    return (reasoning if parser.thought else None), "".join(p.content for p in parts)


@pytest.mark.parametrize(("form", "reply", "reasoning", "content"), CASES)
def test_whole_reply(
    form: ReasoningFormat, reply: str, reasoning: str | None, content: str
) -> None:
    assert split(form, reply) == (reasoning, content)


@pytest.mark.parametrize(("form", "reply", "reasoning", "content"), CASES)
def test_every_split_point_adds_up_to_the_whole(
    form: ReasoningFormat, reply: str, reasoning: str | None, content: str
) -> None:
    for cut in range(len(reply) + 1):
        assert streamed(form, [reply[:cut], reply[cut:]]) == (reasoning, content), cut
    assert streamed(form, list(reply)) == (reasoning, content)
    if len(reply) <= 40:
        for a in range(len(reply) + 1):
            for b in range(a, len(reply) + 1):
                pieces = [reply[:a], reply[a:b], reply[b:]]
                assert streamed(form, pieces) == (reasoning, content), (a, b)


def test_streamed_thinking_comes_before_the_tag_is_complete() -> None:
    """Thinking is given as it comes; only what may be a tag's beginning is held back."""
    parser = QWEN3.parser()
    assert parser.feed("<think>abc</").reasoning == "abc"
    assert parser.feed("think>de").content == "de"


def test_unknown_parser_is_refused_by_name() -> None:
    assert resolve(None) is None
    assert resolve("qwen3") is QWEN3
    with pytest.raises(ValueError, match="--reasoning-parser: unknown parser 'nope'"):
        resolve("nope")
