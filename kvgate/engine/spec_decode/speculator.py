"""Draft tokens for one replica's decodes: the configured proposer, and when not to ask it.

The scheduler asks ``propose`` for each decode of a step whose decodes number at most
``disable_by_batch_size``; the drafts are only proposals: the step verifies them
(``kvgate.engine.spec_decode.verify``) and the request keeps what the model itself would have
sampled. Verifying is not free: each drafted token is a row of the step's forward
(`verify_cost`), so a request drafts only as many tokens as its own recent acceptance pays
for (`draft_length`), and one whose
drafts were all rejected pauses (1, 3, 7, then 15 steps): where nothing repeats, verifying rows
that are all refused would cost a stream its decode stack's speed for nothing. Only accepted tokens ever reach a request's ``token_ids``, so the suffix tries,
fed from them, never learn a rejected draft. One instance per replica, used by its step
thread alone: no lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.spec_decode.config import SpeculativeConfig
from kvgate.engine.spec_decode.ngram import propose_ngram
from kvgate.engine.spec_decode.suffix import ReplyCache, SuffixLimits, SuffixTrie

MAX_PAUSE_DOUBLINGS = 4  # a request refusing every draft retries every 15 steps at the least
# A new request's acceptance, as (accepted, tried) draft tokens: 0.9 worth two tokens, so the
# first drafts are long (agents' replies repeat their context) and one miss shortens them.
PRIOR_ACCEPTANCE = (1.8, 2.0)
ACCEPTANCE_DECAY = 0.75  # each verification's weight against the ones before it
DRAFT_ROW_COST = 0.3  # a verified draft's share of a plain step (`verify_cost`)


def verify_cost(drafts: int) -> float:
    """A step verifying ``drafts`` tokens of one request, in plain decode steps. Measured on
    SmolLM2-135M Q4_1, 2 threads of a Zen 5: 1.2-1.3 for 1 draft, 1.5 for 2, 2.0-2.2 for 4,
    3.4-3.8 for 8 (the rows share each weight's read, not their attention or output rows);
    3.5 for 8 on a Zen 3. A straight line through the 8 drafts' figure overstates the cost of
    a few, which errs towards drafting less."""
    return 1 + DRAFT_ROW_COST * drafts


def draft_length(acceptance: float, most: int) -> int:
    """The number of drafts, at most ``most``, that maximizes the tokens a step yields per unit
    of its cost, where each draft is accepted with probability ``acceptance`` if the one before
    it was: sum(acceptance**i, i=0..k) tokens for ``verify_cost(k)``; at least 1, a probe
    (pauses after misses bound what probes cost)."""
    best, best_yield, expected = 1, 0.0, 1.0
    for k in range(1, most + 1):
        expected += acceptance**k
        if expected / verify_cost(k) > best_yield:
            best, best_yield = k, expected / verify_cost(k)
    return best


class Drafted(Protocol):
    """What a proposer reads of a request (kvgate.engine.core.request.Request provides it)."""

    token_ids: list[int]  # prompt + accepted output
    params: SamplingParams
    hash_root: bytes  # model, adapter and tenant salt: whose earlier replies it may reuse
    max_model_len: int

    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass
class _Fed:
    trie: SuffixTrie
    count: int = 0  # tokens of the request fed to the trie


@dataclass
class Speculator:
    config: SpeculativeConfig
    _requests: dict[Drafted, _Fed] = field(default_factory=dict)
    _misses: dict[Drafted, tuple[int, int]] = field(default_factory=dict)  # (in a row, steps left)
    # Decayed (accepted, tried) draft tokens: a rejected draft is tried, the ones after it not.
    _acceptance: dict[Drafted, tuple[float, float]] = field(default_factory=dict)
    _replies: ReplyCache = field(init=False)

    def __post_init__(self) -> None:
        config = self.config
        self._limits = SuffixLimits(
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
        )
        capacity = config.suffix_decoding_max_cached_requests if config.method == "suffix" else 0
        self._replies = ReplyCache(capacity, config.suffix_decoding_max_tree_depth)

    def active(self, num_decodes: int) -> bool:
        """Whether a step of ``num_decodes`` decodes speculates (small steps only)."""
        return num_decodes <= self.config.disable_by_batch_size

    def propose(self, request: Drafted, budget: int) -> list[int]:
        """Draft tokens to verify after the request's last token, at most ``budget`` of them
        and never more than its ``max_tokens`` or context length could keep."""
        output = len(request.token_ids) - request.num_prompt_tokens
        k = min(
            self.config.num_speculative_tokens,
            budget,
            request.params.max_tokens - output - 1,
            request.max_model_len - len(request.token_ids) - 1,
        )
        if k <= 0 or self._paused(request):
            return []
        accepted, tried = self._acceptance.get(request, PRIOR_ACCEPTANCE)
        k = min(k, draft_length(accepted / tried, k))
        config = self.config
        if config.method == "ngram":
            return propose_ngram(
                request.token_ids, config.prompt_lookup_min, config.prompt_lookup_max, k
            )
        fed = self._requests.get(request)
        if fed is None:
            fed = self._requests[request] = _Fed(SuffixTrie(self._limits.depth))
        fed.trie.extend(request.token_ids[fed.count :])
        fed.count = len(request.token_ids)
        own = fed.trie.propose(request.token_ids, k, self._limits)
        earlier = self._replies.propose(request.hash_root, request.token_ids, k, self._limits)
        return max(own, earlier, key=lambda scored: scored[0])[1]

    def verified(self, request: Drafted, num_drafted: int, num_accepted: int) -> None:
        """The step kept ``num_accepted`` of the request's ``num_drafted`` drafts; none: it
        pauses a while."""
        accepted, tried = self._acceptance.get(request, PRIOR_ACCEPTANCE)
        self._acceptance[request] = (
            ACCEPTANCE_DECAY * accepted + num_accepted,
            ACCEPTANCE_DECAY * tried + num_accepted + (num_accepted < num_drafted),
        )
        if num_accepted:
            self._misses.pop(request, None)
            return
        misses = self._misses.get(request, (0, 0))[0] + 1
        self._misses[request] = (misses, 2 ** min(misses, MAX_PAUSE_DOUBLINGS) - 1)

    def _paused(self, request: Drafted) -> bool:
        misses, left = self._misses.get(request, (0, 0))
        if left:
            self._misses[request] = (misses, left - 1)
        return left > 0

    def finished(self, request: Drafted, keep_reply: bool) -> None:
        """The request is done: drop its trie; ``keep_reply``: its reply may be proposed to
        later requests of the same hash root."""
        self._requests.pop(request, None)
        self._misses.pop(request, None)
        self._acceptance.pop(request, None)
        if keep_reply:
            self._replies.add(request.hash_root, request.token_ids[request.num_prompt_tokens :])
