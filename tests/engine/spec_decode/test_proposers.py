"""The proposers: vLLM's n-gram choice of match, the suffix trie's counts and speculation,
the reply cache's tenant walls, and the config's JSON with vLLM's defaults."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.spec_decode.config import SpeculativeConfig
from kvgate.engine.spec_decode.ngram import propose_ngram
from kvgate.engine.spec_decode.speculator import Speculator, draft_length, verify_cost
from kvgate.engine.spec_decode.suffix import ReplyCache, SuffixLimits, SuffixTrie


def brute_force_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The rule as vLLM documents it: the longest suffix of min_n..max_n tokens that occurs
    earlier (ending before the last token), its first occurrence, and up to k tokens after."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        for start in range(0, total - n):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)),
    k=st.integers(0, 6),
)
def test_ngram_takes_the_longest_suffix_and_its_first_occurrence(
    tokens: list[int], bounds: tuple[int, int], k: int
) -> None:
    low, extra = bounds
    assert propose_ngram(tokens, low, low + extra, k) == brute_force_ngram(
        tokens, low, low + extra, k
    )


def test_ngram_ignores_a_match_split_across_token_bytes() -> None:
    # 256 packs as 00 01 00 00: a byte-level hit at an odd offset is not a token match.
    tokens = [1, 256, 0, 7, 1, 0]
    assert propose_ngram(tokens, 1, 2, 2) == brute_force_ngram(tokens, 1, 2, 2)


def test_ngram_proposes_the_rest_of_a_repeated_span() -> None:
    code = list(range(100, 140))
    context = code + [9, 9] + code[:10]
    assert propose_ngram(context, 2, 4, 5) == code[10:15]


def test_suffix_trie_counts_every_run_up_to_its_depth_and_forgets_a_sequence() -> None:
    trie = SuffixTrie(depth=3)
    trie.extend([1, 2, 3, 1, 2, 4])
    assert (trie.count([1]), trie.count([1, 2]), trie.count([1, 2, 3])) == (2, 2, 1)
    assert (trie.count([1, 2, 4]), trie.count([2, 3, 1]), trie.count([1, 2, 3, 1])) == (1, 1, 0)
    trie.end_sequence()
    trie.extend([5])
    assert trie.count([4, 5]) == 0 and trie.count([5]) == 1  # no run spans two sequences
    trie.remove([5])
    trie.remove([1, 2, 3, 1, 2, 4])
    assert trie.empty and trie.count([1]) == 0
    trie.extend([7, 8, 7, 9])  # the removed nodes are reused, the counts start afresh
    assert (trie.count([7]), trie.count([7, 8]), trie.count([8, 7, 9])) == (2, 1, 1)


def test_suffix_trie_counts_as_a_brute_force_count_through_removals() -> None:
    rng = random.Random(3)
    trie, fed = SuffixTrie(depth=4), []
    for _ in range(40):
        if fed and rng.random() < 0.3:
            trie.remove(fed.pop(rng.randrange(len(fed))))
        else:
            sequence = [rng.randrange(5) for _ in range(rng.randrange(1, 12))]
            trie.extend(sequence)
            trie.end_sequence()
            fed.append(sequence)
        for run in ([rng.randrange(5) for _ in range(rng.randrange(1, 5))] for _ in range(20)):
            expected = sum(seq[i : i + len(run)] == run for seq in fed for i in range(len(seq)))
            assert trie.count(run) == expected, (run, fed)
    for sequence in fed:
        trie.remove(sequence)
    assert trie.empty


def test_suffix_speculation_follows_the_frequent_path_within_its_limits() -> None:
    trie = SuffixTrie(depth=8)
    story = [1, 2, 3, 4, 5, 6]
    trie.extend(story * 3 + [1, 2])
    limits = SuffixLimits(depth=8, spec_factor=1.0, min_prob=0.1)
    score, tokens = trie.propose(story * 3 + [1, 2], 6, limits)
    assert tokens[:4] == [3, 4, 5, 6] and score > 0
    strict = SuffixLimits(depth=8, spec_factor=1.0, min_prob=0.99)
    assert trie.propose(story * 3 + [1, 2], 6, strict)[1] == []  # 3/4 of occurrences go on
    short = SuffixLimits(depth=8, spec_factor=0.5, min_prob=0.1)
    assert len(trie.propose([9, 1, 2], 6, short)[1]) <= 1  # a 2-token match: at most 1 token


def test_reply_cache_keeps_tenants_apart_and_forgets_the_oldest() -> None:
    limits = SuffixLimits(depth=8, spec_factor=4.0, min_prob=0.1)
    cache = ReplyCache(capacity=2, depth=8)
    cache.add(b"tenant-a", [10, 11, 12, 13, 14])
    assert cache.propose(b"tenant-a", [7, 10, 11], 3, limits)[1] == [12, 13, 14]
    assert cache.propose(b"tenant-b", [7, 10, 11], 3, limits)[1] == []
    cache.add(b"tenant-b", [20, 21, 22])
    cache.add(b"tenant-b", [30, 31, 32])
    assert cache.propose(b"tenant-a", [7, 10, 11], 3, limits)[1] == []  # evicted, FIFO


@dataclass(eq=False)
class Drafting:
    token_ids: list[int]
    num_prompt_tokens: int
    hash_root: bytes = b"root"
    max_model_len: int = 1000
    params: SamplingParams = field(default_factory=lambda: SamplingParams(max_tokens=100))


def test_speculator_caps_drafts_by_budget_max_tokens_and_context() -> None:
    speculator = Speculator(
        SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 8}')
    )
    text = [random.Random(0).randrange(50) for _ in range(30)]
    request = Drafting(text * 2, num_prompt_tokens=55)
    for _ in range(4):  # drafts accepted in full: acceptance near 1 pays for all 8
        speculator.verified(request, 8, 8)
    assert len(speculator.propose(request, budget=100)) == 8
    assert len(speculator.propose(request, budget=3)) == 3
    request.params = SamplingParams(max_tokens=8)  # 5 generated: 3 more at most, 1 sampled
    assert len(speculator.propose(request, budget=100)) == 2
    request.max_model_len = 62
    assert speculator.propose(request, budget=100) == [text[0]]
    assert speculator.active(8) and not speculator.active(9)


def test_suffix_speculator_reuses_a_finished_reply_of_the_same_root_only() -> None:
    speculator = Speculator(SpeculativeConfig.parse({"method": "suffix"}))
    reply = list(range(200, 230))
    done = Drafting([1, 2, 3, *reply], num_prompt_tokens=3)
    speculator.finished(done, keep_reply=True)
    same = Drafting([4, 5, *reply[:6]], num_prompt_tokens=2)
    for _ in range(4):  # its drafts all accepted: as long as the match allows
        speculator.verified(same, 8, 8)
    assert speculator.propose(same, budget=10) == reply[6:12]
    other = Drafting([4, 5, *reply[:6]], num_prompt_tokens=2, hash_root=b"another tenant")
    assert speculator.propose(other, budget=10) == []


def test_config_reads_vllms_json_and_defaults() -> None:
    both = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)
    one = SpeculativeConfig.parse(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    assert SpeculativeConfig.parse({"method": "suffix"}).num_speculative_tokens == 24
    for bad, words in (
        ({"method": "ngram"}, "num_speculative_tokens"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 2,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "<=",
        ),
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "typo"),
        ({"model": "/models/draft", "num_speculative_tokens": 2}, "draft model"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ):
        with pytest.raises(ValueError, match=words):
            SpeculativeConfig.parse(bad)


def test_a_request_refusing_every_draft_pauses_longer_each_time() -> None:
    speculator = Speculator(
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    )
    request = Drafting([1, 2, 3, 4, 5, 6] * 3, num_prompt_tokens=10)

    def drafting_steps(steps: int) -> list[bool]:
        return [bool(speculator.propose(request, budget=10)) for _ in range(steps)]

    speculator.verified(request, 4, 0)
    assert drafting_steps(2) == [False, True]
    speculator.verified(request, 4, 0)
    assert drafting_steps(4) == [False, False, False, True]
    speculator.verified(request, 2, 2)  # an accepted draft ends the pause
    assert drafting_steps(1) == [True]


def test_draft_length_pays_for_itself_at_the_observed_acceptance() -> None:
    """The length maximizes expected tokens per unit of step cost, checked by brute force."""
    for acceptance in (0.0, 0.3, 0.6, 0.8, 0.9, 0.97, 1.0):
        for most in (1, 4, 8, 24):

            def tokens_per_cost(k: int, a: float = acceptance) -> float:
                return sum(a**i for i in range(k + 1)) / verify_cost(k)

            best = max(range(1, most + 1), key=tokens_per_cost)
            assert tokens_per_cost(draft_length(acceptance, most)) == pytest.approx(
                tokens_per_cost(best)
            )
    assert draft_length(0.3, 8) == 1 and draft_length(1.0, 8) == 8


def test_drafts_shorten_as_a_request_rejects_them_and_grow_back() -> None:
    speculator = Speculator(
        SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 8})
    )
    request = Drafting(list(range(40)) * 3, num_prompt_tokens=100)
    first = len(speculator.propose(request, budget=100))
    lengths = []
    for _ in range(3):  # one draft of each kept: acceptance falls towards 1/2
        drafts = speculator.propose(request, budget=100)
        speculator.verified(request, len(drafts), 1)
        lengths.append(len(speculator.propose(request, budget=100)))
    assert first > lengths[0] >= lengths[-1] and lengths[-1] <= 2
    for _ in range(6):
        drafts = speculator.propose(request, budget=100)
        speculator.verified(request, len(drafts), len(drafts))
    assert len(speculator.propose(request, budget=100)) == 8
