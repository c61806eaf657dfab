"""GGUF weights served quantized (`kvgate.engine.loading.gguf.quantized`): the engine's tiny Llama written
as Q8_0/Q4_0/Q4_1 files (gguf's own quantizer), and as files mixing types as llama.cpp's
K-quant files do (down projections in Q6_K, Q4_K or Q5_K, `gguf_files`' quantizers; a v, an
up of another type than q/k, gate), answers the same greedy tokens quantized as dequantized
at load, holds the blocks instead of dense weights, and falls back to dequantizing where the
kernels are off.

Tokens, not logits, are compared: both paths multiply the same dequantized weights; the
quantized one rounds its activations to int16 per 32-block (at most ``amax / 65534`` off per
value, see kvgate/engine/models/quant/qgemm.cpp) and sums in another order, differences far below
the gaps between a random tiny model's top logits at fp32. The logits are checked too, to a
tolerance (1e-4 relative) well below the weights' own quantization error (Q8_0: ~4e-3).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGUFReader
from gguf_files import Q, folder_to_gguf

import kvgate.engine.native as native
from kvgate.engine import LLM, SamplingParams
from kvgate.engine.loading.gguf.loader import load_gguf
from kvgate.engine.models.llama import LlamaForCausalLM
from kvgate.engine.models.lora import LoRARequest
from kvgate.engine.models.quantized_linear import QuantizedLinear, StackedLinear

PROMPTS = [[1, 5, 9, 200, 33], [7, 7, 7, 100, 513, 2, 900, 41, 8, 8, 3]]

# (the file's type, the weights of another type)
TYPES: list[tuple[Q, dict[str, Q]]] = [
    (Q.Q8_0, {}),
    (Q.Q4_0, {}),
    (Q.Q4_1, {}),
    (Q.Q4_1, {"down_proj": Q.Q6_K}),
    (Q.Q8_0, {"down_proj": Q.Q4_K}),
    (Q.Q4_0, {"v_proj": Q.Q8_0, "up_proj": Q.Q4_1, "down_proj": Q.Q5_K}),
    (Q.Q5_0, {"v_proj": Q.Q5_1, "gate_proj": Q.Q5_1}),  # llama.cpp's K-quant fallbacks
]


def _file_name(kinds: tuple[Q, dict[str, Q]]) -> str:
    qtype, mixed = kinds
    return "+".join([qtype.name] + [f"{part}:{t.name}" for part, t in mixed.items()])


@pytest.fixture(scope="module", params=TYPES, ids=_file_name)
def quantized_file(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    if native.library() is None:
        pytest.skip("no native library: GGUF weights are dequantized at load")
    qtype, mixed = request.param
    path = tmp_path_factory.mktemp("q") / f"{_file_name(request.param)}.gguf"
    return folder_to_gguf(tiny_model_dir, path, qtype, mixed)


def _kinds(handle: object) -> list[int]:
    """The types of a handle's products, in order."""
    if isinstance(handle, StackedLinear):
        return [part.qtype for part in handle.parts]
    assert isinstance(handle, QuantizedLinear)
    return [handle.qtype]


def _runs(types: list[int]) -> list[int]:
    """Runs of one type as one: the products a fused weight of these parts takes."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


def _model(path: Path, dequantize: bool) -> LlamaForCausalLM:
    model = load_gguf(path, "float32", dequantize=dequantize).model
    assert isinstance(model, LlamaForCausalLM)
    return model


def test_the_blocks_replace_the_dense_weights(quantized_file: Path) -> None:
    model = _model(quantized_file, dequantize=False)
    types = {t.name: int(t.tensor_type) for t in GGUFReader(quantized_file).tensors}
    for i, layer in enumerate(model.layers):
        handles = {**layer.attn.packed, **layer.mlp.packed}
        assert set(handles) == {"qkv", "o", "gate_up", "down"}
        fused = {
            "qkv": ["attn_q", "attn_k", "attn_v"],
            "o": ["attn_output"],
            "gate_up": ["ffn_gate", "ffn_up"],
            "down": ["ffn_down"],
        }
        for key, parts in fused.items():
            want = _runs([types[f"blk.{i}.{part}.weight"] for part in parts])
            assert _kinds(handles[key]) == want
        assert layer.attn.qkv_weight is None and layer.attn.o_weight is None
        assert layer.mlp.gate_up_weight is None and layer.mlp.down_weight is None
    assert model.embed_quantized is not None and model.embed_weight is None
    assert model.lm_head_quantized is not None and model.lm_head_packed is None
    dense = sum(p.numel() for p in model.parameters())  # the norms are all that is left
    assert dense == model.config.hidden_size * (2 * model.config.num_layers + 1)


def test_greedy_tokens_equal_the_dequantized_model(quantized_file: Path) -> None:
    params = SamplingParams(max_tokens=16, temperature=0)
    answers = [
        LLM(str(quantized_file), dtype="float32", kv_cache_memory="8MiB", gguf_dequantize=d)
        .generate(PROMPTS, params)
        for d in (False, True)
    ]  # fmt: skip
    assert [o.token_ids for o in answers[0]] == [o.token_ids for o in answers[1]]
    quantized, dequantized = (_model(quantized_file, d) for d in (False, True))
    hidden = torch.randn(
        3, quantized.config.hidden_size, generator=torch.Generator().manual_seed(0)
    )
    want = dequantized.compute_logits(hidden)
    got = quantized.compute_logits(hidden)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4 * want.abs().max().item())


def test_dequantize_and_disabled_kernels_both_load_dense(
    quantized_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dense = _model(quantized_file, dequantize=True).layers[0].attn.packed
    assert not any(isinstance(h, QuantizedLinear | StackedLinear) for h in dense.values())
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    native.library.cache_clear()
    try:
        model = _model(quantized_file, dequantize=False)
    finally:
        native.library.cache_clear()
    handles = model.layers[0].attn.packed.values()
    assert not any(isinstance(h, QuantizedLinear | StackedLinear) for h in handles)
    assert model.embed_quantized is None


def test_the_two_paths_are_two_model_identities(quantized_file: Path) -> None:
    ids = {load_gguf(quantized_file, "float32", dequantize=d).model_id for d in (False, True)}
    assert len(ids) == 2


def test_lora_adapters_on_quantized_weights_give_the_dequantized_tokens(
    quantized_file: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Adapters add to the quantized products' outputs; an MLP an adapter targets runs its
    gate/up and down unfused, on the blocks too."""
    pytest.importorskip("peft")
    from tests.lora_adapters import ADAPTER_A, ADAPTER_B, make_adapter

    adapters = {
        "a": make_adapter(tiny_model_dir, tmp_path / "a", **ADAPTER_A),  # type: ignore[arg-type]
        "b": make_adapter(tiny_model_dir, tmp_path / "b", **ADAPTER_B),  # type: ignore[arg-type]
    }
    names = ["a", None, "b"]
    answers = []
    for dequantize in (False, True):
        llm = LLM(
            str(quantized_file), dtype="float32", kv_cache_memory="8MiB", enable_lora=True,
            gguf_dequantize=dequantize,
        )  # fmt: skip
        requests = [None if n is None else LoRARequest(n, str(adapters[n])) for n in names]
        outputs = llm.generate(PROMPTS + PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0),
                               lora_request=requests)  # fmt: skip
        answers.append([o.token_ids for o in outputs])
    assert answers[0] == answers[1]
