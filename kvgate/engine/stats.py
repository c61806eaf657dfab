"""Load and cache figures, per replica and in total (named as kvgate/gateway/ops/metrics.py reads them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.engine.core.serving_stats import ServingStats


@dataclass(frozen=True)
class ReplicaStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # blocks this replica holds / usable blocks
    prefix_queries: int  # prompt tokens looked up in the prefix cache, cumulative
    prefix_hits: int  # of those, tokens found cached


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_usage: float  # blocks in use (any replica) / usable blocks
    prefix_queries: int
    prefix_hits: int
    num_cached_blocks: int
    block_size: int
    num_blocks: int
    cache_dtype: str
    enable_prefix_caching: bool
    per_replica: list[ReplicaStats] = field(default_factory=list)
    # Compiled grammars (structured outputs) kept: their memory, its bound, how many; and the
    # largest spec compiled at all (0: not known).
    grammar_cache_bytes: int = 0
    grammar_cache_limit_bytes: int = 0
    grammar_cache_entries: int = 0
    max_grammar_bytes: int = 0
    # What the generations served measured (token counts, timings), summed over replicas.
    serving: ServingStats = field(default_factory=ServingStats)
    admission_rejections: int = 0  # requests refused for a full waiting queue (max_waiting)
    # LoRA: the most adapters a step runs (None: LoRA is off), and the adapters of the
    # running and of the waiting requests, by name.
    max_loras: int | None = None
    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
