"""benchmarks.hostile's tools case builds what it claims: 128 distinct tools in ~1 MiB,
70k distinct choices, and reads the grammar cache's figures off /metrics; its upstream case,
one second per attack, meets its targets."""

from __future__ import annotations

import argparse

import orjson

from benchmarks.hostile import upstream_case
from benchmarks.hostile_tools import choice_body, grammar_figures, tool_body


def test_a_tool_body_is_128_distinct_tools_just_under_the_size() -> None:
    size = 1000 * 1024
    first, second = orjson.loads(tool_body(0, 128, size)), orjson.loads(tool_body(1, 128, size))
    assert 0.85 * size < len(tool_body(0, 128, size)) <= size
    assert len(first["tools"]) == 128
    assert (
        first["tools"][0]["function"]["parameters"] != second["tools"][0]["function"]["parameters"]
    )


def test_a_choice_body_lists_distinct_entries() -> None:
    listed = orjson.loads(choice_body(3, 70_000))["structured_outputs"]["choice"]
    assert len(set(listed)) == 70_000
    assert listed[0] not in orjson.loads(choice_body(4, 10))["structured_outputs"]["choice"]


def test_grammar_figures_are_read_from_metrics() -> None:
    text = (
        "# HELP kvgate_grammar_cache_bytes x\nkvgate_grammar_cache_bytes 3145728.0\n"
        "kvgate_grammar_cache_limit_bytes 2.68435456e+08\nkvgate_grammar_cache_entries 2.0\n"
        "kvgate_max_grammar_bytes 131072.0\n"
    )
    figures = grammar_figures(text)
    assert figures == {
        "source": "metrics",
        "resident_mib": 3.0,
        "limit_mib": 256.0,
        "bytes": 3145728,
        "limit_bytes": 268435456,
        "entries": 2,
        "spec_limit_bytes": 131072,
    }
    assert grammar_figures("kvgate_grammar_cache_limit_bytes 0.0\n") is None


def test_a_fleet_gateway_under_its_upstreams_attacks_keeps_memory_and_healthz() -> None:
    """A header line that never ends, endless two-byte SSE comments and one SSE line that
    never ends, each for a second from two callers: RSS at most 16 MiB above idle and
    /healthz p99 under 50 ms (``benchmarks.hostile --cases upstream`` runs them longer)."""
    attacks = "endless-header,endless-comments,endless-line"
    args = argparse.Namespace(upstream_attacks=attacks, attack_s=1.0, probe_ms=10)
    figures = upstream_case(args)
    assert list(figures) == attacks.split(",")
    for attack, result in figures.items():
        assert sum(result["calls"].values()) > 10, (attack, result)
        assert all(result["targets_met"].values()), (attack, result)
