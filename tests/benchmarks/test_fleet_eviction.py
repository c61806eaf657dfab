"""The eviction benchmark's trace: every router gets the same conversations, starts and
pauses, with agents as unequally popular as asked."""

from __future__ import annotations

import argparse

from benchmarks.fleet_eviction import group_sizes, pauses, starts, trace


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
