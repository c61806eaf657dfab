"""Metrics render as valid Prometheus text whose series move with what was observed; a live
server serves vLLM 0.32's metric set (as a real vLLM served it: data/vllm_0_32_metrics.txt)."""

import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.engine import LLM, AsyncLLM, EngineStats, ReplicaStats, SamplingParams
from kvgate.engine.core.serving_stats import request_tokens_buckets
from kvgate.gateway.ops.metrics import Metrics
from tests.gateway.live_server import LiveServer


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


def test_speculative_decoding_counts_drafts_under_vllms_spec_decode_names() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    llm = LLM(dtype="float32", kv_cache_memory=16 * 2**20, speculative_config=spec)
    metrics = Metrics(llm.stats, model_name="tiny")
    llm.generate([[5, 6, 7, 8, 9] * 6], SamplingParams(max_tokens=30, temperature=0))
    figures, samples = llm.stats().serving.spec, scrape(metrics)
    model = labels(model_name="tiny", engine="0")
    assert samples["vllm:spec_decode_num_drafts_total", model] == figures.drafts > 0
    assert samples["vllm:spec_decode_num_draft_tokens_total", model] == figures.draft_tokens
    accepted = samples["vllm:spec_decode_num_accepted_tokens_total", model]
    assert 0 < accepted == figures.accepted_tokens
    per_position = [
        samples[
            "vllm:spec_decode_num_accepted_tokens_per_pos_total", model | {("position", str(i))}
        ]
        for i in range(3)
    ]
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)
    plain = scrape(Metrics(LLM(dtype="float32", kv_cache_memory=2**22).stats, model_name="tiny"))
    assert not any(name.startswith("vllm:spec_decode") for name, _ in plain)


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


# -- vLLM 0.32's metric set, against a live server -----------------------------------------

CAPTURED = Path(__file__).parent / "data" / "vllm_0_32_metrics.txt"

# vLLM families kvgate leaves out, and why.
OMITTED = {
    "vllm:estimated_flops_per_gpu_total": "MFU estimates (vLLM's --enable-mfu-metrics): "
    "kvgate has no FLOP model; vLLM itself reports 0 unless asked",
    "vllm:estimated_read_bytes_per_gpu_total": "MFU estimates, as above",
    "vllm:estimated_write_bytes_per_gpu_total": "MFU estimates, as above",
    "vllm:engine_sleep_state": "kvgate has no sleep mode (vLLM's /sleep, /wake_up)",
    "vllm:external_prefix_cache_queries_total": "no KV connector: no cache shared between "
    "instances",
    "vllm:external_prefix_cache_hits_total": "no KV connector, as above",
    "vllm:mm_cache_queries_total": "no multimodal inputs, so no multimodal cache",
    "vllm:mm_cache_hits_total": "no multimodal inputs, as above",
}
# Families kvgate exports with fewer labels than vLLM, and why.
FEWER_LABELS = {
    "vllm:cache_config_info": "vLLM's labels are its CacheConfig's fields (36 in 0.32, most "
    "about GPU memory, Mamba state and offloading); kvgate's are those that describe its cache",
}
# Families exported only in some configurations, as vLLM exports them, tested on their own.
CONDITIONAL = {"vllm:lora_requests_info": "only with LoRA enabled"}
VLLM_MAX_MODEL_LEN = 2048  # the capture's --max-model-len: its request-token buckets


@dataclass
class Family:
    type: str = ""
    labels: frozenset[str] = frozenset()
    buckets: tuple[float, ...] = ()


def captured_families() -> dict[str, Family]:
    families: dict[str, Family] = {}
    for line in CAPTURED.read_text().splitlines():
        words = line.split(" ")
        if line.startswith("# TYPE "):
            families[words[2]] = Family(words[3])
        elif words[0] == "LABELS":
            families[words[1]].labels = frozenset(words[2].split(","))
        elif words[0] == "BUCKETS":
            families[words[1]].buckets = tuple(float(b) for b in words[2].split(","))
    return families


def served_families(text: str) -> dict[str, Family]:
    families: dict[str, Family] = {}
    for family in text_string_to_metric_families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = {k for s in family.samples for k in s.labels if k != "le"}
        bounds = {
            float(s.labels["le"])
            for s in family.samples
            if s.name.endswith("_bucket") and s.labels["le"] != "+Inf"
        }
        families[name] = Family(family.type, frozenset(labels), tuple(sorted(bounds)))
    return families


