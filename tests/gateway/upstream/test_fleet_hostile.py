"""A fleet gateway in front of a malicious upstream (``evil_upstream``), both real processes on
loopback: line separators inside text, malformed replies that must not take the upstream
out, floods (endless streams, an endless line, 10 MB events, a gzip bomb) that must end
quickly in a 502 / an error event with the gateway's memory bounded, wrongly typed answers,
unexpected statuses, cookies, and the upstream API key.

Memory: the gateway's RSS (``/proc/PID/status``) is sampled every 10 ms during each flood
call; the peak may exceed the idle figure by at most ``RSS_BOUND`` (the README's bound)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from tests.gateway.upstream import evil_upstream
from tests.gateway.upstream.processes import Process, call_tool, gateway, running

RSS_BOUND = 64 << 20
EVIL = ("-m", "tests.gateway.upstream.evil_upstream")
# No active checks: a breaker opened by calls stays open for its 5 s cooldown.
PASSIVE = ("--upstream-health-interval", "0", "--upstream-scrape-interval", "0")


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fleet-hostile")


@pytest.fixture(scope="module")
def evil(log_dir: Path) -> Iterator[Process]:
    with running([Process(log_dir, command=EVIL)], 30) as (upstream,):
        yield upstream


@pytest.fixture(scope="module")
def fleet(log_dir: Path, evil: Process) -> Iterator[Process]:
    with running([gateway(log_dir, [evil], *PASSIVE)], 60) as (g,):
        yield g


def complete(g: Process, prompt: str, timeout_s: float = 20, **fields: Any) -> httpx.Response:
    body = {"model": evil_upstream.MODEL, "prompt": prompt, "max_tokens": 5, **fields}
    return httpx.post(g.base + "/v1/completions", json=body, timeout=timeout_s)


def streamed(g: Process, prompt: str, timeout_s: float = 20, **fields: Any) -> list[Any]:
    """The events of a streamed completion (SSE lines end in "\n" only: not splitlines)."""
    response = complete(g, prompt, timeout_s, stream=True, **fields)
    assert response.status_code == 200, response.text
    return events_of(response)


def events_of(response: httpx.Response) -> list[Any]:
    lines = [line[5:].strip() for line in response.text.split("\n") if line.startswith("data:")]
    return [line if line == "[DONE]" else orjson.loads(line) for line in lines]


def assert_stream_failed(response: httpx.Response) -> None:
    """A 502 before the stream began, or its error event then [DONE] after."""
    if response.status_code != 200:
        assert_bad_gateway(response)
    else:
        assert_error_event(events_of(response))


def assert_bad_gateway(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "bad_gateway", error
    return error


def assert_error_event(events: list[Any]) -> None:
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "bad_gateway", events[-3:]


def states(g: Process) -> list[str]:
    return [u["state"] for u in g.readyz()["upstreams"]]


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRss:
    """The largest RSS of a process while the block runs (sampled every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._done = pid, rss(pid), threading.Event()

    def __enter__(self) -> PeakRss:
        self._thread = threading.Thread(target=self._sample)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, rss(self.pid))

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


def test_line_separators_inside_text_are_text(fleet: Process) -> None:
    """U+2028, U+2029 and U+0085 are line breaks to ``str.splitlines`` (and httpx's
    ``aiter_lines``), never to SSE."""
    expected = evil_upstream.SEPARATORS + "after" + evil_upstream.SEPARATORS
    response = complete(fleet, "separators")
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == expected
    events = streamed(fleet, "separators")
    assert "".join(e["choices"][0]["text"] for e in events[:-1] if e.get("choices")) == expected


def test_malformed_replies_never_take_the_upstream_out(fleet: Process) -> None:
    """Content errors are not upstream faults: one tenant's malformed replies (well past
    ``--upstream-unhealthy-after`` 2) leave the breaker closed for everyone else."""
    for _ in range(4):
        error = assert_bad_gateway(complete(fleet, "malformed"))
        assert "malformed" in error["message"]
    assert states(fleet) == ["healthy"]
    assert complete(fleet, "a normal prompt").status_code == 200


