"""Draft tokens for one replica's decodes: the configured proposer, and when not to ask it.

The scheduler asks ``propose`` for each decode of a step whose decodes number at most
``disable_by_batch_size``; the drafts are only proposals: the step verifies them
(``kvgate.engine.spec_decode.verify``) and the request keeps what the model itself would have
sampled. A request whose drafts were all rejected pauses (1, 3, 7, then 15 steps): where
nothing repeats, verifying rows that are all refused would cost a stream its decode stack's
speed for nothing. Only accepted tokens ever reach a request's ``token_ids``, so the suffix tries,
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

    def verified(self, request: Drafted, num_accepted: int) -> None:
        """The step kept ``num_accepted`` of the request's drafts; none: it pauses a while."""
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
        if keep_reply:
            self._replies.add(request.hash_root, request.token_ids[request.num_prompt_tokens :])
