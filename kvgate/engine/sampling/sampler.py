"""Choose the next token of every sequence in a step from its logits.

    logits → min_tokens ban → logit_bias → repetition penalty → frequency/presence penalties
           → grammar bitmask (structured outputs) → greedy argmax | temperature → top-k → top-p → draw with the row's generator

Every stage is vectorised over the batch (the per-request loops build index lists, never
walk the vocabulary), and rows that ask for nothing skip it. Each row draws with its own
request's generator, so a seeded request yields the same tokens whatever else shares its
batch. No row can fail the step: the numeric corners are clamped, and a row whose
distribution still is not a distribution (all banned, non-finite logits) takes the argmax of
its raw logits instead of raising for the whole batch. Logprobs are those of the raw logits
(vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

import kvgate.engine.cpu_ops as cpu_ops
from kvgate.engine.sampling.structured import GrammarState, apply_bitmask, fill_bitmask
from kvgate.engine.sampling_params import GREEDY_BELOW, SamplingParams

MAX_TEMPERATURE = 1e30  # any finite fp32 divisor keeps -inf bans at -inf; beyond is uniform
# Repetition penalties are clamped here so realistic logits stay finite in fp32 after it.
PENALTY_RANGE = (2.0**-20, 2.0**20)


class SamplingRow(Protocol):
    """What the sampler reads of one request (kvgate.engine.core.request.Request provides all of it)."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]  # prompt + output so far
    eos_token_ids: frozenset[int]
    grammar: GrammarState | None  # structured outputs: the tokens it allows next

    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass
class SampleResult:
    token_ids: list[int]
    # Per row: {token_id: logprob} of the raw distribution (top-N plus the chosen token),
    # or None when that request did not ask for logprobs.
    logprobs: list[dict[int, float] | None]


def _draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` [R, V] by inverse CDF: one uniform per row against the
    row's cumulative sum (fp64, so a long tail keeps its share), found by binary search. A
    ``torch.multinomial`` per row cost ~10% of a 16-stream decode step's thread (3.7 ms for 16
    rows of 8k), and exponential noise over every logit as much: both draw V numbers a row.
    Seeded rows draw from their own generator, so their tokens do not depend on the batch."""
    uniform = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device)
    for row, generator in enumerate(generators):
        if generator is not None:
            own = torch.rand(1, dtype=torch.float64, generator=generator, device=generator.device)
            uniform[row] = own.to(probs.device)
    cdf = probs.double().cumsum(dim=-1)
    # 1 - u lies in (0, 1]: the target is never 0, where a zero-probability first token would
    # be found; the search takes the first index reaching it, never a zero-probability one.
    target = (1 - uniform) * cdf[:, -1:]
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sample(
    logits: torch.Tensor, rows: Sequence[SamplingRow], drafts: Sequence[int | None] = ()
) -> SampleResult:
    """`logits` [B, V] float32 → one token per row; greedy rows take the (first) argmax.
    ``drafts``: a proposed token per row (None: none), which a row returns exactly when it
    accepts it (`_judge_drafts`; a greedy row accepts its argmax only)."""
    if logits.shape[0] != len(rows):
        raise ValueError("logits and rows must have one entry per row")
    params = [r.params for r in rows]
    processed = processed_logits(logits, rows)
    chosen = argmax(processed)
    random_rows = [i for i, p in enumerate(params) if not p.greedy]
    if random_rows:
        index = torch.tensor(random_rows, device=logits.device)
        probs = filtered_probs(processed.index_select(0, index), [params[i] for i in random_rows])
        generators = [rows[i].generator for i in random_rows]
        if drafts:
            _judge_drafts(probs, [drafts[i] for i in random_rows], generators)
        drawn = _draw(probs, generators)
        drawable = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
        chosen[index] = torch.where(drawable, drawn, chosen[index])  # else keeps its argmax
    if processed is not logits:
        # A row left with no finite logit (all banned, or the model's own inf/nan) falls back
        # to its raw argmax rather than to index 0.
        dead = ~(processed.max(dim=-1).values > float("-inf"))
        chosen = torch.where(dead, logits.argmax(dim=-1), chosen)
    token_ids = chosen.tolist()
    return SampleResult(token_ids, _logprobs(logits, params, token_ids))


def _judge_drafts(
    probs: torch.Tensor, drafts: Sequence[int | None], generators: Sequence[torch.Generator | None]
) -> None:
    """In place, speculative decoding's rejection sampling for a proposal that is a point mass
    (an n-gram or suffix draft ``d``): the row accepts ``d`` with probability ``p(d)`` (its
    probs become one-hot on ``d``), else it draws from ``p`` with ``d`` removed (renormalised
    by the draw). Either way the token has ``p``'s distribution, as without the draft."""
    for row, (draft, generator) in enumerate(zip(drafts, generators, strict=True)):
        if draft is None:
            continue
        device = probs.device if generator is None else generator.device
        uniform = torch.rand(1, dtype=torch.float64, generator=generator, device=device)
        if uniform.item() < probs[row, draft].item():
            probs[row].zero_()
            probs[row, draft] = 1.0
        else:
            probs[row, draft] = 0.0


def plain_greedy(rows: Sequence[SamplingRow]) -> bool:
    """Whether every row takes the argmax of its raw logits: greedy, no logprobs, and nothing
    that changes the logits (`processed_logits` would return them as they are). Then `argmax`
    of the logits in the model's dtype is the whole step's sampling."""
    return all(
        row.params.greedy
        and row.params.logprobs is None
        and not row.params.logit_bias
        and not row.params.penalized
        and row.grammar is None
        and not _bans_stops(row)
        for row in rows
    )


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` on the caller's thread where the native kernel serves (torch's
    opens an OpenMP region for a batch's logits)."""
    chosen = cpu_ops.argmax(logits)
    return logits.argmax(dim=-1) if chosen is None else chosen


