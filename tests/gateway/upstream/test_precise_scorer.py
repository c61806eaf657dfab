"""The precise scorer's decisions, from what each upstream holds of a call and their loads: no
processes, no events. Costs are prompt tokens: a shared prompt held everywhere does not
decide; a conversation's history keeps it where it is unless that upstream is over the
load bound or so pressed that the history will likely be evicted before it is read again;
crowding moves new conversations."""

from __future__ import annotations

import pytest

from kvgate.gateway.upstream.precise import (
    DEMAND_HALF_LIFE_S,
    DEMAND_PRIOR_CALLS,
    Demand,
    Holding,
    best,
    cost,
    load_bound,
)
from kvgate.gateway.upstream.routing import Load

ALL = [True, True, True]
CALL = 150.0  # the average call's tokens


def idle(*in_flight: int) -> list[Load]:
    return [Load(n) for n in in_flight]


def held(*cached_tokens: int, odds: tuple[float, ...] = (0.0, 0.0, 0.0)) -> list[Holding]:
    return [Holding(c, o) for c, o in zip(cached_tokens, odds, strict=True)]


def test_the_cost_counts_uncached_tokens_risk_and_queue() -> None:
    # half of each queued request's prefill is still to compute, on average
    assert cost(1000, Holding(600, 0.5), 2, CALL) == 400 + 500 + 150


def test_a_shared_prompt_held_everywhere_leaves_the_choice_to_load() -> None:
    assert best(1000, held(600, 600, 600), idle(3, 1, 2), ALL, CALL) == 1


def test_the_conversation_stays_where_its_history_is_though_busier() -> None:
    # 600 tokens of shared prompt everywhere; upstream 2 also holds the history.
    assert best(1000, held(600, 600, 960), idle(1, 1, 3), ALL, CALL) == 2


def test_an_upstream_at_the_load_bound_takes_no_more() -> None:
    loads = idle(1, 2, 11)
    assert load_bound(loads, ALL) == 10  # ceil(2 × 15 / 3)
    assert best(1000, held(600, 600, 960), loads, ALL, CALL) == 0


def test_an_idle_fleet_keeps_a_call_with_its_blocks() -> None:
    loads = idle(0, 0, 2)
    assert load_bound(loads, ALL) == 4  # the floor, not ceil(1.25 × 3 / 3)
    assert best(1000, held(0, 0, 960), loads, ALL, CALL) == 2


def test_scraped_requests_count_when_larger_than_this_gateways() -> None:
    loads = [Load(0, waiting=6, running=6), Load(0), Load(0)]
    assert best(1000, held(960, 0, 0), loads, ALL, CALL) == 1


def test_a_full_kv_cache_takes_a_call_only_when_every_one_is_full() -> None:
    loads = [Load(1, kv_usage=1.0), Load(1, kv_usage=0.5), Load(1, kv_usage=0.5)]
    assert best(1000, held(960, 0, 0), loads, ALL, CALL) == 1
    full = [Load(1, kv_usage=1.0)] * 3
    assert best(1000, held(960, 0, 0), full, ALL, CALL) == 0


def test_unavailable_upstreams_are_not_chosen() -> None:
    available = [False, True, True]
    assert best(1000, held(960, 500, 500), idle(0, 2, 1), available, CALL) == 2
    assert best(1000, held(960, 500, 500), idle(0, 0, 0), available, CALL) == 1  # tie


def test_a_new_conversation_leaves_a_thrashing_upstream_holding_its_prompt() -> None:
    # Upstream 0 holds the popular agent's 600-token prompt but evicts as fast as it stores;
    # the others keep what they hold.
    odds = (1.0, 0.1, 0.1)
    assert best(900, held(600, 0, 0, odds=odds), idle(1, 1, 1), ALL, CALL) == 1
    # Where it keeps its blocks, the prompt wins.
    calm = (0.1, 0.1, 0.1)
    assert best(900, held(600, 0, 0, odds=calm), idle(1, 1, 1), ALL, CALL) == 0


