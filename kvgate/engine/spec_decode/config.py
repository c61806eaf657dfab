"""What ``--speculative-config`` reads: vLLM 0.32's JSON, its names and its defaults.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "suffix"}                      (num_speculative_tokens: the tree depth, 24)

As in vLLM, an n-gram lookup needs ``num_speculative_tokens``; with neither lookup bound given
both are 5, with one given the other takes its value. ``disable_by_batch_size`` (vLLM v0's
name) is kvgate's back-off: a step with more decodes than that does not speculate, because
its rows already fill the matmuls that a single stream leaves idle (measured in
``benchmarks/spec_decode.py``). A draft model (``"model"``) is refused: it would need a second
model with its own KV cache, block tables and K forwards per step, and on a CPU a step is
bound by reading weights, which a draft model's forwards read again.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix")
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, when neither bound is given
# Decodes in a step beyond which it does not speculate: 8 concurrent edits of SmolLM2-135M Q4_1
# still gained 1.05-1.15x from drafts on 2 Zen 5 cores (benchmarks/spec_decode.py, medians of
# 3-6 rounds), where each further row of a product costs a fraction of the first.
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram: shortest suffix looked up
    prompt_lookup_max: int = 0  # ngram: longest suffix looked up
    # suffix: a trie of every run of up to this many tokens (match + speculation)
    suffix_decoding_max_tree_depth: int = 24
    # suffix: finished replies kept per replica (FIFO), each in its own tenant's trie; vLLM keeps
    # 10,000, but a reply's trie costs ~depth Python nodes per token here, so fewer by default.
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_max_spec_factor: float = 1.0  # speculate at most this times the match length
    suffix_decoding_min_token_prob: float = 0.1  # stop once a path's estimated probability is below
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE

    @classmethod
    def parse(cls, value: str | Mapping[str, Any]) -> SpeculativeConfig:
        """The config of a JSON object (text or parsed); ValueError naming what is wrong."""
        raw = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(raw, dict):
            raise ValueError('speculative_config: a JSON object, like {"method": "ngram", ...}')
        if raw.get("model") is not None:
            raise ValueError(
                "speculative_config: a draft model is not supported; use method ngram or suffix"
            )
        raw.pop("model", None)
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(raw) - known):
            raise ValueError(f"speculative_config: unknown field {unknown[0]!r}")
        method = str(raw.get("method", "")).strip("[]")
        if method not in METHODS:
            raise ValueError(f"speculative_config: method must be one of {METHODS}, got {method!r}")
        raw["method"] = method
        if method == "ngram":
            _ngram_defaults(raw)
        elif raw.get("num_speculative_tokens") is None:
            raw["num_speculative_tokens"] = raw.get("suffix_decoding_max_tree_depth", 24)
        config = cls(**raw)
        config._check()
        return config

    def _check(self) -> None:
        for name in ("num_speculative_tokens", "disable_by_batch_size"):
            _at_least(name, getattr(self, name), 1)
        if self.method == "ngram":
            _at_least("prompt_lookup_min", self.prompt_lookup_min, 1)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(
                    f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} must be "
                    f"<= prompt_lookup_max={self.prompt_lookup_max}"
                )
        _at_least("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth, 1)
        _at_least(
            "suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0
        )
        if not self.suffix_decoding_max_spec_factor >= 0:
            raise ValueError("speculative_config: suffix_decoding_max_spec_factor must be >= 0")
        if not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("speculative_config: suffix_decoding_min_token_prob must be in [0, 1]")


def _ngram_defaults(raw: dict[str, Any]) -> None:
    if raw.get("num_speculative_tokens") is None:
        raise ValueError("speculative_config: method ngram needs num_speculative_tokens")
    low, high = raw.get("prompt_lookup_min"), raw.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    raw["prompt_lookup_min"] = high if low is None else low
    raw["prompt_lookup_max"] = low if high is None else high


def _at_least(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(
            f"speculative_config: {name} must be an integer >= {minimum}, got {value!r}"
        )