def _bans_stops(row: SamplingRow) -> bool:
    """Whether ``min_tokens`` still bans the row's stop tokens."""
    p = row.params
    return bool(p.min_tokens) and len(row.token_ids) - row.num_prompt_tokens < p.min_tokens


def processed_logits(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The logits after min_tokens bans, logit_bias, the penalties and the grammar masks (one
    bitmask for the batch); ``logits`` itself (no copy) when no row asks for any."""
    vocab = logits.shape[1]
    banned: list[tuple[int, list[int]]] = []
    penalized: list[int] = []
    biased = [i for i, row in enumerate(rows) if row.params.logit_bias]
    for i, row in enumerate(rows):
        p = row.params
        if _bans_stops(row):
            stops = (
                set(p.stop_token_ids) if p.ignore_eos else row.eos_token_ids.union(p.stop_token_ids)
            )
            banned.append((i, [t for t in stops if t < vocab]))
        if p.penalized:
            penalized.append(i)
    bitmask = fill_bitmask([row.grammar for row in rows], vocab)
    if not banned and not penalized and not biased and bitmask is None:
        return logits
    out = logits.clone()
    device = logits.device
    if banned:
        ban_rows = torch.tensor([i for i, ids in banned for _ in ids], dtype=torch.int64)
        ban_ids = torch.tensor([t for _, ids in banned for t in ids], dtype=torch.int64)
        out[ban_rows.to(device), ban_ids.to(device)] = float("-inf")
    if biased:
        _bias(out, rows, biased)
    if penalized:
        _penalize(out, rows, penalized)
    if bitmask is not None:
        apply_bitmask(out, bitmask)
    return out


def _bias(out: torch.Tensor, rows: Sequence[SamplingRow], biased: list[int]) -> None:
    """In place: each row's ``logit_bias`` added to its tokens' logits (vLLM's order: with
    the min_tokens bans, before the penalties, the grammar mask and temperature; a banned
    token stays at -inf). Ids beyond the logits (refused at admission) are skipped."""
    vocab = out.shape[1]
    flat = out.view(-1)
    for i in biased:
        ids, values = rows[i].params.logit_bias_arrays
        tokens = torch.frombuffer(ids, dtype=torch.int64)
        bias = torch.frombuffer(values, dtype=torch.float32)
        keep = tokens < vocab
        keys = (tokens[keep] + i * vocab).to(out.device)
        flat.index_add_(0, keys, bias[keep].to(device=out.device, dtype=out.dtype))


def _penalize(out: torch.Tensor, rows: Sequence[SamplingRow], penalized: list[int]) -> None:
    """In place on rows ``penalized`` of ``out``: repetition (over prompt + output), then
    frequency and presence (over the output). Sparse: only the logits of tokens seen are read
    and written, so the cost follows the histories, not batch x vocabulary."""
    flat = out.view(-1)
    repeating = [i for i in penalized if rows[i].params.repetition_penalty != 1.0]
    seen = _seen(out, rows, repeating, output_only=False)
    if seen is not None:
        keys, owners = seen
        low, high = PENALTY_RANGE
        penalty = _per_row(
            out, [min(max(rows[i].params.repetition_penalty, low), high) for i in repeating]
        )
        penalty = penalty[owners]
        values = flat[keys]  # a token seen twice is gathered twice, written back alike
        flat[keys] = torch.where(values > 0, values / penalty, values * penalty)
    openai = [
        i for i in penalized if rows[i].params.presence_penalty or rows[i].params.frequency_penalty
    ]
    seen = _seen(out, rows, openai, output_only=True)
    if seen is not None:
        keys, owners = seen
        frequency = _per_row(out, [rows[i].params.frequency_penalty for i in openai])[owners]
        presence = _per_row(out, [rows[i].params.presence_penalty for i in openai])[owners]
        flat.index_add_(0, keys, -frequency)  # once per occurrence
        flat[keys] = flat[keys] - presence  # once per token


def _per_row(out: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor([float(v) for v in values], dtype=out.dtype, device=out.device)


def _seen(
    out: torch.Tensor, rows: Sequence[SamplingRow], which: list[int], output_only: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Flat indices ``row * vocab + token`` into ``out`` of the (output) tokens of rows
    ``which``, one per occurrence, and for each the position in ``which`` of its row; None
    when there are none."""
    ids, lengths = array.array("q"), []
    for i in which:
        row = rows[i]
        history = row.token_ids[row.num_prompt_tokens :] if output_only else row.token_ids
        ids.extend(history)
        lengths.append(len(history))
    if not ids:
        return None
    device, vocab = out.device, out.shape[1]
    tokens = torch.frombuffer(ids, dtype=torch.int64).to(device)
    owners = torch.repeat_interleave(
        torch.arange(len(which), device=device), torch.tensor(lengths, device=device)
    )
    keep = tokens < vocab  # a tokenizer id beyond the model's logits never gets a logit
    tokens, owners = tokens[keep], owners[keep]
    row_of = torch.tensor(which, dtype=torch.int64, device=device)
    return row_of[owners] * vocab + tokens, owners


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p (nucleus) filtering, per row."""
    device = logits.device
    temperature = torch.tensor(
        [min(max(p.temperature, GREEDY_BELOW), MAX_TEMPERATURE) for p in params], device=device
    )
    scaled = logits / temperature.unsqueeze(1)
    vocab = scaled.shape[1]
    if all(not 0 < p.top_k < vocab and p.top_p >= 1.0 for p in params):
        return scaled.softmax(dim=-1)  # nothing to filter: skip the sort
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
    # top_p 1 keeps everything exactly (a cumulative sum may round past 1.0).
    top_p = torch.tensor(
        [p.top_p if p.top_p < 1.0 else float("inf") for p in params], device=device
    )
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
    most = min(max(n or 0 for n in wanted), logits.shape[1])
    top_values, top_ids = logprobs.topk(most, dim=-1)  # k = 0: empty, never read
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logits.device).unsqueeze(1))
    chosen_values = chosen.squeeze(1).tolist()
    result: list[dict[int, float] | None] = []
    for row, n in enumerate(wanted):
        if n is None:
            result.append(None)
            continue
        entry = {}
        if n:
            entry = dict(zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist(), strict=True))
        entry[token_ids[row]] = chosen_values[row]
        result.append(entry)
    return result
