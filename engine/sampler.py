"""Choose the next token of every sequence in a step from its logits.

Filtering (temperature → top-k → top-p) is vectorised over the batch, and each row draws
with its own request's generator, so a seeded request yields the same tokens whatever else
shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: {token_id: logprob} of the raw distribution (top-N plus the chosen token),
    # or None when that request did not ask for logprobs.
    logprobs: list[dict[int, float] | None]


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> SampleResult:
    """`logits` [B, V] float32 → one token per row; greedy rows take the (first) argmax."""
    if not (logits.shape[0] == len(params) == len(generators)):
        raise ValueError("logits, params and generators must have one entry per row")
    chosen = logits.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        rows = torch.tensor(random_rows, device=logits.device)
        probs = filtered_probs(logits.index_select(0, rows), [params[i] for i in random_rows])
        for row, i in enumerate(random_rows):
            generator = generators[i]
            row_probs = probs[row] if generator is None else probs[row].to(generator.device)
            chosen[i] = torch.multinomial(row_probs, 1, generator=generator)[0]
    token_ids = chosen.tolist()
    return SampleResult(token_ids, _logprobs(logits, params, token_ids))


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (nucleus) filtering, per row."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)
    scaled = logits / temperature.unsqueeze(1)
    vocab = scaled.shape[1]
    if all(not 0 < p.top_k < vocab and p.top_p >= 1.0 for p in params):
        return scaled.softmax(dim=-1)  # nothing to filter: skip the sort
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    ordered, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    ordered = ordered.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    ordered_probs = ordered.softmax(dim=-1)
    # Drop a token once the tokens ranked above it already reach top_p; the first always stays.
    before = ordered_probs.cumsum(dim=-1) - ordered_probs
    ordered = ordered.masked_fill(before > top_p.unsqueeze(1), float("-inf"))
    filtered = torch.full_like(scaled, float("-inf")).scatter(1, order, ordered)
    return filtered.softmax(dim=-1)


def _logprobs(
    logits: torch.Tensor, params: list[SamplingParams], token_ids: list[int]
) -> list[dict[int, float] | None]:
    wanted = [p.logprobs for p in params]
    if all(n is None for n in wanted):
        return [None] * len(params)
    logprobs = logits.log_softmax(dim=-1)
    most = max(n or 0 for n in wanted)
    top_values, top_ids = logprobs.topk(most, dim=-1) if most else (None, None)
    result: list[dict[int, float] | None] = []
    for row, n in enumerate(wanted):
        if n is None:
            result.append(None)
            continue
        entry = {}
        if n:
            entry = dict(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist(), strict=True))
        entry[token_ids[row]] = float(logprobs[row, token_ids[row]])
        result.append(entry)
    return result
