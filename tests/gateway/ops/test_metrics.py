"""Metrics render as valid Prometheus text whose series move with what was observed."""

from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, EngineStats, ReplicaStats, SamplingParams
from gateway.ops.metrics import Metrics


def engine_stats(**figures: object) -> EngineStats:
    """An idle engine's figures, with `figures` overriding."""
    idle = EngineStats(
        num_running=0,
        num_waiting=0,
        kv_usage=0.0,
        prefix_queries=0,
        prefix_hits=0,
        num_cached_blocks=0,
        block_size=16,
        num_blocks=512,
        cache_dtype="float8_e4m3fn",
        enable_prefix_caching=True,
    )
    return replace(idle, **figures)


def scrape(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    """Every sample of a render, keyed by sample name and label set."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=")
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def labels(**pairs: str) -> frozenset:
    return frozenset(pairs.items())


def test_observe_counts_requests_by_method_tool_and_outcome() -> None:
    metrics = Metrics()
    metrics.observe("tools/call", "generate", "ok", 0.2)
    metrics.observe("tools/call", "generate", "ok", 0.3)
    metrics.observe("tools/call", "chat", "tool_error", 0.01)
    metrics.observe("tools/list", None, "ok", 0.0004)
    samples = scrape(metrics)

    def requests(method: str, tool: str, outcome: str) -> float:
        return samples[
            "kvgate_requests_total", labels(api="mcp", method=method, tool=tool, outcome=outcome)
        ]

    assert requests("tools/call", "generate", "ok") == 2
    assert requests("tools/call", "chat", "tool_error") == 1
    assert requests("tools/list", "", "ok") == 1


def test_observe_fills_the_latency_histogram_per_method() -> None:
    metrics = Metrics()
    metrics.observe("tools/call", "generate", "ok", 0.2)
    metrics.observe("tools/call", "generate", "ok", 3.0)
    metrics.observe("tools/list", None, "ok", 0.0004)
    samples = scrape(metrics)
    name = "kvgate_request_duration_seconds"
    call = {"method": "tools/call"}
    assert samples[f"{name}_count", labels(**call)] == 2
    assert samples[f"{name}_sum", labels(**call)] == pytest.approx(3.2)
    assert samples[f"{name}_bucket", labels(**call, le="0.25")] == 1
    assert samples[f"{name}_bucket", labels(**call, le="5.0")] == 2
    assert samples[f"{name}_bucket", labels(method="tools/list", le="0.0005")] == 1


def test_count_creates_and_increments_misc_counters() -> None:
    metrics = Metrics()
    metrics.count("kvgate_discovery_cache_fallbacks_total")
    metrics.count("kvgate_rejected_requests_total", reason="header_mismatch")
    metrics.count("kvgate_rejected_requests_total", reason="header_mismatch")
    metrics.count("kvgate_rejected_requests_total", reason="body_too_large")
    samples = scrape(metrics)
    assert samples["kvgate_discovery_cache_fallbacks_total", labels()] == 1
    assert samples["kvgate_rejected_requests_total", labels(reason="header_mismatch")] == 2
    assert samples["kvgate_rejected_requests_total", labels(reason="body_too_large")] == 1


def test_count_refuses_a_changed_label_set() -> None:
    metrics = Metrics()
    metrics.count("kvgate_rejected_requests_total", reason="origin")
    with pytest.raises(ValueError, match="labels"):
        metrics.count("kvgate_rejected_requests_total", cause="origin")


def test_engine_figures_are_read_at_scrape_time_under_vllm_names() -> None:
    stats = engine_stats(
        num_running=3, num_waiting=2, kv_usage=0.25, prefix_queries=100, prefix_hits=40
    )
    metrics = Metrics(lambda: stats, model_name="tiny")
    model = labels(model_name="tiny", engine="0")
    samples = scrape(metrics)
    assert samples["vllm:num_requests_running", model] == 3
    assert samples["vllm:num_requests_waiting", model] == 2
    assert samples["vllm:kv_cache_usage_perc", model] == 0.25
    assert samples["vllm:prefix_cache_queries_total", model] == 100
    assert samples["vllm:prefix_cache_hits_total", model] == 40

    stats = replace(stats, num_running=0, kv_usage=0.0, prefix_hits=90)
    samples = scrape(metrics)
    assert samples["vllm:num_requests_running", model] == 0
    assert samples["vllm:kv_cache_usage_perc", model] == 0.0
    assert samples["vllm:prefix_cache_hits_total", model] == 90


def test_cache_config_info_carries_the_cache_layout() -> None:
    metrics = Metrics(
        lambda: engine_stats(block_size=32, num_blocks=1024, cache_dtype="bfloat16"), "m"
    )
    config = labels(
        block_size="32",
        num_gpu_blocks="1024",
        cache_dtype="bfloat16",
        enable_prefix_caching="True",
        engine="0",
    )
    assert scrape(metrics)["vllm:cache_config_info", config] == 1


def test_per_replica_figures_get_a_replica_label() -> None:
    replicas = [ReplicaStats(1, 0, 0.5, 10, 5), ReplicaStats(2, 4, 0.75, 30, 0)]
    metrics = Metrics(lambda: engine_stats(num_running=3, num_waiting=4, per_replica=replicas), "m")
    samples = scrape(metrics)
    for index, replica in enumerate(replicas):
        at = labels(model_name="m", replica=str(index))
        assert samples["kvgate_replica_num_requests_running", at] == replica.num_running
        assert samples["kvgate_replica_num_requests_waiting", at] == replica.num_waiting
        assert samples["kvgate_replica_kv_cache_usage_perc", at] == replica.kv_usage
        assert samples["kvgate_replica_prefix_cache_queries_total", at] == replica.prefix_queries
        assert samples["kvgate_replica_prefix_cache_hits_total", at] == replica.prefix_hits
    assert samples["vllm:num_requests_running", labels(model_name="m", engine="0")] == 3


def test_apps_keep_private_registries() -> None:
    first, second = Metrics(), Metrics()
    first.observe("server/discover", None, "ok", 0.001)
    first.count("kvgate_discovery_cache_fallbacks_total")
    second.count("kvgate_discovery_cache_fallbacks_total")
    key = (
        "kvgate_requests_total",
        labels(api="mcp", method="server/discover", tool="", outcome="ok"),
    )
    assert scrape(first)[key] == 1
    assert key not in scrape(second)
    assert scrape(second)["kvgate_discovery_cache_fallbacks_total", labels()] == 1


def test_no_engine_means_no_engine_series() -> None:
    assert not any(name.startswith("vllm:") for name, _ in scrape(Metrics()))


def test_a_real_engine_reports_its_prefix_cache_and_layout() -> None:
    llm = LLM(dtype="float32", replicas=2, kv_cache_memory=16 * 2**20)
    metrics = Metrics(llm.stats, model_name="tiny")
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # several 16-token blocks
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))
    llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0))
    stats, samples = llm.stats(), scrape(metrics)
    model = labels(model_name="tiny", engine="0")
    assert samples["vllm:prefix_cache_queries_total", model] == stats.prefix_queries > 0
    assert 0 < samples["vllm:prefix_cache_hits_total", model] == stats.prefix_hits
    assert samples["vllm:num_requests_running", model] == 0
    config = labels(
        block_size=str(stats.block_size),
        num_gpu_blocks=str(stats.num_blocks),
        cache_dtype="float32",
        enable_prefix_caching="True",
        engine="0",
    )
    assert samples["vllm:cache_config_info", config] == 1
    replicas = [labels(model_name="tiny", replica=str(i)) for i in range(2)]
    hits = [samples["kvgate_replica_prefix_cache_hits_total", at] for at in replicas]
    assert sum(hits) == stats.prefix_hits


def test_gauge_is_read_at_scrape_time() -> None:
    metrics = Metrics()
    state = {"degraded": False}
    metrics.gauge(
        "kvgate_discovery_cache_degraded",
        "1 while Redis is unreachable.",
        lambda: float(state["degraded"]),
    )
    assert "kvgate_discovery_cache_degraded 0.0" in metrics.render()[0].decode()
    state["degraded"] = True
    assert "kvgate_discovery_cache_degraded 1.0" in metrics.render()[0].decode()
