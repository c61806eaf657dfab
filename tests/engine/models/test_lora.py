"""LoRA adapters in the engine: token-for-token agreement with transformers + peft for several
adapters and the base model in one batch, prefix-cache separation, and every refusal."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kvgate.engine.models.packed_linear as pl
from kvgate.engine import LLM, SamplingParams
from kvgate.engine.core.block_hash import root_hash
from kvgate.engine.core.model_runner import ModelRunner
from kvgate.engine.core.scheduler import ScheduledBatch
from kvgate.engine.errors import AdapterError, AdapterNotFound, UnknownAdapter
from kvgate.engine.models.lora import CONFIG_FILE, WEIGHTS_FILE, LoRARequest
from tests.lora_adapters import ADAPTER_A, ADAPTER_B, make_adapter, peft_greedy

pytest.importorskip("peft")

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
PROMPTS = [
    [5, 9, 42],
    list(range(100, 117)),
    [(7 * i) % 900 + 20 for i in range(32)],
    [3, 4, 5, 6, 7, 8],
    [(13 * i) % 800 + 30 for i in range(21)],
    [11, 12],
    [(5 * i) % 700 + 40 for i in range(40)],
    [900, 901, 902, 903],
]
SHARED = [(3 * i) % 500 + 50 for i in range(40)]  # two full blocks and a bit


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    return {
        "a": make_adapter(tiny_model_dir, root / "a", **ADAPTER_A),  # type: ignore[arg-type]
        "b": make_adapter(tiny_model_dir, root / "b", **ADAPTER_B),  # type: ignore[arg-type]
    }


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path, adapters: dict[str, Path]) -> Iterator[LLM]:
    engine = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True, kv_cache_memory="8MiB")
    for name, path in adapters.items():
        engine.core.add_lora(name, str(path))
    yield engine


@pytest.fixture
def steps(monkeypatch: pytest.MonkeyPatch) -> list[list[str | None]]:
    """The adapter names of every step's requests, as the model runner ran them."""
    seen: list[list[str | None]] = []
    execute = ModelRunner.execute

    def recording(self: ModelRunner, batch: ScheduledBatch):  # type: ignore[no-untyped-def]
        seen.append([None if r.lora is None else r.lora.name for r in batch.requests])
        return execute(self, batch)

    monkeypatch.setattr(ModelRunner, "execute", recording)
    return seen


def test_a_mixed_batch_matches_transformers_and_peft_token_for_token(
    llm: LLM, tiny_model_dir: Path, adapters: dict[str, Path], steps: list[list[str | None]]
) -> None:
    names = ["a", "b", None, "a", None, "b", "a", None]
    outputs = llm.generate(PROMPTS, GREEDY, lora_request=[_request(n, adapters) for n in names])
    assert len(steps[0]) == 8 and set(steps[0]) == {"a", "b", None}  # one step, all three
    for prompt, name, output in zip(PROMPTS, names, outputs, strict=True):
        adapter = None if name is None else adapters[name]
        assert output.token_ids == peft_greedy(tiny_model_dir, adapter, prompt, 10), name
    base = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.token_ids for o in base] != [o.token_ids for o in outputs[:2]]  # adapters bite