def sample(text: str, name: str, **wanted: str) -> float:
    """The sum of ``name``'s samples whose labels include ``wanted``."""
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and wanted.items() <= s.labels.items()
    )


def fixed_workload(base: str, model: str) -> list[dict[str, int]]:
    """The capture's workload, less its n=2 call: completions (two sharing a long prefix), a
    streamed one and a chat; the usage of each."""
    prefix = "The quick brown fox jumps over the lazy dog. " * 40
    bodies = [
        {"prompt": "Hello", "max_tokens": 8},
        {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0},
        {"prompt": prefix + "A", "max_tokens": 4},
        {"prompt": prefix + "B", "max_tokens": 4},
    ]
    usages = []
    with httpx.Client(base_url=base, timeout=60) as client:
        for body in bodies:
            answer = client.post("/v1/completions", json={"model": model, **body})
            usages.append(answer.json()["usage"])
        streamed = {"model": model, "prompt": "Stream", "max_tokens": 8, "stream": True}
        streamed |= {"stream_options": {"include_usage": True}}
        with client.stream("POST", "/v1/completions", json=streamed) as answer:
            chunks = [line for line in answer.iter_lines() if line.startswith("data: {")]
        usages.append(orjson.loads(chunks[-1].removeprefix("data: "))["usage"])
        chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        usages.append(client.post("/v1/chat/completions", json=chat).json()["usage"])
    return usages


def test_every_vllm_serving_metric_is_served_alike_and_the_counters_add_up(
    server: LiveServer, engine: AsyncLLM
) -> None:
    before = httpx.get(server.base + "/metrics").text
    usages = fixed_workload(server.base, engine.model_name)
    after = httpx.get(server.base + "/metrics").text
    served, captured = served_families(after), captured_families()
    token_buckets = request_tokens_buckets(engine.max_model_len)
    assert (
        request_tokens_buckets(VLLM_MAX_MODEL_LEN) == captured["vllm:request_prompt_tokens"].buckets
    )
    for name, vllm in captured.items():
        if name in OMITTED or name in CONDITIONAL:
            continue
        assert name in served, f"{name} is not served"
        ours = served[name]
        assert ours.type == vllm.type, name
        if name in FEWER_LABELS:
            assert ours.labels < vllm.labels, name
        else:
            assert ours.labels == vllm.labels, name
        if vllm.buckets and vllm.buckets != captured["vllm:request_prompt_tokens"].buckets:
            assert ours.buckets == vllm.buckets, name
        elif vllm.buckets:
            assert ours.buckets == token_buckets, name

    def moved(name: str, **labels: str) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert moved("vllm:generation_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert moved("vllm:prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert moved("vllm:request_success_total") == len(usages)
    assert moved("vllm:e2e_request_latency_seconds_count") == len(usages)
    assert moved("vllm:time_to_first_token_seconds_count") == len(usages)
    assert moved("vllm:prefix_cache_hits_total") > 0  # the shared prefix


def test_lora_requests_info_names_the_running_and_waiting_adapters() -> None:
    stats = engine_stats(max_loras=4, running_adapters=("a", "b"), waiting_adapters=("c",))
    text = Metrics(lambda: stats, "m").render()[0].decode()
    family = served_families(text)["vllm:lora_requests_info"]
    assert family.labels == captured_families()["vllm:lora_requests_info"].labels
    assert family.type == "gauge"
    assert sample(text, "vllm:lora_requests_info", running_lora_adapters="a,b") > 0
    assert sample(text, "vllm:lora_requests_info", waiting_lora_adapters="c") > 0
    assert "vllm:lora_requests_info" not in Metrics(engine_stats, "m").render()[0].decode()


def test_running_reads_the_live_stream_and_drops_once_it_is_closed(
    server: LiveServer, engine: AsyncLLM
) -> None:
    def running() -> float:
        return sample(httpx.get(server.base + "/metrics").text, "vllm:num_requests_running")

    with openai.OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=engine.model_name,
            messages=[{"role": "user", "content": "Tell me a long story"}],
            max_tokens=engine.max_model_len - 64,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks), next(chunks)
        assert running() >= 1
        stream.close()
    deadline = time.monotonic() + 2
    while running() != 0:
        assert time.monotonic() < deadline, "vllm:num_requests_running stayed up after close()"
        time.sleep(0.02)
