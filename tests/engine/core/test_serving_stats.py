"""The engine's serving figures: token counts that add up, vLLM's intervals and buckets, and
each way a generation ends counted under its own reason."""

from __future__ import annotations

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.core.serving_stats import ServingStats, request_tokens_buckets
from tests.engine.scheduling_helpers import make_request, make_scheduler, step


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 31 + i) % 97 + 3 for i in range(n)]


def test_request_token_buckets_are_vllms_1_2_5_series_up_to_the_context() -> None:
    assert request_tokens_buckets(2048) == (
        1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 2000.0,
    )  # fmt: skip
    assert request_tokens_buckets(1) == (1.0,)


def test_finished_generations_count_their_tokens_and_phases() -> None:
    scheduler = make_scheduler(64)
    requests = [make_request(prompt(20, 1), max_tokens=5), make_request(prompt(7, 2), 3)]
    for request in requests:
        scheduler.add(request)
    while scheduler.has_work():
        step(scheduler)
    stats = scheduler.meter.snapshot()
    assert stats.prompt_tokens == 27 and stats.generation_tokens == 8
    assert stats.finished["length"] == 2
    histograms = stats.histograms
    assert histograms["time_to_first_token_seconds"].count == 2
    assert histograms["inter_token_latency_seconds"].count == 8 - 2  # every token but the first
    assert histograms["request_generation_tokens"].total == 8
    assert histograms["request_prompt_tokens"].total == 27
    assert histograms["iteration_tokens_total"].total == 27 + 8 - 2  # the last token is never fed
    for request in requests:
        assert request.scheduled_time is not None and request.first_token_time is not None
        assert request.arrival_time <= request.scheduled_time <= request.first_token_time
        assert request.first_token_time <= request.last_token_time
    e2e = histograms["e2e_request_latency_seconds"]
    assert e2e.count == 2 and e2e.counts[0] == 2  # both within vLLM's first bucket, 0.3 s


def test_each_way_of_ending_is_counted_under_its_reason() -> None:
    scheduler = make_scheduler(64)
    stopped, left, waiting = (make_request(prompt(9, i), max_tokens=50) for i in range(3))
    scheduler.add(stopped)
    scheduler.add(left)
    step(scheduler)
    scheduler.add(waiting)
    scheduler.abort(stopped, "stop")  # a stop string ended it
    scheduler.abort(left)  # its reader let go
    scheduler.abort(waiting, "error")
    scheduler.abort(stopped, "stop")  # once finished, never again
    finished = scheduler.meter.snapshot().finished
    assert finished == {"stop": 1, "length": 0, "abort": 1, "error": 1, "repetition": 0}
    # The one aborted before it was scheduled has waited its whole life, prefilled nothing.
    queue = scheduler.meter.snapshot().histograms["request_queue_time_seconds"]
    assert queue.count == 3


def test_preemptions_are_counted_per_request() -> None:
    scheduler = make_scheduler(6, budget=64)  # 5 usable blocks: the newer one is preempted
    old, new = make_request(prompt(30, 1), 20), make_request(prompt(30, 2), 20)
    scheduler.add(old)
    scheduler.add(new)
    while scheduler.has_work():
        step(scheduler)
    stats = scheduler.meter.snapshot()
    assert stats.preemptions == scheduler.num_preemptions == new.num_preemptions >= 1
    assert stats.histograms["request_num_preemptions"].total == stats.preemptions


def test_a_real_engine_sums_its_replicas_figures() -> None:
    llm = LLM(dtype="float32", replicas=2, kv_cache_memory=16 * 2**20)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outputs = llm.generate(["Hello there", "Once upon a time", "A"], params)
    serving = llm.stats().serving
    assert serving.prompt_tokens == sum(len(o.prompt_token_ids) for o in outputs)
    assert serving.generation_tokens == sum(len(o.token_ids) for o in outputs) == 18
    assert serving.finished["length"] == 3
    parts = [r.scheduler.meter.snapshot() for r in llm.core.replicas]
    assert ServingStats.total(parts).generation_tokens == 18
