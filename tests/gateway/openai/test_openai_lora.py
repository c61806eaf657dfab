"""LoRA adapters through both doors of a live server: vLLM's runtime load/unload endpoints,
``/v1/models`` and ``model`` with the official openai client, the MCP tools' ``model``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from kvgate.engine import AsyncLLM, EngineConfig
from kvgate.engine.loading.tiny_model import default_model_dir
from kvgate.gateway.cli import load_lora_modules
from kvgate.gateway.settings import Settings
from kvgate.gateway.upstream.fleet import Fleet
from tests.gateway.live_server import LiveServer
from tests.gateway.wire import call
from tests.lora_adapters import ADAPTER_A, ADAPTER_B, make_adapter

pytest.importorskip("peft")

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root, base = tmp_path_factory.mktemp("lora"), default_model_dir()
    return {
        "a": make_adapter(base, root / "a", **ADAPTER_A),  # type: ignore[arg-type]
        "b": make_adapter(base, root / "b", **ADAPTER_B),  # type: ignore[arg-type]
    }


@pytest.fixture(scope="module")
def lora_server(adapters: dict[str, Path]) -> Iterator[LiveServer]:
    engine = AsyncLLM(EngineConfig(kv_cache_memory="8MiB", seed=0, enable_lora=True))
    load_lora_modules(engine, (f"b={adapters['b']}",))  # --lora-modules b=PATH
    try:
        with LiveServer(engine, allow_runtime_lora_updating=True) as live:
            yield live
    finally:
        engine.shutdown()


@pytest.fixture
def client(lora_server: LiveServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=lora_server.base + "/v1", api_key="none", max_retries=0) as c:
        yield c


def _post(server: LiveServer, path: str, body: dict[str, object]) -> httpx.Response:
    return httpx.post(server.base + path, json=body, timeout=30)


def _complete(client: openai.OpenAI, model: str) -> openai.types.Completion:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)


def test_adapters_load_list_select_and_unload_over_http(
    lora_server: LiveServer, client: openai.OpenAI, adapters: dict[str, Path]
) -> None:
    base = client.models.list().data[0].id
    assert [m.id for m in client.models.list().data] == [base, "b"]
    with pytest.raises(openai.NotFoundError) as caught:
        _complete(client, "a")
    assert caught.value.body["param"] == "model"  # type: ignore[index]

    loaded = _post(
        lora_server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["a"])}
    )
    assert (loaded.status_code, loaded.text) == (
        200,
        "Success: LoRA adapter 'a' added successfully.",
    )
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == {base, "a", "b"}
    assert (cards["a"]["root"], cards["a"]["parent"]) == (str(adapters["a"]), base)

    with_a, with_b, plain = (_complete(client, m) for m in ("a", "b", base))
    assert (with_a.model, with_b.model, plain.model) == ("a", "b", base)
    assert len({with_a.choices[0].text, with_b.choices[0].text, plain.choices[0].text}) == 3
    chat = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.model == "a" and chat.usage is not None and chat.usage.completion_tokens > 0

    unloaded = _post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "a"})
    assert (unloaded.status_code, unloaded.text) == (
        200,
        "Success: LoRA adapter 'a' removed successfully.",
    )
    assert [m.id for m in client.models.list().data] == [base, "b"]
    with pytest.raises(openai.NotFoundError):
        _complete(client, "a")


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "Both 'lora_name' and 'lora_path'"),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "/nowhere"},
            404,
            "No adapter found for /nowhere",
        ),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "/" + "x" * 100_000},
            400,
            "lora_path cannot be read (File name too long)",
        ),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "b", "lora_path": "{b}"},
            400,
            "already been loaded",
        ),
        (
            "/v1/load_lora_adapter",
            {"lora_name": "x", "lora_path": "{b}", "load_inplace": "y"},
            400,
            "load_inplace",
        ),
        ("/v1/unload_lora_adapter", {}, 400, "'lora_name' needs to be provided"),
        ("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "'nope' cannot be found"),
    ],
)
def test_bad_load_and_unload_requests_answer_as_vllm_does(
    lora_server: LiveServer,
    adapters: dict[str, Path],
    path: str,
    body: dict,
    status: int,
    message: str,
) -> None:
    body = {k: v.format(b=adapters["b"]) if isinstance(v, str) else v for k, v in body.items()}
    response = _post(lora_server, path, body)
    assert response.status_code == status
    assert message in response.json()["error"]["message"]


def test_a_loaded_adapter_can_be_replaced_in_place(
    lora_server: LiveServer, client: openai.OpenAI, adapters: dict[str, Path]
) -> None:
    before = _complete(client, "b").choices[0].text
    body = {"lora_name": "b", "lora_path": str(adapters["a"]), "load_inplace": True}
    assert _post(lora_server, "/v1/load_lora_adapter", body).status_code == 200
    try:
        assert _complete(client, "b").choices[0].text != before
    finally:
        body["lora_path"] = str(adapters["b"])
        assert _post(lora_server, "/v1/load_lora_adapter", body).status_code == 200


def test_the_mcp_tools_take_an_adapter_as_model(lora_server: LiveServer) -> None:
    with httpx.Client(timeout=60) as http:

        def generate(**extra: object) -> dict:  # type: ignore[type-arg]
            arguments = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **extra}
            exchange = call(
                http,
                lora_server.url,
                "tools/call",
                {"name": "generate", "arguments": arguments},
                name="generate",
            )
            assert exchange.status == 200
            return exchange.result

        with_b, plain, unknown = generate(model="b"), generate(), generate(model="zz")
    assert with_b["structuredContent"]["model"] == "b"
    assert with_b["structuredContent"]["text"] != plain["structuredContent"]["text"]
    assert unknown["isError"] and "`zz` does not exist" in unknown["content"][0]["text"]


def test_runtime_endpoints_are_off_unless_enabled(server: LiveServer) -> None:
    response = _post(server, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "/x"})
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


def test_a_fleet_forwards_the_adapter_as_model_and_relays_its_404(
    lora_server: LiveServer, client: openai.OpenAI
) -> None:
    settings = Settings(upstream=(lora_server.base,), upstream_health_interval_s=0)
    with (
        LiveServer(None, backend=Fleet.connect(settings)) as fleet,
        openai.OpenAI(base_url=fleet.base + "/v1", api_key="none", max_retries=0) as through,
    ):
        relayed = _complete(through, "b")
        assert (relayed.model, relayed.choices[0].text) == (
            "b",
            _complete(client, "b").choices[0].text,
        )
        for _ in range(3):  # the caller's 404, never a failure of the upstream
            with pytest.raises(openai.NotFoundError, match="`zz` does not exist"):
                _complete(through, "zz")
        assert _complete(through, "b").choices[0].text == relayed.choices[0].text
