"""kvgate.engine.loading.gguf end to end on small files written with gguf.GGUFWriter: the engine's tiny
Hugging Face folder converted as llama.cpp converts (names, q/k permutation, vocabulary)
loads to the very same model, tokenizer and answers; bad files are clear errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from gguf_files import Q, folder_to_gguf

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.errors import ModelLoadError
from kvgate.engine.loading.gguf.loader import load_gguf
from kvgate.engine.loading.loader import load_model
from kvgate.engine.loading.model_source import resolve_model

TEXTS = ["Hello world, <|im_start|> 123", "  spaces\nand ünïcode ✓", ""]


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return folder_to_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def test_a_converted_folder_loads_to_the_same_model(tiny_model_dir: Path, tiny_gguf: Path) -> None:
    ours, folder = load_gguf(tiny_gguf), load_model(tiny_model_dir)
    assert ours.dtype == folder.dtype == torch.float32  # the file is F32: "auto" keeps it
    # GGUF stores eps as f32 and has no generation_config.json (its second EOS id).
    expected = dataclasses.replace(
        folder.config, rms_norm_eps=float(np.float32(1e-5)), eos_token_ids=[1]
    )
    assert ours.config == expected
    weights, reference = ours.model.state_dict(), folder.model.state_dict()
    assert weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(weights[name], tensor), name  # q/k rows unpermuted exactly
    for text in TEXTS:
        assert ours.tokenizer.encode(text) == folder.tokenizer.encode(text)
    messages = [{"role": "user", "content": "hi"}]
    assert ours.tokenizer.apply_chat_template(messages) == folder.tokenizer.apply_chat_template(
        messages
    )
    assert ours.model_id != folder.model_id


def test_llm_serves_a_gguf_file(tiny_model_dir: Path, tiny_gguf: Path) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[0, 5, 9, 200], [0, 7]]
    answers = [
        LLM(str(m), kv_cache_memory="8MiB").generate(prompts, params)
        for m in (tiny_gguf, tiny_model_dir)
    ]
    assert [o.token_ids for o in answers[0]] == [o.token_ids for o in answers[1]]


def test_quantized_files_load_close_to_the_weights(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = folder_to_gguf(tiny_model_dir, tmp_path / "q8.gguf", Q.Q8_0)
    loaded = load_gguf(path, dequantize=True)
    assert loaded.dtype == torch.bfloat16  # "auto" on a quantized file: what it dequantizes to
    # The same dtype on both sides: whether the matmul weights are packed (and so left out of
    # the state dict) depends on the dtype and on what the CPU computes natively.
    folder = load_model(tiny_model_dir, dtype=torch.bfloat16).model.state_dict()
    assert loaded.model.state_dict().keys() == folder.keys()
    for name, tensor in loaded.model.state_dict().items():
        assert torch.allclose(tensor.float(), folder[name].float(), atol=0.02), name


def test_an_unsupported_tensor_type_names_it(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = folder_to_gguf(tiny_model_dir, tmp_path / "mxfp4.gguf", Q.MXFP4)
    with pytest.raises(
        ModelLoadError,
        match=r"unsupported GGUF tensor type MXFP4 of 'output.weight'; supported: F32",
    ):
        load_gguf(path)


def test_an_unsupported_architecture_names_it(tmp_path: Path) -> None:
    writer = GGUFWriter(tmp_path / "phi2.gguf", "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF architecture 'phi2'.*llama"):
        load_gguf(tmp_path / "phi2.gguf")


def test_a_file_that_is_not_gguf_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        load_gguf(bad)


def test_model_names_resolve_to_what_they_name(tiny_gguf: Path, tmp_path: Path) -> None:
    assert resolve_model(str(tiny_gguf)) == tiny_gguf
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="is not a .gguf file"):
        resolve_model(str(other))
    with pytest.raises(ModelLoadError, match="no such folder or file, not a known model name"):
        resolve_model(str(tmp_path / "missing"))