FLOODS = [
    "endless",
    "endless-empty",
    "endless-comments",
    "endless-line",
    "huge-events",
    "stall-after-tokens",
    "gzip-bomb",
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("scenario", FLOODS)
def test_a_flooding_upstream_ends_in_a_502_soon_with_memory_bounded(
    fleet: Process, scenario: str, stream: bool
) -> None:
    assert fleet.process is not None
    complete(fleet, "warm up")
    idle = rss(fleet.process.pid)
    started = time.monotonic()
    with PeakRss(fleet.process.pid) as peak:
        if stream:
            assert_stream_failed(complete(fleet, scenario, 10, stream=True))
        else:
            assert_bad_gateway(complete(fleet, scenario, 10))
    took = time.monotonic() - started
    print(f"{scenario} stream={stream}: {took:.2f} s, RSS +{(peak.peak - idle) / 2**20:.1f} MiB")
    assert took < 2.0
    assert peak.peak - idle < RSS_BOUND, (scenario, idle, peak.peak)
    assert states(fleet) == ["healthy"]  # a flood is the reply's content, not a fault


def test_a_stream_that_never_ends_after_its_finish_is_cut(fleet: Process) -> None:
    started = time.monotonic()
    response = complete(fleet, "comments-after-finish", 10)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == "x"
    assert time.monotonic() - started < 2.0


WRONG_TYPES = ["choices-7", "prompt-tokens-lots", "usage-plenty", "finish-object"]


@pytest.mark.parametrize("scenario", WRONG_TYPES)
def test_wrongly_typed_answers_are_a_502_an_error_event_or_a_tool_error(
    fleet: Process, scenario: str
) -> None:
    assert "malformed" in assert_bad_gateway(complete(fleet, scenario))["message"]
    assert_stream_failed(complete(fleet, scenario, stream=True))
    result = call_tool(fleet.base, "generate", {"prompt": scenario, "max_tokens": 5})
    assert result["isError"] and "malformed" in result["content"][0]["text"], result


@pytest.fixture(scope="module")
def tolerant(log_dir: Path, evil: Process) -> Iterator[Process]:
    """A gateway whose breaker never opens: an unexpected status does count against the
    upstream (no caller's prompt makes a real engine answer 302 or 401)."""
    flags = (*PASSIVE, "--upstream-unhealthy-after", "1000")
    with running([gateway(log_dir, [evil], *flags)], 60) as (g,):
        yield g


@pytest.mark.parametrize(
    "scenario", ["status-302", "status-401", "status-404", "status-400-html", "json-body"]
)
def test_unexpected_upstream_answers_are_a_502(tolerant: Process, scenario: str) -> None:
    """The client did nothing wrong; a redirect is never followed."""
    assert "upstream" in assert_bad_gateway(complete(tolerant, scenario))["message"]
    assert_stream_failed(complete(tolerant, scenario, stream=True))
    result = call_tool(tolerant.base, "generate", {"prompt": scenario, "max_tokens": 5})
    assert result["isError"], result


def test_an_unexpected_status_counts_against_the_upstream(log_dir: Path, evil: Process) -> None:
    with running([gateway(log_dir, [evil], *PASSIVE)], 60) as (g,):
        for _ in range(2):
            assert_bad_gateway(complete(g, "status-401"))
        assert states(g) != ["healthy"]


def test_an_upstream_400_with_an_openai_error_is_the_clients(fleet: Process) -> None:
    response = complete(fleet, "status-400")
    assert response.status_code == 400, response.text
    assert "prompt refused: bad field" in response.json()["error"]["message"]


def test_no_cookie_travels_between_calls(fleet: Process, evil: Process) -> None:
    httpx.delete(evil.base + "/seen", timeout=5)
    for prompt in ("one", "two", "status-400", "three"):
        complete(fleet, prompt)
    seen = httpx.get(evil.base + "/seen", timeout=5).json()
    assert len(seen) >= 4
    assert [s for s in seen if s["cookie"] is not None] == []


def test_the_upstream_api_key_goes_with_every_request_and_nothing_else(log_dir: Path) -> None:
    keyed = Process(log_dir, "--api-key", "upstream-secret", command=EVIL)
    with running([keyed], 30):
        flags = ("--upstream-api-key", "upstream-secret", "--api-key", "client-secret")
        flags += ("--upstream-scrape-interval", "0.2")
        with running([gateway(log_dir, [keyed], *flags)], 60) as (g,):
            client = {"Authorization": "Bearer client-secret"}
            body = {"model": evil_upstream.MODEL, "prompt": "hi", "max_tokens": 5}
            answer = httpx.post(g.base + "/v1/completions", json=body, headers=client, timeout=10)
            assert answer.status_code == 200, answer.text
            time.sleep(0.6)  # health checks and scrapes
            seen = httpx.get(keyed.base + "/seen", timeout=5).json()
        seen = [s for s in seen if s["path"] != "/readyz"]  # the test's own wait_ready
        paths = {s["path"] for s in seen}
        assert {"/v1/models", "/v1/completions", "/health", "/metrics"} <= paths, paths
        assert {s["authorization"] for s in seen} == {"Bearer upstream-secret"}, seen