def test_unpacked_weights_give_the_same_tokens(
    tiny_model_dir: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The F.linear path (GPUs, CPUs without oneDNN): the same adapters, the same tokens."""
    monkeypatch.setattr(pl, "packing_helps", lambda weight: False)
    engine = LLM(str(tiny_model_dir), dtype="float32", enable_lora=True, kv_cache_memory="2MiB")
    names = ["b", None, "a"]
    outputs = engine.generate(
        PROMPTS[:3], GREEDY, lora_request=[_request(n, adapters) for n in names]
    )
    for prompt, name, output in zip(PROMPTS, names, outputs, strict=False):
        adapter = None if name is None else adapters[name]
        assert output.token_ids == peft_greedy(tiny_model_dir, adapter, prompt, 10), name


@pytest.mark.parametrize("arch", ["gemma2", "qwen3"])
def test_other_families_match_peft_too(
    arch: str,
    hf_checkpoint,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    """Gemma 2 (GeGLU, sandwich and (1 + w) norms, soft-caps); Qwen3 (q/k norms, tied
    embeddings)."""
    base = hf_checkpoint(arch)
    adapter = make_adapter(base, tmp_path / "a", **ADAPTER_A)  # type: ignore[arg-type]
    engine = LLM(str(base), dtype="float32", enable_lora=True, kv_cache_memory="2MiB")
    request = LoRARequest("a", str(adapter))
    outputs = engine.generate(PROMPTS[:2], GREEDY, lora_request=[request, None])
    assert outputs[0].token_ids == peft_greedy(base, adapter, PROMPTS[0], 10)
    assert outputs[1].token_ids == peft_greedy(base, None, PROMPTS[1], 10)


def test_prefix_cache_blocks_are_never_shared_across_adapters(
    llm: LLM, adapters: dict[str, Path]
) -> None:
    def cached(name: str | None) -> int:
        request = _request(name, adapters)
        return llm.generate([SHARED], GREEDY, lora_request=request)[0].cached_tokens

    assert cached("a") == 0
    assert cached("b") == 0 and cached(None) == 0  # same prompt, another adapter / the base
    assert cached("a") == 32 and cached("b") == 32 and cached(None) == 32  # each its own
    llm.core.remove_lora("a")  # another adapter reloaded under the same name: no reuse
    llm.core.add_lora("a", str(adapters["b"]))
    try:
        assert cached("a") == 0
    finally:
        llm.core.add_lora("a", str(adapters["a"]), replace=True)


def test_the_adapter_is_part_of_the_block_hash_root(llm: LLM) -> None:
    base = root_hash("model", "bf16", 16, "tenant")
    assert root_hash("model", "bf16", 16, "tenant", None) == base  # base roots unchanged
    roots = {base, *(root_hash("model", "bf16", 16, "tenant", a) for a in (b"a\x00x", b"a\x00y"))}
    assert len(roots) == 3
    a, b = llm.core.loras.get("a"), llm.core.loras.get("b")
    assert a.identity != b.identity and a.identity.startswith(b"a\x00")
    assert llm.core.hash_root("tenant", a) != llm.core.hash_root("tenant", b)


def test_max_loras_bounds_the_adapters_of_a_step(
    tiny_model_dir: Path, adapters: dict[str, Path], steps: list[list[str | None]]
) -> None:
    engine = LLM(
        str(tiny_model_dir), dtype="float32", enable_lora=True, max_loras=1, kv_cache_memory="4MiB"
    )
    names = ["a", "b", None, "a", "b", None]
    requests = [_request(n, adapters) for n in names]
    outputs = engine.generate(PROMPTS[: len(names)], GREEDY, lora_request=requests)
    assert all(len({n for n in step if n is not None}) <= 1 for step in steps)
    assert {n for step in steps for n in step} == {"a", "b", None}
    assert all(len(o.token_ids) == 10 for o in outputs)


def test_an_unknown_adapter_is_refused_naming_the_model_field(llm: LLM) -> None:
    with pytest.raises(UnknownAdapter, match="`nope` does not exist") as caught:
        llm.core.make_request([1, 2, 3], GREEDY, lora_name="nope")
    assert caught.value.field == "model"


def test_adapters_need_lora_enabled(tiny_model_dir: Path, adapters: dict[str, Path]) -> None:
    engine = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="2MiB")
    with pytest.raises(AdapterError, match="not enabled"):
        engine.core.add_lora("a", str(adapters["a"]))


def _broken(source: Path, target: Path, config: dict | None = None, tensors=None) -> Path:  # type: ignore[no-untyped-def]
    """A copy of the adapter at ``source`` with its config fields or tensors changed."""
    target.mkdir()
    fields = json.loads((source / CONFIG_FILE).read_text())
    (target / CONFIG_FILE).write_text(json.dumps({**fields, **(config or {})}))
    weights = load_file(source / WEIGHTS_FILE)
    save_file(tensors(weights) if tensors else weights, target / WEIGHTS_FILE)
    return target


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize(
    ("config", "tensors", "message"),
    [
        ({"r": 32}, None, "r is 32, above this server's max_lora_rank 16"),
        ({"r": 0}, None, "r must be a positive integer"),
        ({"use_dora": True}, None, "use_dora True is not served"),
        ({"bias": "all"}, None, "bias 'all' is not served"),
        (
            None,
            lambda w: {**w, Q_A: torch.zeros(8, 64)},
            "needs a float tensor of shape \\[8, 128\\]",
        ),
        (None, lambda w: {**w, Q_A: w[Q_A].long()}, "torch.int64"),
        (None, lambda w: {**w, Q_A: w[Q_A] * float("nan")}, "NaN or infinite"),
        (
            None,
            lambda w: {k: v for k, v in w.items() if k != Q_A},
            "q_proj has lora_B but no lora_A",
        ),
        (
            None,
            lambda w: {**w, "lm_head.lora_A.weight": w[Q_A].clone()},
            "'lm_head.lora_A.weight' is not",
        ),
        (
            None,
            lambda w: {**w, Q_A.replace("layers.0", "layers.9"): w[Q_A].clone()},
            "no such projection",
        ),
    ],
)
def test_a_bad_adapter_is_refused_naming_what_is_wrong(
    llm: LLM,
    adapters: dict[str, Path],
    tmp_path: Path,
    config,
    tensors,
    message: str,  # type: ignore[no-untyped-def]
) -> None:
    folder = _broken(adapters["a"], tmp_path / "bad", config, tensors)
    with pytest.raises(AdapterError, match=message):
        llm.core.add_lora("bad", str(folder))
    assert "bad" not in llm.core.loras


def test_missing_and_unreadable_folders(
    llm: LLM, adapters: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(AdapterNotFound, match="No adapter found for /nowhere"):
        llm.core.add_lora("x", "/nowhere")
    with pytest.raises(AdapterError, match=r"lora_path cannot be read \(File name too long\)$"):
        llm.core.add_lora("x", "/" + "x" * 100_000)  # the message does not quote it
    folder = _broken(adapters["a"], tmp_path / "junk")
    (folder / WEIGHTS_FILE).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{junk!!}")
    with pytest.raises(AdapterError, match="not a readable safetensors file"):
        llm.core.add_lora("x", str(folder))
    (folder / WEIGHTS_FILE).write_bytes(b"\x00" * (64 << 20))
    with pytest.raises(AdapterError, match="more than this base model allows"):
        llm.core.add_lora("x", str(folder))
    with pytest.raises(AdapterError, match="already been loaded"):
        llm.core.add_lora("a", str(adapters["a"]))


def _request(name: str | None, adapters: dict[str, Path]) -> LoRARequest | None:
    return None if name is None else LoRARequest(name, str(adapters[name]))
