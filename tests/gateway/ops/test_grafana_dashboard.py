"""examples/deploy/grafana/kvgate.json asks only for what kvgate serves: every metric its
PromQL names is on a live ``/metrics`` (an embedded server, and a fleet gateway over it,
after a few calls), with every label it groups by. And vLLM's own dashboard, imported
unchanged, shows data on all its panels but the two whose names vLLM 0.32 itself dropped."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvgate.gateway.settings import Settings
from kvgate.gateway.upstream.fleet import Fleet
from tests.gateway.live_server import LiveServer

DASHBOARD = Path(__file__).resolve().parents[3] / "examples/deploy/grafana/kvgate.json"
METRIC = re.compile(r"\b(?:vllm:[a-z0-9_:]+|kvgate_[a-z0-9_]+)")
GROUPED = re.compile(r"\bby \(([^)]*)\)")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", re.MULTILINE)
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="')
# vLLM's examples/online_serving/prometheus_grafana/grafana.json: each panel and the series
# its queries read.
VLLM_PANELS = {
    "E2E Request Latency": ("vllm:e2e_request_latency_seconds_bucket",),
    "Token Throughput": ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"),
    "Time Per Output Token Latency": ("vllm:time_per_output_token_seconds_bucket",),
    "Scheduler State": ("vllm:num_requests_running", "vllm:num_requests_waiting"),
    "Time To First Token Latency": ("vllm:time_to_first_token_seconds_bucket",),
    "Cache Utilization": ("vllm:gpu_cache_usage_perc",),
    "Request Prompt Length": ("vllm:request_prompt_tokens_bucket",),
    "Request Generation Length": ("vllm:request_generation_tokens_bucket",),
    "Finish Reason": ("vllm:request_success_total",),
    "Queue Time": ("vllm:request_queue_time_seconds_sum",),
    "Requests Prefill and Decode Time": (
        "vllm:request_prefill_time_seconds_sum",
        "vllm:request_decode_time_seconds_sum",
    ),
    "Max Generation Token in Sequence Group": ("vllm:request_max_num_generation_tokens_sum",),
}
# Renamed by vLLM (to vllm:inter_token_latency_seconds / request_time_per_output_token_seconds
# and vllm:kv_cache_usage_perc); vLLM 0.32 serves the old names no more than kvgate does.
VLLM_DROPPED = {"Time Per Output Token Latency", "Cache Utilization"}


def served(text: str) -> dict[str, set[str]]:
    """Every sample name on a /metrics page, with the label names its samples carry."""
    labels: dict[str, set[str]] = {}
    for name, pairs in SAMPLE.findall(text):
        labels.setdefault(name, set()).update(LABEL.findall(pairs))
    return labels


@pytest.fixture(scope="module")
def scraped(server: LiveServer) -> dict[str, set[str]]:
    """Both pages after a chat, a completion, a refused call, and a call through a fleet."""
    model = httpx.get(server.base + "/v1/models").json()["data"][0]["id"]
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with httpx.Client(timeout=60) as http:
        http.post(server.base + "/v1/chat/completions", json=chat).raise_for_status()
        too_big = http.post(server.base + "/v1/completions", content=b" " * (65 * 1024))
        assert too_big.status_code == 413
        with fleet_over(server) as fleet:
            completion = {"model": model, "prompt": "hello", "max_tokens": 4}
            http.post(fleet.base + "/v1/completions", json=completion).raise_for_status()
            pages = [http.get(base + "/metrics").text for base in (server.base, fleet.base)]
    return served("\n".join(pages))


def fleet_over(server: LiveServer) -> LiveServer:
    settings = Settings(upstream=(server.base,), upstream_health_interval_s=0)
    return LiveServer(None, backend=Fleet.connect(settings))


def targets() -> Iterator[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            yield panel["title"], target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["name"], variable["query"]["query"]


def test_every_expression_reads_a_served_metric_by_served_labels(scraped) -> None:
    seen = 0
    for title, expression in targets():
        names = METRIC.findall(expression)
        assert names, title
        for name in names:
            assert name in scraped, f"{title}: {name} is not on /metrics"
        carried = set().union(*(scraped[name] for name in names))
        grouped = {g.strip() for group in GROUPED.findall(expression) for g in group.split(",")}
        assert grouped <= carried | {"le"}, f"{title}: {grouped - carried} not labels of {names}"
        seen += len(names)
    assert seen >= 20


def test_vllms_own_dashboard_shows_all_but_the_renamed(scraped) -> None:
    shown = {title for title, names in VLLM_PANELS.items() if all(n in scraped for n in names)}
    assert shown == VLLM_PANELS.keys() - VLLM_DROPPED
    assert "model_name" in scraped["vllm:num_requests_running"]  # its $model_name variable