def test_a_conversation_stays_on_a_moderately_pressed_upstream_holding_its_history() -> None:
    # Recomputing 1,000 tokens elsewhere costs more than a 0.3 chance of losing them.
    odds = (0.3, 0.0, 0.0)
    assert best(1100, held(1000, 0, 0, odds=odds), idle(1, 1, 1), ALL, CALL) == 0


def test_a_burst_sharing_a_prefix_spreads_over_the_upstreams() -> None:
    in_flight = [0, 0, 0]
    for _ in range(30):
        cached = [600 if n else 0 for n in in_flight]  # speculative where calls went
        cached[0] = 600  # the prompt's first call went to upstream 0
        pick = best(1000, held(*cached), idle(*in_flight), ALL, CALL)
        in_flight[pick] += 1
    assert max(in_flight) - min(in_flight) <= 2, in_flight


def test_demand_is_the_share_over_a_fair_one_and_fades() -> None:
    demand = Demand()
    urls = ["a", "b", "c"]
    for _ in range(50):
        demand.add("a", 200, 0.0)
        demand.add("b", 100, 0.0)
    # a: 10,000 and b: 5,000 sent in 100 calls of 150 tokens; each counts 4 calls more.
    prior = DEMAND_PRIOR_CALLS * 150
    fair = (15_000 + 3 * prior) / 3
    assert demand.crowding(urls, ALL, 0.0) == pytest.approx([(10_000 + prior) / fair - 1, 0, 0])
    # An unavailable upstream's tokens leave the share: a and b split theirs between two.
    pair = (15_000 + 2 * prior) / 2
    assert demand.crowding(urls, [True, True, False], 0.0) == pytest.approx(
        [(10_000 + prior) / pair - 1, 0, 0]
    )
    later = 20 * DEMAND_HALF_LIFE_S  # both fade alike, below a token: forgotten
    assert demand.crowding(urls, ALL, later) == [0.0, 0.0, 0.0]
    demand.add("c", 10, later)
    assert demand.crowding(urls, ALL, later)[2] > 0


def test_the_first_calls_crowd_no_upstream() -> None:
    demand = Demand()
    demand.add("a", 500, 0.0)  # the only call yet: all of the tokens sent
    assert max(demand.crowding(["a", "b", "c"], ALL, 0.0)) < 0.2


def test_a_new_conversation_of_a_popular_agent_leaves_its_crowded_upstream() -> None:
    # Upstream 0 holds the agent's 600-token prompt, upstream 1 a copy, and 0 was sent 1.3
    # times its share: the new conversation goes to the copy, at no queue on either.
    crowding = [0.3, 0.0, 0.0]
    assert best(900, held(600, 600, 0), idle(0, 0, 0), ALL, CALL, crowding) == 1
    assert best(900, held(600, 600, 0), idle(0, 0, 0), ALL, CALL) == 0  # uncrowded: a tie
    # A little more crowded, it brings the agent's prompt to an upstream that holds nothing:
    # at a quarter over a fair share, where its own part is as long as the prompt.
    assert best(1200, held(600, 0, 0), idle(0, 0, 0), ALL, CALL, [0.24, 0, 0]) == 0
    assert best(1200, held(600, 0, 0), idle(0, 0, 0), ALL, CALL, [0.26, 0, 0]) == 1


def test_a_conversation_whose_history_is_held_stays_where_it_is_crowded() -> None:
    # Crowding weighs what a call would bring anew: 100 tokens where its history is, 500
    # where only the agent's prompt is. Moving would recompute that history now, so it
    # stays up to about twice a fair share.
    assert best(1100, held(1000, 600, 0), idle(0, 0, 0), ALL, CALL, [0.9, 0, 0]) == 0
    assert best(1100, held(1000, 600, 0), idle(0, 0, 0), ALL, CALL, [1.1, 0, 0]) == 1
