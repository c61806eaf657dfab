"""Loading checkpoints: sharded and single-file weights, dtypes, identity, and every failure
mode naming the piece that is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvgate.engine.loading.loader import ModelLoadError, load_model, load_weights, safetensors_files
from kvgate.engine.loading.tiny_model import make_tiny_model
from kvgate.engine.models import model_class


@pytest.fixture
def broken(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """A fresh writable copy of the tiny model to damage."""
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    return path


def _edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


def _edit_weights(path: Path, edit) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors")


def test_loads_the_tiny_model(tiny_model_dir: Path) -> None:
    lm = load_model(tiny_model_dir)
    assert lm.config.architecture == "LlamaForCausalLM"
    assert lm.dtype == torch.float32 and not lm.model.training
    assert lm.tokenizer.vocab_size == lm.config.vocab_size
    weights = load_file(tiny_model_dir / "model.safetensors")
    # The loaded model holds its matmul weights packed for oneDNN: check the fused layout on
    # the same model loaded without packing.
    unpacked = model_class(lm.config.architecture)(lm.config, lm.dtype, "cpu")
    load_weights(unpacked, safetensors_files(tiny_model_dir))
    layer = unpacked.layers[1]
    q_rows = lm.config.q_size
    torch.testing.assert_close(
        layer.attn.qkv_weight[q_rows : q_rows + lm.config.kv_size],
        weights["model.layers.1.self_attn.k_proj.weight"],
    )
    torch.testing.assert_close(
        layer.mlp.gate_up_weight[lm.config.intermediate_size :],
        weights["model.layers.1.mlp.up_proj.weight"],
    )


def test_sharded_checkpoint_loads_the_same_weights(hf_checkpoint) -> None:
    sharded = hf_checkpoint("llama", sharded=True)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    ours, whole = load_model(sharded), load_model(hf_checkpoint("llama"))
    for a, b in zip(ours.model.parameters(), whole.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_dtype_choice(tiny_model_dir: Path) -> None:
    assert load_model(tiny_model_dir, dtype="bfloat16").model.embed_weight.dtype == torch.bfloat16
    assert load_model(tiny_model_dir, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_model(tiny_model_dir, dtype="int8")


def test_model_id_is_stable_and_distinguishes_models(tiny_model_dir: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path / "other", seed=1)
    assert load_model(tiny_model_dir).model_id == load_model(tiny_model_dir).model_id
    assert load_model(other).model_id != load_model(tiny_model_dir).model_id
    as_bf16 = load_model(tiny_model_dir, dtype="bfloat16").model_id
    assert as_bf16 != load_model(tiny_model_dir).model_id


def test_unsupported_architecture_is_named(broken: Path) -> None:
    _edit_config(broken, architectures=["GPT2LMHeadModel"])
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel"):
        load_model(broken)


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file_is_named(broken: Path, name: str) -> None:
    (broken / name).unlink()
    expected = "safetensors" if name == "model.safetensors" else name
    with pytest.raises(ModelLoadError, match=expected):
        load_model(broken)


def test_missing_tensor_is_named(broken: Path) -> None:
    _edit_weights(broken, lambda w: w.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(ModelLoadError, match=r"missing tensor 'model\.layers\.1\.mlp\.down_proj"):
        load_model(broken)


def test_unexpected_tensor_is_named(broken: Path) -> None:
    _edit_weights(broken, lambda w: w.update({"model.layers.7.extra.weight": torch.zeros(2)}))
    with pytest.raises(
        ModelLoadError, match=r"unexpected tensor 'model\.layers\.7\.extra\.weight'"
    ):
        load_model(broken)


def test_shape_mismatch_names_tensor_and_shapes(broken: Path) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    _edit_weights(broken, lambda w: w.update({name: torch.zeros(128, 64)}))
    with pytest.raises(ModelLoadError) as info:
        load_model(broken)
    assert f"'{name}'" in str(info.value)
    assert "expected [128, 128], got [128, 64]" in str(info.value)


def test_config_disagreeing_with_weights_is_a_shape_mismatch(broken: Path) -> None:
    _edit_config(broken, intermediate_size=320)
    with pytest.raises(ModelLoadError, match=r"shape mismatch for tensor 'model\.layers\.\d\.mlp"):
        load_model(broken)


def test_missing_shard_is_named(hf_checkpoint, tmp_path: Path) -> None:
    path = tmp_path / "sharded"
    shutil.copytree(hf_checkpoint("llama", sharded=True), path)
    shard = sorted(path.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(path)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model(tmp_path / "nowhere")
