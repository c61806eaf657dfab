"""What an operator sees of a fleet, against real processes: two kvgate engine upstreams and a
gateway over them (round robin, no health checks, so a stopped upstream is found by a call),
all three sending spans to one real OTLP receiver.

The per-upstream counters add up to the upstreams' own usage, call by call; then, with the
first upstream stopped, a call that tried it first is retried on the other: two CLIENT
attempt spans under its SERVER span in one trace, the failed one in error, and the serving
upstream's own span a child of the attempt that reached it (its ``traceparent``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.gateway.otlp_receiver import Received, Receiver, Span, Status, receiving, traceparent
from tests.gateway.upstream.processes import Process, gateway, running

EXPORT_EVERY_50_MS = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    with receiving() as started:
        yield started


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet-observed")


@pytest.fixture(scope="module")
def upstreams(log_dir: Path, receiver: Receiver) -> Iterator[list[Process]]:
    traced = ("--in-process-engine", "--otlp-traces-endpoint", receiver.url)
    started = [
        Process(log_dir, *traced, env={**EXPORT_EVERY_50_MS, "OTEL_SERVICE_NAME": f"upstream-{i}"})
        for i in range(2)
    ]
    with running(started):
        yield started


@pytest.fixture(scope="module")
def fleet(log_dir: Path, upstreams: list[Process], receiver: Receiver) -> Iterator[Process]:
    flags = ("--routing", "round_robin", "--upstream-health-interval", "0")
    traced = ("--otlp-traces-endpoint", receiver.url)
    with running([gateway(log_dir, upstreams, *flags, *traced, **EXPORT_EVERY_50_MS)], 60) as g:
        yield g[0]


def samples(page: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples named ``name`` on a /metrics page, by their labels."""
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(page)
        for sample in family.samples
        if sample.name == name
    }


def ask(base: str, model: str, chat: bool, streamed: bool, headers: dict[str, str]) -> tuple:
    """One call: the upstream that served it and the usage it reported."""
    body: dict = {"model": model, "max_tokens": 6, "temperature": 0, "stream": streamed}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": "Hi"}]
    else:
        path, body["prompt"] = "/v1/completions", "Once upon a time"
    if streamed:
        body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", base + path, json=body, headers=headers, timeout=60) as answer:
        assert answer.status_code == 200, answer.read()
        served_by = answer.headers["x-kvgate-upstream"]
        if streamed:
            events = [line[6:] for line in answer.iter_lines() if line.startswith("data: {")]
            usage = httpx.Response(200, content=events[-1]).json()["usage"]
        else:
            usage = httpx.Response(200, content=answer.read()).json()["usage"]
    return served_by, usage


def test_the_counters_add_up_to_the_upstreams_usage(fleet: Process) -> None:
    model = httpx.get(fleet.base + "/v1/models").json()["data"][0]["id"]
    index = {u["url"]: str(u["index"]) for u in fleet.readyz()["upstreams"]}
    expected: dict[str, dict[str, int]] = {u: {"calls": 0, "prompt": 0, "gen": 0} for u in index}
    calls = [(chat, streamed) for chat in (False, True) for streamed in (False, True)] * 2
    for chat, streamed in calls:
        served_by, usage = ask(fleet.base, model, chat, streamed, {})
        figures = expected[served_by]
        figures["calls"] += 1
        figures["prompt"] += usage["prompt_tokens"]
        figures["gen"] += usage["completion_tokens"]
    page = fleet.metrics()
    for url, figures in expected.items():
        labels = (("model", model), ("upstream", index[url]))
        assert figures["calls"] == len(calls) // 2  # round robin: half each
        requests = samples(page, "kvgate_upstream_requests_total")
        assert requests[(labels[0], ("outcome", "ok"), labels[1])] == figures["calls"]
        assert samples(page, "kvgate_upstream_prompt_tokens_total")[labels] == figures["prompt"]
        generated = samples(page, "kvgate_upstream_generation_tokens_total")[labels]
        assert generated == figures["gen"] > 0
        for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
            counted = samples(page, f"kvgate_upstream_{histogram}_count")[labels]
            assert counted == figures["calls"], histogram
    decisions = samples(page, "kvgate_routing_decisions_total")
    assert decisions[(("rule", "round_robin"),)] == len(calls)
    # vLLM's buckets: TTFT from 1 ms, e2e from 0.3 s
    first_bounds = {
        name: min(float(dict(labels)["le"]) for labels in samples(page, name + "_bucket"))
        for name in (
            "kvgate_upstream_time_to_first_token_seconds",
            "kvgate_upstream_e2e_request_latency_seconds",
        )
    }
    assert list(first_bounds.values()) == [0.001, 0.3]


def attempts_in(receiver: Receiver, trace_id: str) -> tuple[Received, list[Received]]:
    """The gateway's SERVER span of a trace and its CLIENT attempt spans, in start order."""
    (server,) = receiver.wait(
        lambda s: (
            s.trace_id == trace_id
            and s.service == "kvgate"
            and s.span.kind == Span.SPAN_KIND_SERVER
        )
    )
    attempts = receiver.wait(
        lambda s: s.trace_id == trace_id and s.span.kind == Span.SPAN_KIND_CLIENT
    )
    return server, sorted(attempts, key=lambda s: s.span.start_time_unix_nano)


def test_a_call_retried_past_a_stopped_upstream_is_two_attempts_in_one_trace(
    fleet: Process, upstreams: list[Process], receiver: Receiver
) -> None:
    stopped, serving = upstreams
    stopped.stop()
    model = httpx.get(fleet.base + "/v1/models").json()["data"][0]["id"]
    retried = None
    for i in range(4):  # round robin: one of the first two calls tries the stopped one first
        trace_id = f"{i + 1:032x}"
        ask(fleet.base, model, True, False, {"traceparent": traceparent(trace_id)})
        server, attempts = attempts_in(receiver, trace_id)
        if len(attempts) == 2:
            retried = server, attempts
            break
    assert retried is not None, "no call tried the stopped upstream"
    server, (failed, answered) = retried
    for attempt in (failed, answered):
        assert attempt.span.parent_span_id == server.span.span_id
        assert attempt.span.name == f"chat {model}"
        assert attempt.attributes == attempt.attributes | {
            "gen_ai.operation.name": "chat",
            "gen_ai.request.model": model,
            "server.address": "127.0.0.1",
        }
    assert failed.attributes["server.port"] == stopped.port
    assert failed.attributes["kvgate.upstream.outcome"] == "connect"
    assert failed.attributes["error.type"] == "connect"
    assert failed.span.status.code == Status.STATUS_CODE_ERROR
    assert answered.attributes["server.port"] == serving.port
    assert answered.attributes["kvgate.upstream.outcome"] == "ok"
    assert answered.span.status.code != Status.STATUS_CODE_ERROR
    assert (
        answered.attributes["gen_ai.usage.output_tokens"]
        == server.attributes["gen_ai.usage.output_tokens"]
    )
    (upstream_span,) = receiver.wait(
        lambda s: (
            s.trace_id == server.trace_id
            and s.service == "upstream-1"
            and s.span.kind == Span.SPAN_KIND_SERVER
        )
    )
    assert upstream_span.span.parent_span_id == answered.span.span_id
    failures = samples(fleet.metrics(), "kvgate_upstream_requests_total")
    assert failures[(("model", model), ("outcome", "connect"), ("upstream", "0"))] >= 1
