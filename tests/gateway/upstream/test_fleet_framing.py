"""A fleet gateway in front of an upstream that writes its HTTP byte for byte
(``raw_upstream``), both real processes on loopback: a second response pipelined after a
good one, bytes past the Content-Length or on an idle connection never reach a caller;
framing that never ends (a header line, header lines, a trailer, a chunk extension), SSE
comments that never end and one SSE line that never ends each end the call within 2 s, the
gateway's RSS at most ``RSS_BOUND`` above its idle figure and its ``/healthz`` answering
within ``HEALTHZ_BOUND_S`` meanwhile; the same while its own health checks meet an endless
header line and its scrapes a /metrics page just under their limit."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gateway.upstream.processes import Process, gateway, running
from tests.gateway.upstream.test_fleet_hostile import (
    PASSIVE,
    PeakRss,
    complete,
    events_of,
    rss,
)

RSS_BOUND = 16 << 20
# /healthz's slowest answer meanwhile: benchmarks/hostile.py's upstream case holds the p99
# to 50 ms; a test on a shared machine allows a scheduling hiccup on top.
HEALTHZ_BOUND_S = 0.25
RAW = ("-m", "tests.gateway.upstream.raw_upstream")
# No breaker opening: a framing fault counts against the upstream, and these come in a row.
TOLERANT = (*PASSIVE, "--upstream-unhealthy-after", "1000")


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet-framing")


@pytest.fixture(scope="module")
def fleet(log_dir: Path) -> Iterator[Process]:
    with running([Process(log_dir, command=RAW)], 30) as (upstream,):
        with running([gateway(log_dir, [upstream], *TOLERANT)], 60) as (g,):
            yield g


class Healthz:
    """The slowest ``/healthz`` round trip while the block runs (one every 10 ms)."""

    def __init__(self, base: str) -> None:
        self.base, self.slowest, self._done = base, 0.0, threading.Event()

    def __enter__(self) -> Healthz:
        self._thread = threading.Thread(target=self._probe)
        self._thread.start()
        return self

    def _probe(self) -> None:
        with httpx.Client(base_url=self.base, timeout=10) as http:
            while not self._done.wait(0.01):
                began = time.perf_counter()
                http.get("/healthz").raise_for_status()
                self.slowest = max(self.slowest, time.perf_counter() - began)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def text_of(response: httpx.Response, stream: bool) -> str:
    assert response.status_code == 200, response.text
    if not stream:
        return str(response.json()["choices"][0]["text"])
    events = events_of(response)
    assert events[-1] == "[DONE]" and all("error" not in e for e in events[:-1]), events
    return "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices"))


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("scenario", ["pipelined", "pipelined-sized", "longer-than-length"])
def test_bytes_after_the_answer_never_reach_the_caller(
    fleet: Process, scenario: str, stream: bool
) -> None:
    """A good answer followed, in the same write, by a second response (its headers would
    merge into the first's, its body follow [DONE]) or by bytes past its Content-Length."""
    response = complete(fleet, scenario, stream=stream)
    assert text_of(response, stream) == "GOOD-"
    assert "SMUGGLED" not in response.text
    assert text_of(complete(fleet, "a normal prompt", stream=stream), stream) == "GOOD-"


def test_an_answer_on_an_idle_connection_is_never_taken_for_the_next(fleet: Process) -> None:
    assert text_of(complete(fleet, "late-extra"), False) == "GOOD-"
    time.sleep(0.2)  # the second answer has come on the idle connection
    for stream in (False, True):
        response = complete(fleet, "a normal prompt", stream=stream)
        assert text_of(response, stream) == "GOOD-" and "SMUGGLED" not in response.text


def assert_refused(response: httpx.Response) -> str:
    """A 502, or a 503 when the answer failed before its headers were in (a transport fault:
    retried elsewhere, and there is no elsewhere here); the error's message."""
    codes = {502: "bad_gateway", 503: "service_unavailable"}
    assert response.status_code in codes, response.text
    error = response.json()["error"]
    assert error["code"] == codes[response.status_code], error
    return str(error["message"])


def test_content_length_beside_chunked_is_refused(fleet: Process) -> None:
    for stream in (False, True):
        assert_refused(complete(fleet, "length-and-chunked", stream=stream))


FLOODS = [
    "endless-header",
    "endless-headers",
    "endless-trailer",
    "endless-chunk-extension",
    "endless-comments",
    "endless-line",
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("scenario", FLOODS)
def test_a_flood_ends_soon_with_memory_and_healthz_bounded(
    fleet: Process, scenario: str, stream: bool
) -> None:
    assert fleet.process is not None
    complete(fleet, "warm up")
    idle = rss(fleet.process.pid)
    started = time.monotonic()
    with PeakRss(fleet.process.pid) as peak, Healthz(fleet.base) as healthz:
        response = complete(fleet, scenario, 10, stream=stream)
    took = time.monotonic() - started
    growth = (peak.peak - idle) / 2**20
    print(f"{scenario} stream={stream}: {took:.2f} s, RSS +{growth:.1f} MiB, /healthz max "
          f"{1000 * healthz.slowest:.0f} ms")  # fmt: skip
    if response.status_code != 200:
        assert_refused(response)
    elif stream:  # an error event, or (a trailer after the answer) the answer as it stood
        events = events_of(response)
        assert events[-1] == "[DONE]" and events[-2].get("error", {}).get("code") in (
            None,
            "bad_gateway",
        ), events[-3:]
    assert took < 2.0
    assert peak.peak - idle <= RSS_BOUND, (scenario, idle, peak.peak)
    assert healthz.slowest < HEALTHZ_BOUND_S, healthz.slowest


def test_its_own_checks_and_scrapes_meet_an_endless_header_and_a_huge_page(
    log_dir: Path,
) -> None:
    raw = Process(log_dir, "--health", "endless-header", "--metrics", "huge", command=RAW)
    every = ("--upstream-health-interval", "0.25", "--upstream-scrape-interval", "0.25")
    flags = (*every, "--upstream-unhealthy-after", "1000")  # ready, for the checks to run on
    with running([raw], 30), running([gateway(log_dir, [raw], *flags)], 60) as (g,):
        assert g.process is not None
        idle = rss(g.process.pid)
        with PeakRss(g.process.pid) as peak, Healthz(g.base) as healthz:
            time.sleep(1.5)  # six checks and six scrapes
        upstream: dict[str, Any] = g.readyz()["upstreams"][0]
        counted = g.metrics()
    assert upstream["scraped"] is None, upstream
    assert 'kvgate_upstream_errors_total{kind="reset",upstream="0"}' in counted
    assert 'kvgate_upstream_scrape_errors_total{kind="parse",upstream="0"}' in counted
    assert peak.peak - idle <= RSS_BOUND, (idle, peak.peak)
    assert healthz.slowest < HEALTHZ_BOUND_S, healthz.slowest
