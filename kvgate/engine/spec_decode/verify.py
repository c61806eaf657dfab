"""Verify a step's drafts: each request keeps the drafts the model accepts, in order, then one
token of the model's own (the correction at the first rejection, or a bonus after them all).

    drafts      d0   d1   d2            rows of the step: the last token, then d0 d1 d2
    logits      L0   L1   L2   L3       (Li: the model's next-token logits after d0..d(i-1))
    greedy      argmax(L0) == d0 ? keep d0, look at L1 : keep argmax(L0), stop
    temperature accept di with probability p_i(di), else draw from p_i without di (sampler)

Position i's row is judged as the sampler would judge a request that had already taken
d0..d(i-1): its penalties and ``min_tokens`` see them, its grammar's mask is its state after
them (the matcher advanced by each accepted draft, and rolled back afterwards, so only the
scheduler, appending the kept tokens, moves it for good). So a grammar's refusal of a draft
is a rejection, and greedy output is the output without speculation, token for token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvgate.engine.sampling.sampler import SamplingRow, sample
from kvgate.engine.sampling.structured import GrammarState
from kvgate.engine.sampling_params import SamplingParams

SampledToken = tuple[int, dict[int, float] | None]


@dataclass
class _Ahead:
    """A request as its row at a later position sees it: with the drafts before it taken."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]
    eos_token_ids: frozenset[int]
    grammar: GrammarState | None
    num_prompt_tokens: int
    taken: int = 0  # drafts its grammar has accepted here (rolled back at the end)

    @classmethod
    def of(cls, row: SamplingRow) -> _Ahead:
        return cls(
            row.params,
            row.generator,
            list(row.token_ids),
            row.eos_token_ids,
            row.grammar,
            row.num_prompt_tokens,
        )

    def take(self, token: int) -> bool:
        """Extend by an accepted draft; False when the row can go no further (its grammar
        is complete, or cannot take the token: the scheduler's append then ends it)."""
        self.token_ids.append(token)
        if self.grammar is None:
            return True
        if not self.grammar.accept(token):
            return False
        self.taken += 1
        return not self.grammar.terminated


def verify(
    logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[list[int]]
) -> list[list[SampledToken]]:
    """Per row of ``rows``, the tokens it keeps: its accepted drafts, then the model's own.
    ``logits`` holds ``1 + len(drafts[i])`` consecutive fp32 rows for row i."""
    starts = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))
    ahead = [_Ahead.of(row) for row in rows]
    leads = [0 if row.grammar is None else row.grammar.lead for row in rows]
    kept: list[list[SampledToken]] = [[] for _ in rows]
    alive = list(range(len(rows)))
    try:
        for position in itertools.count():
            if not alive:
                break
            index = torch.tensor([starts[i] + position for i in alive], device=logits.device)
            proposed = [_at(drafts[i], position) for i in alive]
            result = sample(logits.index_select(0, index), [ahead[i] for i in alive], proposed)
            still = []
            for i, draft, token, logprobs in zip(
                alive, proposed, result.token_ids, result.logprobs, strict=True
            ):
                kept[i].append((token, logprobs))
                if token == draft and ahead[i].take(token):
                    still.append(i)
            alive = still
    finally:
        for view, lead in zip(ahead, leads, strict=True):
            if view.grammar is not None and view.taken:
                view.grammar.rollback(view.taken, lead)
    return kept


def accept_greedy(chosen: Sequence[int], drafts: Sequence[list[int]]) -> list[list[int]]:
    """``verify`` for rows that take the argmax of their raw logits (``plain_greedy``):
    ``chosen`` holds those argmaxes, ``1 + len(drafts[i])`` for row i."""
    kept = []
    at = 0
    for draft in drafts:
        model = chosen[at : at + len(draft) + 1]
        at += len(draft) + 1
        n = 0
        while n < len(draft) and draft[n] == model[n]:
            n += 1
        kept.append(list(model[: n + 1]))
    return kept


def _at(draft: list[int], position: int) -> int | None:
    return draft[position] if position < len(draft) else None
