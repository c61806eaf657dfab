"""The web console in a real browser: Debian's headless ``chromium``, driven by Playwright
(its own browser download is not used). The page loads with no console error, a chat
message streams the tiny model's answer into the page, the charts move while a load runs,
with keys on the page shows the refusal until a key is typed, and over a fleet of three
upstream processes the fleet view marks the one stopped down. Skipped without chromium.

``KVGATE_CONSOLE_SCREENSHOTS=DIR`` saves the chat and the charts there (docs/images/)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.gateway.live_server import LiveServer
from tests.gateway.upstream.processes import Process, gateway, running

CHROMIUM = shutil.which("chromium")
if CHROMIUM is None:
    pytest.skip("no chromium (apt-get install chromium)", allow_module_level=True)
sync_api = pytest.importorskip("playwright.sync_api")
SCREENSHOTS = os.environ.get("KVGATE_CONSOLE_SCREENSHOTS")
PROMPT = "Tell me a story about a paged KV cache"


@pytest.fixture(scope="module")
def browser() -> Iterator[sync_api.Browser]:
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: sync_api.Browser) -> Iterator[sync_api.Page]:
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    yield context.new_page()
    context.close()


def errors_of(page: sync_api.Page) -> list[str]:
    """What the page reports as an error from now on: console errors and uncaught ones."""
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    return errors


def shot(page: sync_api.Page, name: str) -> None:
    if SCREENSHOTS:
        page.screenshot(path=str(Path(SCREENSHOTS) / name))


def series(page: sync_api.Page, chart: str) -> dict[str, list[float | None]]:
    return json.loads(page.get_attribute(f"[data-chart={chart}]", "data-series") or "{}")


def test_the_console_loads_without_errors(server: LiveServer, page: sync_api.Page) -> None:
    errors = errors_of(page)
    page.goto(server.base + "/ui")
    page.wait_for_selector("body[data-catalog=loaded]")
    page.click("#tabs button[data-tab=catalog]")
    model = httpx.get(server.base + "/v1/models").json()["data"][0]["id"]
    assert page.inner_text("#catalog-models tbody td") == model
    assert "generate" in page.inner_text("#catalog-tools tbody")
    page.click("#tabs button[data-tab=fleet]")
    page.wait_for_function("document.querySelector('#fleet-summary').textContent !== ''")
    assert page.inner_text("#fleet-summary").startswith("Embedded engine: 1 of 1 replica(s)")
    time.sleep(1.2)  # a metrics poll or two
    assert errors == []


def test_a_chat_message_streams_into_the_page(server: LiveServer, page: sync_api.Page) -> None:
    errors = errors_of(page)
    page.goto(server.base + "/")
    page.wait_for_selector("body[data-catalog=loaded]")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", "160")  # a stream long enough to arrive in parts
    page.evaluate(  # every length the answer's text had, as the page changed it
        """() => {
            window.seen = [];
            new MutationObserver(() => {
                const answer = document.querySelector('.message.assistant');
                if (answer) window.seen.push(answer.textContent.length);
            }).observe(document.querySelector('#chat-log'),
                       {childList: true, subtree: true, characterData: true});
        }"""
    )
    page.fill("#chat-input", PROMPT)
    page.click("#chat-send")
    page.wait_for_selector(".message.assistant[data-state=done]", timeout=60_000)
    shown = page.text_content(".message.assistant")
    model = page.input_value("#chat-model")
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 160,
        "temperature": 0,
    }
    asked = httpx.post(server.base + "/v1/chat/completions", json=body, timeout=60).json()
    assert shown == asked["choices"][0]["message"]["content"] != ""
    grew = sorted(set(page.evaluate("window.seen")))
    assert len(grew) >= 3 and grew[-1] == len(shown)
    shot(page, "console-chat.png")
    assert errors == []


def load(base: str, model: str, seconds: float) -> None:
    """Four clients asking for 32 tokens at a time, for ``seconds``."""
    ends = time.monotonic() + seconds

    def client(i: int) -> None:
        body = {"model": model, "prompt": f"Load {i}", "max_tokens": 32, "ignore_eos": True}
        with httpx.Client(timeout=60) as http:
            while time.monotonic() < ends:
                http.post(base + "/v1/completions", json=body).raise_for_status()

    threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def test_the_charts_move_while_a_load_runs(server: LiveServer, page: sync_api.Page) -> None:
    errors = errors_of(page)
    page.goto(server.base + "/")
    page.click("#tabs button[data-tab=metrics]")
    page.wait_for_function("document.querySelector('[data-chart=tokens]')?.dataset.series")
    model = httpx.get(server.base + "/v1/models").json()["data"][0]["id"]
    load(server.base, model, 4.0)
    time.sleep(1.2)  # the poll after the load
    generation = [v for v in series(page, "tokens")["generation"] if v is not None]
    assert max(generation) > 0
    assert max(v or 0 for v in series(page, "requests")["running"]) >= 1
    ttft = series(page, "ttft")["p50"]
    assert ttft[-1] is not None and ttft[-1] > 0
    assert any(v is not None and v > 0 for v in series(page, "itl")["p99"])
    shot(page, "console-metrics.png")
    assert errors == []


def test_with_keys_on_the_page_shows_the_refusal(engine, page: sync_api.Page) -> None:
    with LiveServer(engine, api_key="console-key") as keyed:
        page.goto(keyed.base + "/")
        page.wait_for_selector("body[data-catalog=refused]")
        assert page.inner_text("#chat-refusal").startswith("Refused: 401")
        assert page.locator("#catalog-models tbody tr").count() == 0
        page.fill("#api-key", "console-key")
        page.click("#key-form button")
        page.wait_for_selector("body[data-catalog=loaded]")
        assert page.is_hidden("#chat-refusal")
        assert page.evaluate("sessionStorage.getItem('kvgate.apiKey')") == "console-key"


def test_the_fleet_view_marks_a_stopped_upstream_down(page: sync_api.Page, tmp_path: Path) -> None:
    """Three upstream processes and a gateway checking them every 0.25 s (two failed checks
    mark one down): the one stopped by its PID is shown down within seconds, the others up."""
    upstreams = [Process(tmp_path, "--in-process-engine") for _ in range(3)]
    with running(upstreams), running([gateway(tmp_path, upstreams)], 60) as (fleet,):
        errors = errors_of(page)
        page.goto(fleet.base + "/ui")
        page.click("#tabs button[data-tab=fleet]")
        page.wait_for_selector("#fleet-upstreams tbody tr.up >> nth=2")
        assert page.inner_text("#fleet-summary").startswith("Fleet: 3 of 3 upstream(s)")
        stopped = upstreams[1]
        stopped.stop()
        row = f"#fleet-upstreams tbody tr[data-url='{stopped.base}']"
        page.wait_for_selector(f"{row}.down", timeout=10_000)
        assert page.inner_text(f"{row} td:nth-child(3)").startswith("down (")
        assert page.locator("#fleet-upstreams tbody tr.up").count() == 2
        assert page.inner_text("#fleet-summary").startswith("Fleet: 2 of 3 upstream(s)")
        shot(page, "console-fleet.png")
        assert errors == []
