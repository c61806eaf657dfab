"""The stats line: vLLM's wording, the interval's throughput, silence while idle."""

from __future__ import annotations

import re
import time

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.core.stat_logger import StatLogger

LINE = re.compile(
    r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
    r"Running: 0 reqs, Waiting: 0 reqs, KV cache usage: 0\.0%, Prefix cache hit rate: ([\d.]+)%$"
)


def test_the_line_reports_the_intervals_tokens_per_second_then_nothing_while_idle() -> None:
    llm = LLM(dtype="float32", kv_cache_memory=16 * 2**20)
    prefix = "The quick brown fox jumps over the lazy dog. " * 6  # several 16-token blocks
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    started = time.monotonic()
    logger = StatLogger(llm.stats, 60.0)
    after_start = time.monotonic()
    outputs = [llm.generate([prefix + end], params)[0] for end in "AB"]  # B reuses A's blocks
    ended = time.monotonic()
    line = logger.line()
    after_line = time.monotonic()
    assert line is not None
    match = LINE.fullmatch(line)
    assert match is not None, line
    prompt_rate, generation_rate, hit_rate = map(float, match.groups())
    serving = llm.stats().serving
    computed = serving.prompt_tokens - serving.cached_prompt_tokens
    assert computed < sum(len(o.prompt_token_ids) for o in outputs)  # B reused A's blocks
    generated = sum(len(o.token_ids) for o in outputs)
    assert computed / (after_line - started) <= prompt_rate + 0.1
    assert prompt_rate <= computed / (ended - after_start) + 0.1
    assert generated / (after_line - started) <= generation_rate + 0.1
    assert generation_rate <= generated / (ended - after_start) + 0.1
    stats = llm.stats()
    assert hit_rate == round(100 * stats.prefix_hits / stats.prefix_queries, 1)
    assert logger.line() is None  # nothing ran, nothing waits: no line
