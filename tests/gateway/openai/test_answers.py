"""Stream chunks of an OpenAI answer: every delta goes out as it arrives (the first token is
not kept waiting for the second), and a reply's final delta rides with its finish_reason."""

from __future__ import annotations

from typing import Any

from kvgate.gateway.generation import Completion, TextDelta
from kvgate.gateway.openai.answers import ChatAnswer, CompletionsAnswer
from kvgate.gateway.openai.requests import Sampling
from kvgate.gateway.openai.responses import Envelope, TokenText

SAMPLING = Sampling({}, 1, True, False, None, None)
ENVELOPE = Envelope("cmpl-test", 0, "m")


def done(tokens: int, finish_reason: str = "length") -> Completion:
    return Completion("ab", finish_reason, 3, tokens, 0, 0)


def completions() -> CompletionsAnswer:
    return CompletionsAnswer(ENVELOPE, SAMPLING, TokenText(None), [[1, 2, 3]], False, None)


def texts(chunks: list[dict[str, Any]]) -> list[tuple[str, str | None]]:
    return [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks]


def test_a_delta_that_more_will_follow_goes_out_at_once() -> None:
    answer = completions()
    assert texts(answer.chunks(0, TextDelta("a", 1, [7], None))) == [("a", None)]
    assert texts(answer.chunks(0, TextDelta("b", 2, [8], None, final=True))) == []
    assert texts(answer.chunks(0, done(2))) == [("b", "length")]


def test_a_final_delta_followed_by_more_text_is_sent_before_it() -> None:
    """A parser's held-back text arrives as one more final delta after the engine's."""
    answer = completions()
    assert texts(answer.chunks(0, TextDelta("a", 1, [7], None, final=True))) == []
    assert texts(answer.chunks(0, TextDelta("b", 1, [], None, final=True))) == [("a", None)]
    assert texts(answer.chunks(0, done(1, "stop"))) == [("b", "stop")]


def test_a_reply_without_a_final_delta_ends_with_a_chunk_of_its_own() -> None:
    answer = completions()
    assert texts(answer.chunks(0, done(0))) == [("", "length")]


def test_chat_opens_with_the_role_then_streams_each_delta() -> None:
    answer = ChatAnswer(ENVELOPE, SAMPLING, TokenText(None))
    first = answer.chunks(0, TextDelta("Hi", 1, [7], None))
    assert [c["choices"][0]["delta"] for c in first] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
    ]
    assert answer.chunks(0, TextDelta("!", 2, [8], None, final=True)) == []
    (last,) = answer.chunks(0, done(2, "stop"))
    assert last["choices"][0]["delta"] == {"content": "!"}
    assert last["choices"][0]["finish_reason"] == "stop"
