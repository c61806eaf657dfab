"""The precise scorer's decisions, from the shares of a call's blocks each upstream holds and
their loads: no processes, no events. A shared prompt held everywhere does not decide; the
blocks only one upstream holds keep a conversation there unless it is over the load bound."""

from __future__ import annotations

from kvgate.gateway.upstream.precise import best, load_bound
from kvgate.gateway.upstream.routing import Load

ALL = [True, True, True]


def idle(*in_flight: int) -> list[Load]:
    return [Load(n) for n in in_flight]


def test_a_shared_prompt_held_everywhere_leaves_the_choice_to_load() -> None:
    shares = [0.6, 0.6, 0.6]
    assert best(shares, idle(3, 1, 2), ALL) == 1


def test_the_conversation_stays_where_its_own_blocks_are_though_busier() -> None:
    # 0.6 of the call is the shared prompt (everywhere); upstream 2 also holds the
    # conversation's history: all the distinguishing blocks.
    shares = [0.6, 0.6, 1.0]
    assert best(shares, idle(3, 3, 4), ALL) == 2


def test_an_upstream_at_the_load_bound_takes_no_more() -> None:
    loads = idle(2, 3, 9)
    assert load_bound(loads, ALL) == 7  # ceil(1.25 × 15 / 3)
    assert best([0.6, 0.6, 1.0], loads, ALL) == 0


def test_an_idle_fleet_keeps_a_call_with_its_blocks() -> None:
    loads = idle(0, 0, 2)
    assert load_bound(loads, ALL) == 4  # the floor, not ceil(1.25 × 3 / 3)
    assert best([0.0, 0.0, 1.0], loads, ALL) == 2


def test_scraped_requests_count_when_larger_than_this_gateways() -> None:
    loads = [Load(0, waiting=6, running=6), Load(0), Load(0)]
    assert best([1.0, 0.0, 0.0], loads, ALL) == 1


def test_a_full_kv_cache_weighs_against_an_upstream() -> None:
    loads = [Load(1, kv_usage=1.0), Load(1, kv_usage=0.0), Load(1, kv_usage=0.0)]
    assert best([0.8, 0.0, 0.0], loads, ALL) == 0  # 2.4 of prefix outweighs 2.0 of KV
    assert best([0.5, 0.0, 0.0], loads, ALL) == 1


def test_unavailable_upstreams_are_neither_chosen_nor_common() -> None:
    available = [False, True, True]
    # The unavailable one holds nothing: the others' shared share still does not decide.
    assert best([0.0, 0.5, 0.5], idle(0, 2, 1), available) == 2
    assert best([1.0, 0.5, 0.5], idle(0, 0, 0), available) == 1  # tie: the lowest index


def test_a_burst_sharing_a_prefix_spreads_over_the_upstreams() -> None:
    in_flight = [0, 0, 0]
    for _ in range(30):
        shares = [0.6 if n else 0.0 for n in in_flight]  # speculative where calls went
        shares[0] = 0.6  # the prompt's first call went to upstream 0
        pick = best(shares, idle(*in_flight), ALL)
        in_flight[pick] += 1
    assert max(in_flight) - min(in_flight) <= 2, in_flight
