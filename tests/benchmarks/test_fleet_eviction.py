"""The eviction benchmark's trace: every router gets the same conversations, starts and
pauses, with agents as unequally popular as asked; a router's runs sum up as medians."""

from __future__ import annotations

import argparse

from benchmarks.fleet_eviction import Result, group_sizes, median_result, pauses, starts, trace


def options(**changes: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "seed": 0,
        "groups": 3,
        "turns": 3,
        "shared_words": 20,
        "context_words": 10,
        "turn_words": (3, 6),
        "group_skew": 0.0,
        "arrival_s": 0.0,
        "think_s": 0.0,
    }
    args = argparse.Namespace(**(base | changes))
    args.sessions = 12  # conversations
    return args


def test_group_sizes_follow_the_skew_and_sum_to_the_sessions() -> None:
    assert group_sizes(12, 3, 0.0) == [4, 4, 4]
    sizes = group_sizes(48, 6, 1.0)
    assert sum(sizes) == 48
    assert sizes == sorted(sizes, reverse=True)
    assert sizes[0] == 20  # 48 × 1 / (1 + 1/2 + ... + 1/6), rounded


def test_every_router_gets_the_same_trace_but_its_own_first_words() -> None:
    args = options(group_skew=1.0)
    mine, theirs = trace(args, "a"), trace(args, "b")
    assert [len(c) for c in mine] == [3] * 12
    assert [p.replace("(a)", "(b)") for c in mine for p in c] == [p for c in theirs for p in c]
    agents = [c[0].split(" ", 2)[1] for c in mine]
    assert sorted(agents.count(str(g)) for g in range(3)) == sorted(group_sizes(12, 3, 1.0))


def test_starts_and_pauses_are_seeded_and_bounded() -> None:
    assert starts(options()) == [0.0] * 12
    spread = starts(options(arrival_s=30.0))
    assert spread == starts(options(arrival_s=30.0))
    assert spread[0] == 0.0 and spread[-1] == 30.0 and spread == sorted(spread)
    assert pauses(options()) == [[0.0, 0.0]] * 12
    thinking = pauses(options(think_s=2.0))
    assert thinking == pauses(options(think_s=2.0))
    assert all(len(p) == 2 and min(p) > 0 for p in thinking)


def test_a_routers_runs_sum_up_as_their_medians() -> None:
    def run(router: str, n: int, computed: float, ttft_s: float, cov: float) -> Result:
        return Result(router, computed, 0.5, [ttft_s] * 10, cov, 1.0, "", "", f"{router} #{n}")

    results = [
        run("a", 1, 100, 0.1, 0.5),
        run("b", 1, 1, 9.0, 0.0),
        run("a", 2, 300, 0.3, 0.1),
        run("a", 3, 200, 0.9, 0.2),
    ]
    summary = median_result("a", results)
    assert (summary.computed, summary.ttft_p90, summary.load_cov) == (200, 0.3, 0.2)
