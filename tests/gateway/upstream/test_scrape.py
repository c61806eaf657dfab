"""Scraped upstream load: the ``/metrics`` figures vLLM, SGLang and kvgate export, checked
like input; and, with real kvgate upstreams, a hot key steered off an upstream whose own
figures say it queues."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from kvgate.gateway.settings import Settings
from kvgate.gateway.upstream.fleet import Fleet
from kvgate.gateway.upstream.routing import QUEUE_SLACK, Load
from kvgate.gateway.upstream.scrape import MAX_MENTIONS, Scraped, ScrapeError, parse
from tests.gateway.live_server import LiveServer
from tests.gateway.upstream.processes import Process, gateway, generate, running

VLLM = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:prompt_tokens counter
vllm:prompt_tokens_total{model_name="m"} 12345.0
"""

OLD_VLLM = """\
vllm:num_requests_running{model_name="m"} 1
vllm:num_requests_waiting{model_name="m"} 0
vllm:gpu_cache_usage_perc{model_name="m"} 0.75
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 4
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 9
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
"""


def test_vllm_sglang_and_older_vllm_names_are_read() -> None:
    assert parse(VLLM) == (Scraped(waiting=7, running=5, kv_usage=0.5), 0)  # summed / maxed
    assert parse(OLD_VLLM) == (Scraped(waiting=0, running=1, kv_usage=0.75), 0)
    assert parse(SGLANG) == (Scraped(waiting=9, running=4, kv_usage=0.5), 0)
    assert parse("# a server without engine figures\nhttp_requests_total 3\n") == (None, 0)


def test_invalid_figures_are_dropped_and_counted_garbage_refused() -> None:
    text = (
        'vllm:num_requests_waiting{engine="0"} NaN\n'
        'vllm:num_requests_waiting{engine="1"} -3\n'
        'vllm:num_requests_running{engine="0"} +Inf\n'
        'vllm:num_requests_running{engine="1"} 2\n'
        'vllm:kv_cache_usage_perc{engine="0"} 7.5\n'
    )
    scraped, invalid = parse(text)
    assert invalid == 4 and scraped == Scraped(waiting=0, running=2, kv_usage=0)
    assert all(math.isfinite(v) for v in (scraped.waiting, scraped.running, scraped.kv_usage))
    for garbage in ("vllm:num_requests_waiting{engine=0 7\n", "vllm:num_requests_waiting x y z"):
        with pytest.raises(ScrapeError):
            parse(garbage)


def test_only_the_lines_naming_a_figure_are_parsed() -> None:
    """A longer name, a mention in a label or in another family's help, and a line the
    parser would refuse elsewhere on the page are not the figures'."""
    text = (
        "# HELP other Unlike vllm:num_requests_waiting, it counts nothing.\n"
        'other{of="vllm:num_requests_running"} 9\n'
        "vllm:num_requests_waiting_by_reason 8\n"
        "this line { is not Prometheus text\n" + VLLM
    )
    assert parse(text) == (Scraped(waiting=7, running=5, kv_usage=0.5), 0)


def test_a_huge_page_costs_milliseconds_and_is_refused_past_its_mentions() -> None:
    """The Prometheus parser spends seconds on an 8 MiB page, on the event loop; the scrape
    parses only the lines that name its figures, and at most ``MAX_MENTIONS`` of those."""
    noise = "".join(f'vllm:other_total{{le="{i}"}} 1.0\n' for i in range(200_000))
    flood = "".join(f'vllm:num_requests_waiting{{engine="{i}"}} 0\n' for i in range(200_000))
    started = time.perf_counter()
    assert parse(noise + VLLM) == (Scraped(waiting=7, running=5, kv_usage=0.5), 0)
    with pytest.raises(ScrapeError, match=f"over {MAX_MENTIONS} lines"):
        parse(flood)
    assert time.perf_counter() - started < 0.5


@pytest.fixture(scope="module")
def narrow(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[Process], Process]]:
    """Two upstreams that run one request at a time (the rest queue), a gateway scraping
    them every 0.1 s."""
    log_dir = tmp_path_factory.mktemp("scrape")
    with running([Process(log_dir, "--max-num-seqs", "1") for _ in range(2)]) as upstreams:
        front = gateway(log_dir, upstreams, "--upstream-scrape-interval", "0.1")
        with running([front], 60):
            yield upstreams, front


def test_a_hot_key_leaves_an_upstream_whose_queue_the_scrape_shows(
    narrow: tuple[list[Process], Process],
) -> None:
    upstreams, front = narrow
    own = generate(front.base, cache_key="hot", prompt="hi")["structuredContent"]["replica"]
    queued = QUEUE_SLACK + 2
    with ThreadPoolExecutor(queued + 2) as pool:
        # Long calls on the key's own upstream: one runs, the rest wait there (for seconds:
        # shorter calls drained the queue below the slack between two scrapes once the engine
        # got faster). Sent straight to it, so this gateway has none of them in flight: only
        # the scrape can tell.
        busy = [
            pool.submit(generate, upstreams[own].base, 60, prompt="A long story", max_tokens=600)
            for _ in range(queued + 1)
        ]
        deadline = time.monotonic() + 8
        while True:
            scraped = front.readyz()["upstreams"][own]["scraped"]
            if scraped and scraped["waiting"] >= QUEUE_SLACK:
                break
            assert time.monotonic() < deadline, scraped
            time.sleep(0.05)
        time.sleep(0.25)  # a second scrape: the queue is sustained, not one engine step's
        steered = generate(front.base, cache_key="hot", prompt="hi")
        assert steered["structuredContent"]["replica"] != own, front.readyz()
        assert 'reason="overflow"' in front.metrics()
        for call in busy:
            assert call.result()["isError"] is False
    # The queue drained: the key is back on its own upstream.
    deadline = time.monotonic() + 5
    while generate(front.base, cache_key="hot", prompt="hi")["structuredContent"]["replica"] != own:
        assert time.monotonic() < deadline, front.readyz()
        time.sleep(0.1)


def test_an_upstream_without_engine_figures_is_routed_on_in_flight_alone(
    narrow: tuple[list[Process], Process],
) -> None:
    """A kvgate fleet gateway as an upstream: its /metrics carry no engine figures."""
    _, front = narrow
    settings = Settings(
        upstream=(front.base,), upstream_health_interval_s=0, upstream_scrape_interval_s=0.05
    )
    with LiveServer(None, backend=Fleet.connect(settings)) as nested:
        fleet = nested.app.state.openai.generations.backend
        time.sleep(0.3)  # several scrapes
        upstream = fleet.upstreams[0]
        assert upstream.scraped is None and upstream.load(1.0) == Load(0)
        assert "kvgate_upstream_scrape_errors" not in httpx.get(nested.base + "/metrics").text
        assert generate(nested.base, prompt="hi")["isError"] is False
