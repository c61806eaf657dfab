"""PrefixRouter: deterministic across processes, sticky, bounded, minimally disruptive."""

import json
import math
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

import kvgate.engine.core.router as router_module
from kvgate.engine.core.block_hash import block_hashes, root_hash
from kvgate.engine.core.router import PrefixRouter, make_router
from kvgate.engine.errors import EngineUnavailable

REPO = Path(__file__).resolve().parents[3]


ROOT = root_hash("router-test-model", "float32")


def chained_hashes(tokens: list[int]) -> list[bytes]:
    """The prompt's full-block hashes, as the pool computes them."""
    return block_hashes(tokens, ROOT)


def prompt(seed: int, num_tokens: int) -> list[int]:
    return random.Random(seed).choices(range(32000), k=num_tokens)


def idle(n: int) -> tuple[list[int], list[bool]]:
    return [0] * n, [True] * n


# Run in fresh processes with different PYTHONHASHSEEDs: 300 router calls over random
# prompts, keys, loads and dead replicas, then the engine placing 16 prompts on 4 replicas.
DETERMINISM_SCRIPT = """
import json, random, sys
sys.path[:0] = [{repo!r}, {tests!r}]
from test_router import chained_hashes, prompt
from kvgate.engine import LLM, SamplingParams
from kvgate.engine.core.router import PrefixRouter
router, rng, choices = PrefixRouter(4), random.Random(7), []
for i in range(300):
    tokens = prompt(i % 40, rng.randrange(0, 300))
    key = f"conv-{{i % 13}}" if i % 3 == 0 else None
    loads = [rng.randrange(0, 6) for _ in range(4)]
    available = [rng.random() > 0.2 for _ in range(4)]
    available[i % 4] = True
    choices.append(router.choose(chained_hashes(tokens), key, len(tokens), loads, available))
llm = LLM(replicas=4, kv_cache_memory="8MiB")
shared = rng.choices(range(4, 260), k=160)
prompts = [rng.choices(range(4, 260), k=rng.randrange(1, 200)) for _ in range(12)]
prompts += [shared + rng.choices(range(4, 260), k=20) for _ in range(4)]
outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
print(json.dumps({{"router": choices, "engine": [out.replica for out in outs]}}))
"""


def run_in_process(hash_seed: str) -> dict[str, list[int]]:
    script = DETERMINISM_SCRIPT.format(repo=str(REPO), tests=str(Path(__file__).parent))
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def test_choices_identical_across_processes_with_different_hash_seeds():
    first, second = run_in_process("1"), run_in_process("2024")
    assert len(first["router"]) == 300 and len(first["engine"]) == 16
    assert first == second
    assert set(first["router"]) == {0, 1, 2, 3}  # the trace exercises every replica
    assert len(set(first["engine"])) > 1


def test_same_cache_key_sticks_to_one_replica_while_under_bound():
    router = PrefixRouter(4)
    loads, available = [3, 3, 3, 3], [True] * 4
    picks = {
        router.choose(chained_hashes(prompt(i, 200)), "tenant-a", 200, loads, available)
        for i in range(20)
    }
    assert len(picks) == 1


def test_prompts_sharing_first_eight_blocks_land_together():
    router = PrefixRouter(4)
    shared = prompt(1, 8 * 16)
    loads, available = idle(4)
    picks = {
        router.choose(chained_hashes(shared + prompt(100 + i, 64)), None, 192, loads, available)
        for i in range(20)
    }
    assert len(picks) == 1


def test_keys_spread_evenly_over_replicas():
    router = PrefixRouter(4)
    loads, available = idle(4)
    counts = Counter(router.choose([], f"k{i}", 0, loads, available) for i in range(4000))
    assert all(700 <= counts[r] <= 1300 for r in range(4)), counts


@pytest.mark.parametrize("num_keys", [1, 3])
def test_load_bound_holds_under_skewed_keys(num_keys: int):
    router = PrefixRouter(3, load_factor=1.25)
    loads, available = [0, 0, 0], [True] * 3
    rng = random.Random(num_keys)
    for _ in range(600):
        key = f"hot-{min(int(rng.expovariate(1.0)), num_keys - 1)}"
        r = router.choose([], key, 0, loads, available)
        bound = math.ceil(1.25 * (sum(loads) + 1) / 3)
        loads[r] += 1
        assert loads[r] <= bound
    assert max(loads) <= math.ceil(1.25 * sum(loads) / 3)


