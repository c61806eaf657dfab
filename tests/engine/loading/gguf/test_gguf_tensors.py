"""Every GGUF tensor type the loader takes, read back slice by slice into a parameter: equal to
the gguf package's own dequantizer on the whole tensor, and (where gguf can quantize) close to
the values that were quantized."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize
from gguf_files import Q, permute

import kvgate.engine.loading.gguf.tensors as tensors
from kvgate.engine.loading.gguf.tensors import SUPPORTED_TYPES, hf_tensor_name

ROWS, COLS = 64, 512  # K-quant blocks hold 256 values
# Where each K-quant block keeps its fp16 scales (the rest are packed quants and sub-scales).
K_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}

# Largest error a quantize -> dequantize round trip may make on standard normal values (up to
# ~4.5 here): 4-bit blocks step by up to max/7.5, 5-bit by max/15.5, 8-bit by max/127, bf16
# keeps 8 bits.
ROUND_TRIP_ERROR = {
    Q.F32: 0.0,
    Q.F16: 2e-3,
    Q.BF16: 2e-2,
    Q.Q8_0: 2e-2,
    Q.Q4_0: 0.6,
    Q.Q4_1: 0.6,
    Q.Q5_0: 0.3,
    Q.Q5_1: 0.3,
}


def raw_tensor(qtype: Q, values: np.ndarray) -> np.ndarray:
    """`values` as `qtype` bytes; gguf quantizes no K-quant, so those are random blocks with
    small finite scales."""
    if qtype == Q.F32:
        return values
    if qtype == Q.F16:
        return values.astype(np.float16)
    if qtype not in K_SCALES:
        return quantize(values, qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = np.random.default_rng(0).integers(0, 256, (ROWS * COLS // block, size), np.uint8)
    for offset in K_SCALES[qtype]:
        blocks[:, offset : offset + 2] = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)
    return blocks.reshape(ROWS, -1)


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_each_type_dequantizes_as_gguf_does(
    qtype: Q, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tensors, "CHUNK_VALUES", 5 * COLS)  # several slices, a ragged last one
    values = np.random.default_rng(1).standard_normal((ROWS, COLS)).astype(np.float32)
    raw = raw_tensor(qtype, values)
    writer = GGUFWriter(tmp_path / "one.gguf", "llama")
    writer.add_tensor("w", raw, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = GGUFReader(tmp_path / "one.gguf").tensors
    assert tensor.tensor_type == qtype
    target = torch.empty(ROWS, COLS)
    tensors._copy_dequantized(tensor, target, head_dim=0)
    expected = dequantize(raw, qtype)
    assert np.isfinite(expected).all()
    assert torch.equal(target, torch.from_numpy(expected))
    if qtype not in K_SCALES:  # a quantize -> dequantize round trip, within one step
        assert np.abs(expected - values).max() <= ROUND_TRIP_ERROR[qtype]


def test_q_and_k_rows_are_unpermuted_within_each_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tensors, "CHUNK_VALUES", 3 * 16 * 8)  # slices of whole heads
    heads, head_dim = 4, 16
    hf = np.arange(heads * head_dim * 8, dtype=np.float32).reshape(heads * head_dim, 8)
    writer = GGUFWriter(tmp_path / "q.gguf", "llama")
    writer.add_tensor("blk.0.attn_q.weight", permute(hf, heads))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tensor,) = GGUFReader(tmp_path / "q.gguf").tensors
    target = torch.empty(heads * head_dim, 8)
    tensors._copy_dequantized(tensor, target, head_dim=head_dim)
    assert torch.equal(target, torch.from_numpy(hf))


def test_tensor_names_map_to_hugging_face_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.11.attn_k.bias") == "model.layers.11.self_attn.k_proj.bias"
    assert hf_tensor_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight"
    assert hf_tensor_name("blk.2.ffn_down.weight") == "model.layers.2.mlp.down_proj.weight"
    assert hf_tensor_name("blk.0.ffn_gate_exps.weight") is None
    assert hf_tensor_name("v.patch_embd.weight") is None
