from kvgate.engine.core.block_pool import BlockPool
from kvgate.engine.core.request import Request, RequestStatus
from kvgate.engine.core.scheduler import Scheduler
from kvgate.engine.models.packed_linear import trimmed_rows
from tests.engine.scheduling_helpers import (
    make_request,
    make_scheduler,
    scheduled,
    step,
)


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(seed * 131 + i) % 1000 + 10 for i in range(n)]


def test_long_prompts_are_prefilled_in_chunks_within_the_token_budget():
    scheduler = make_scheduler(64, budget=32)
    request = make_request(prompt(100), max_tokens=2)
    scheduler.add(request)
    chunks = [scheduled(step(scheduler))[request.request_id] for _ in range(3)]
    assert chunks == [32, 32, 36]  # the last 36 within 1/8 of the budget: one step, not two
    assert request.output_token_ids == [7]  # sampled only when the last prompt token ran


def test_a_prompt_just_over_the_budget_runs_in_one_step_and_others_wait():
    """A 257-token prompt (256 and a BOS) at a 256-token budget: one step, not a second one
    for a single token; a prompt further over is chunked, and the step stays within 9/8."""
    scheduler = make_scheduler(64, budget=256)
    just_over, far_over = make_request(prompt(257), max_tokens=2), make_request(prompt(300, 1))
    scheduler.add(just_over)
    scheduler.add(far_over)
    first = scheduled(step(scheduler))
    assert first == {just_over.request_id: 257} and just_over.output_token_ids == [7]
    second = scheduled(step(scheduler))
    assert second == {just_over.request_id: 1, far_over.request_id: 255}


def decoding_then_long(scheduler: Scheduler, long_prompt: int) -> tuple[list[Request], Request]:
    """Three requests decoding (their prompts done), then a long prompt arriving."""
    decoders = [make_request(prompt(5, s), max_tokens=50) for s in range(3)]
    for r in decoders:
        scheduler.add(r)
    step(scheduler)
    long = make_request(prompt(long_prompt, 9), max_tokens=1)
    scheduler.add(long)
    return decoders, long


def test_decodes_go_first_and_prefills_take_what_is_left_of_the_budget():
    scheduler = make_scheduler(64, budget=20)
    decoders, long = decoding_then_long(scheduler, 200)
    for _ in range(5):
        batch = scheduled(step(scheduler))
        assert all(batch[r.request_id] == 1 for r in decoders)
        assert batch[long.request_id] == 17


def test_a_waiting_request_is_never_overtaken_so_it_cannot_starve():
    scheduler = make_scheduler(12, budget=64, reserve=0)  # 11 usable blocks
    big = make_request(prompt(150, 1), max_tokens=1)  # needs 10 blocks
    hog = make_request(prompt(40, 2), max_tokens=30)  # running, holds blocks
    scheduler.add(hog)
    step(scheduler)
    scheduler.add(big)
    finished_at = None
    for i in range(80):
        scheduler.add(make_request(prompt(3, 100 + i), max_tokens=2))  # a stream of small ones
        step(scheduler)
        if big.finished:
            finished_at = i
            break
        if big.status is RequestStatus.WAITING:  # nothing that came later runs before it
            assert all(r.arrival < big.arrival for r in scheduler.running)
    assert finished_at is not None


def test_out_of_blocks_preempts_the_newest_request_which_recomputes_later():
    scheduler = make_scheduler(6, budget=64)  # 5 usable blocks
    old = make_request(prompt(30, 1), max_tokens=20)
    new = make_request(prompt(30, 2), max_tokens=20)
    scheduler.add(old)
    scheduler.add(new)
    step(scheduler)  # 2 blocks each
    for _ in range(20):
        step(scheduler)
        if scheduler.num_preemptions:
            break
    assert scheduler.num_preemptions >= 1
    assert old.status is RequestStatus.RUNNING and new.status is RequestStatus.WAITING
    assert new.block_table == [] and new.num_computed == 0
    assert len(new.output_token_ids) > 0  # output kept; recomputed with the prompt later
    while scheduler.has_work():
        step(scheduler)
    assert old.finished and new.finished
    assert len(new.output_token_ids) == 20
    assert scheduler.kv.pool.num_in_use() == 0