def test_only_keys_of_an_unavailable_replica_move():
    router = PrefixRouter(4)
    loads, _ = idle(4)
    keys = [f"conv-{i}" for i in range(1000)]
    before = {k: router.choose([], k, 0, loads, [True] * 4) for k in keys}
    after = {k: router.choose([], k, 0, loads, [True, True, False, True]) for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == 2}
    assert 2 not in after.values()
    assert len(set(after[k] for k in moved)) == 3  # the orphans spread over the survivors


def test_longest_prefix_being_prefilled_wins():
    router = PrefixRouter(4)
    hashes = chained_hashes(prompt(5, 160))
    hashed = router.choose(hashes, None, 160, *idle(4))
    short_owner, long_owner = (hashed + 1) % 4, (hashed + 2) % 4
    router.prefilling = {hashes[1]: short_owner, hashes[6]: long_owner}
    assert router.choose(hashes, None, 160, *idle(4)) == long_owner


def test_prefilling_replica_over_bound_falls_back_to_hashing():
    router = PrefixRouter(2)
    hashes = chained_hashes(prompt(6, 160))
    hashed = router.choose(hashes, None, 160, [0, 0], [True, True])
    other = 1 - hashed
    router.prefilling = {hashes[3]: other}
    loads = [0, 0]
    loads[hashed], loads[other] = 2, 6  # bound = ceil(1.25 * 9 / 2) = 6: other is full
    assert router.choose(hashes, None, 160, loads, [True, True]) == hashed
    loads[hashed], loads[other] = 4, 4  # same bound, other has room
    assert router.choose(hashes, None, 160, loads, [True, True]) == other
    assert router.choose(hashes, None, 160, loads, [hashed == 0, hashed == 1]) == hashed


def test_short_prompt_without_key_goes_to_least_loaded_live_replica():
    router = PrefixRouter(4)
    short = chained_hashes(prompt(7, 15))
    assert short == []
    assert router.choose(short, None, 15, [3, 1, 1, 2], [True] * 4) == 1
    assert router.choose(short, None, 15, [3, 1, 1, 2], [True, False, True, True]) == 2


def test_short_prompt_with_cache_key_is_hashed():
    router = PrefixRouter(4)
    picks = {
        router.choose([], "tenant-b", 3, loads, [True] * 4)
        for loads in ([0, 0, 0, 0], [1, 1, 1, 1], [2, 2, 2, 2])
    }
    assert len(picks) == 1


def test_no_live_replica_raises():
    router = PrefixRouter(2)
    with pytest.raises(EngineUnavailable):
        router.choose([], None, 0, [0, 0], [False, False])


def test_mismatched_lengths_rejected():
    with pytest.raises(ValueError, match="loads and available"):
        PrefixRouter(3).choose([], None, 0, [0, 0], [True, True])


def test_round_robin_baseline_cycles_over_live_replicas():
    router = make_router("round_robin", 3)
    picks = [router.choose([], None, 0, [0, 0, 0], [True, False, True]) for _ in range(4)]
    assert picks == [0, 2, 0, 2]


def test_random_baseline_is_seeded_and_skips_dead_replicas():
    def picks(seed: int) -> list[int]:
        router = make_router("random", 3, seed)
        return [router.choose([], None, 0, [0, 0, 0], [True, False, True]) for _ in range(50)]

    assert picks(3) == picks(3)
    assert set(picks(3)) == {0, 2}


def test_unknown_policy_rejected():
    assert make_router("prefix", 2, load_factor=1.1).load_factor == 1.1
    with pytest.raises(ValueError, match="routing"):
        make_router("least_recent", 2)


def test_the_memoised_ring_order_is_the_walks_and_stays_bounded(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(router_module, "MAX_ORDERS", 4)
    names = [f"http://10.0.0.{i}:8000".encode() for i in range(5)]
    memoised, fresh = PrefixRouter(5, names=names), PrefixRouter(5, names=names)
    for i in range(10):
        key = f"cache_key:session-{i}".encode()
        order = memoised.preference(key)
        assert order == memoised.preference(key)  # the memo answers the same
        assert sorted(order) == list(range(5))  # every replica once
        fresh._orders.clear()
        assert order == fresh.preference(key)  # as a walk from scratch gives it
        assert len(memoised._orders) <= 4
