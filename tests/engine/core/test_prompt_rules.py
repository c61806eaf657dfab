"""`PromptRules.prompt_ids`: token-id prompts are checked as the vocabulary allows, and
refused with the field named when they are not ids."""

from __future__ import annotations

import enum
from pathlib import Path

import pytest

from kvgate.engine.core.prompt_rules import Limits, PromptRules
from kvgate.engine.tokenization.tokenizer import Tokenizer


class Token(enum.IntEnum):
    BOS = 0


@pytest.fixture(scope="module")
def rules(tiny_model_dir: Path) -> PromptRules:
    return PromptRules(Tokenizer.from_dir(tiny_model_dir), Limits(100, 64, None))


def test_ids_come_back_as_plain_ints(rules: PromptRules) -> None:
    assert rules.prompt_ids([5, 99, 0]) == [5, 99, 0]
    assert rules.prompt_ids((7, 8)) == [7, 8]
    ids = rules.prompt_ids([Token.BOS, 3])
    assert ids == [0, 3] and [type(t) for t in ids] == [int, int]


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ([1, 100], "token ids must be in"),
        ([-1, 2], "token ids must be in"),
        ([1, True], "a list of token ids"),
        ([1, 2.0], "a list of token ids"),
        ([1, "2"], "a list of token ids"),
        ([], "must not be empty"),
    ],
)
def test_bad_ids_are_refused(rules: PromptRules, prompt: list[object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rules.prompt_ids(prompt)  # type: ignore[arg-type]