def test_admission_keeps_the_free_block_reserve():
    scheduler = make_scheduler(8, reserve=3)  # 7 usable
    first = make_request(prompt(60, 1))  # 4 blocks: leaves 3
    second = make_request(prompt(20, 2))  # 2 more would leave 1 < reserve
    scheduler.add(first)
    scheduler.add(second)
    batch = scheduled(step(scheduler))
    assert first.request_id in batch and second.request_id not in batch
    assert second.status is RequestStatus.WAITING and second.block_table == []


def test_a_fully_cached_prompt_computes_its_last_token_alone():
    pool = BlockPool(32)
    scheduler = make_scheduler(0, pool=pool)
    tokens = prompt(32, 3)
    first = make_request(tokens, max_tokens=1)
    scheduler.add(first)
    step(scheduler)
    assert first.finished and pool.num_cached() == 2
    again = make_request(tokens, max_tokens=1)
    scheduler.add(again)
    batch = scheduled(step(scheduler))
    assert again.cached_tokens == 31 and batch[again.request_id] == 1  # its logits' row
    assert pool.num_cached() == 2  # no block of its own
    longer = make_request(tokens + [5], max_tokens=1)
    scheduler.add(longer)
    batch = scheduled(step(scheduler))
    assert longer.cached_tokens == 32 and batch[longer.request_id] == 1
    assert scheduler.kv.prefix_hits == 63


def test_generated_tokens_fill_blocks_that_later_prompts_reuse():
    pool = BlockPool(32)
    scheduler = make_scheduler(0, pool=pool)
    first = make_request(prompt(10, 4), max_tokens=30)
    scheduler.add(first)
    while scheduler.has_work():
        step(scheduler)
    follow_up = make_request(first.token_ids + [1, 2, 3], max_tokens=1)
    scheduler.add(follow_up)
    step(scheduler)
    assert follow_up.cached_tokens == 32  # 40 tokens computed before: two full blocks


def test_identical_prompts_in_one_step_both_fill_and_the_pool_tolerates_it():
    pool = BlockPool(32)
    scheduler = make_scheduler(0, budget=128, pool=pool)
    a, b = make_request(prompt(40, 5), max_tokens=1), make_request(prompt(40, 5), max_tokens=1)
    scheduler.add(a)
    scheduler.add(b)
    step(scheduler)
    assert a.finished and b.finished and a.cached_tokens == b.cached_tokens == 0
    assert pool.num_cached() == 2 and pool.num_in_use() == 0


def test_abort_frees_blocks_wherever_the_request_is():
    scheduler = make_scheduler(8, budget=16)
    running = make_request(prompt(40, 6), max_tokens=10)
    waiting = make_request(prompt(40, 7), max_tokens=10)
    scheduler.add(running)
    step(scheduler)
    scheduler.add(waiting)
    scheduler.abort(running)
    scheduler.abort(waiting)
    scheduler.abort(running)  # twice is harmless
    assert not scheduler.has_work()
    scheduler.kv.pool.check_invariants()
    assert scheduler.kv.pool.num_in_use() == 0


def test_max_num_seqs_bounds_the_running_set():
    scheduler = make_scheduler(64, max_num_seqs=2)
    requests = [make_request(prompt(4, s), max_tokens=3) for s in range(5)]
    for r in requests:
        scheduler.add(r)
    step(scheduler)
    assert len(scheduler.running) == 2
    while scheduler.has_work():
        step(scheduler)
        assert len(scheduler.running) <= 2
    assert all(r.finished for r in requests)


def test_prefill_steps_are_trimmed_to_the_row_counts_the_matmul_kernels_are_built_for():
    scheduler = make_scheduler(256, budget=1003)
    decoders, long = decoding_then_long(scheduler, 3000)
    first = scheduled(step(scheduler))
    assert all(first[r.request_id] == 1 for r in decoders)  # decodes are never cut
    assert first[long.request_id] == 957 and sum(first.values()) == 960 == trimmed_rows(1003)


def test_a_prompts_last_chunk_is_not_trimmed():
    """Cutting it would put its first token a whole step later."""
    scheduler = make_scheduler(256, budget=2048)
    decoders, long = decoding_then_long(scheduler, 1000)
    first = scheduled(step(scheduler))
    assert first[long.request_id] == 1000 and sum(first.values()) == 1003 != trimmed_rows(1003)
    assert long.output_token_ids == [7]
