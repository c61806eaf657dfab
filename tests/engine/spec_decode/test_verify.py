"""Verification keeps the model's distribution: at temperature 1 the tokens kept after
point-mass drafts (accepted or corrected) follow the target distribution (chi-square over a
6-token vocabulary, a few thousand draws), whether the draft is likely or not."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from kvgate.engine.sampling.structured import GrammarState
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.spec_decode.verify import accept_greedy, verify

DRAWS = 4000
CHI2_5_DOF_P001 = 20.515  # the chi-square critical value for 5 degrees of freedom at p = 0.001


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@dataclass
class Row:
    params: SamplingParams
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=lambda: [0, 1])
    eos_token_ids: frozenset[int] = frozenset()
    grammar: GrammarState | None = None
    num_prompt_tokens: int = 2


@pytest.mark.parametrize("first_draft", [0, 4])  # the likeliest token, and an unlikely one
def test_tokens_kept_follow_the_models_distribution(first_draft: int) -> None:
    torch.manual_seed(0)
    logits = torch.tensor(
        [
            [2.0, 1.0, 0.5, 0.0, -1.0, -3.0],  # after the last token
            [0.0, 1.5, 0.2, 0.2, 0.1, -1.0],  # after the first draft
            [0.3, 0.3, 0.3, 0.3, 0.3, 0.3],  # after both
        ]
    )
    drafts = [first_draft, 1]
    rows = [Row(SamplingParams(temperature=1.0, max_tokens=8)) for _ in range(DRAWS)]
    kept = verify(logits.repeat(DRAWS, 1), rows, [drafts] * DRAWS)
    probs = logits.softmax(dim=-1)
    first = torch.bincount(torch.tensor([k[0][0] for k in kept]), minlength=6)
    assert chi_square(first, probs[0]) < CHI2_5_DOF_P001
    then = [k[1][0] for k in kept if k[0][0] == first_draft]
    second = torch.bincount(torch.tensor(then), minlength=6)
    assert chi_square(second, probs[1]) < CHI2_5_DOF_P001
    assert all(len(k) == 1 or k[0][0] == first_draft for k in kept)  # a correction ends it


def test_greedy_keeps_the_matching_prefix_then_the_models_token() -> None:
    assert accept_greedy([5, 6, 9, 1], [[5, 6, 7]]) == [[5, 6, 9]]
    assert accept_greedy([5, 6, 7, 1, 3], [[5, 6, 7], []]) == [[5, 6, 7, 1], [3]]
    assert accept_greedy([2, 6], [[5]]) == [[2]]
