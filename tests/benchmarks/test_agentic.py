"""The agentic benchmark measures what it says: repeated work, load spread, and a real run."""

import asyncio

import pytest

from benchmarks.agentic import (
    Run,
    Turn,
    in_flight,
    load_cov,
    make_trace,
    parse_args,
    repeated_tokens,
    run_trace,
    work,
)
from kvgate.engine.core.block_hash import BLOCK_SIZE


def turn(prompt: list[int], output: list[int], submitted: float, replica: int = 0) -> Turn:
    return Turn(0, 0, prompt, output, 0, replica, submitted, submitted, submitted + 1.0)


def test_repeated_tokens_counts_full_blocks_an_earlier_request_computed():
    system = list(range(100, 132))  # two full blocks
    a0 = system + list(range(200, 210))  # 42 tokens
    a0_out = list(range(300, 307))  # 42 + 6 fed back = 48: three blocks computed
    b0 = system + list(range(400, 420))
    a1 = a0 + a0_out + list(range(500, 520))
    turns = [turn(a0, a0_out, 0.0), turn(b0, [1, 2], 1.0), turn(a1, [3], 2.0)]
    assert repeated_tokens(turns) == 0 + 32 + 48
    # The same turns listed out of order: submission time decides what came first.
    assert repeated_tokens(turns[::-1]) == 80


def test_a_fully_repeated_prompt_still_recomputes_its_last_token():
    prompt = list(range(10, 10 + 2 * BLOCK_SIZE))
    assert repeated_tokens([turn(prompt, [1, 2], 0.0), turn(prompt, [1], 1.0)]) == 31


def test_load_cov_over_replicas_of_work_and_time_in_flight():
    turns = [turn([1] * 40, [1], 0.0, replica=0), turn([1] * 10, [1], 0.0, replica=1)]
    turns += [turn([1] * 10, [1], 0.5, replica=1), turn([1] * 7, [1, 1, 1], 2.0, replica=1)]
    turns[0].cached_tokens = 9
    assert load_cov(turns, 2, work) == pytest.approx(0.0)  # 32 tokens computed on each
    assert load_cov(turns, 2, in_flight) == pytest.approx(0.5)  # busy 1 s vs 3 s


def test_trace_is_seeded_and_within_bounds():
    args = parse_args(["--sessions", "3", "--turns", "4", "--turn-tokens", "5", "9"])
    system, turns = make_trace(args)
    assert (system, turns) == make_trace(args)
    assert len(system) == 2048 and len(turns) == 3 and all(len(s) == 4 for s in turns)
    assert all(5 <= len(added) <= 9 for session in turns for added in session)


@pytest.mark.parametrize("caching", [True, False])
def test_a_small_run_on_the_engine_grows_histories_and_reports_hits(caching: bool):
    argv = "--sessions 2 --turns 2 --system-tokens 48 --turn-tokens 8 24 --output-tokens 3"
    args = parse_args(argv.split())
    trace = make_trace(args)
    turns, _ = asyncio.run(run_trace(args, Run("prefix", "prefix", caching=caching), trace))
    by_turn = {(t.session, t.turn): t for t in turns}
    assert sorted(by_turn) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for session in (0, 1):
        first, second = by_turn[session, 0], by_turn[session, 1]
        assert len(first.output) == 3
        assert second.prompt == first.prompt + first.output + trace[1][session][1]
    cached = sum(t.cached_tokens for t in turns)
    if caching:
        assert 0 < cached <= repeated_tokens(turns)
    else:
        assert cached == 0
