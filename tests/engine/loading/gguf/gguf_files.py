"""Small GGUF files for the tests, written with `gguf.GGUFWriter` as llama.cpp's converter
writes them: its tensor names, its q/k row permutation for Llama, its tokenizer metadata."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType
from gguf.quants import quantize
from safetensors.torch import load_file

Q = GGMLQuantizationType
FILE_TYPES = {
    Q.F32: 0,
    Q.F16: 1,
    Q.Q4_0: 2,
    Q.Q4_1: 3,
    Q.Q5_0: 8,
    Q.Q5_1: 9,
    Q.Q8_0: 7,
    Q.BF16: 32,
    Q.MXFP4: 38,
}  # llama_ftype
HF_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    base, _, kind = hf_name.rpartition(".")
    if base in top:
        return f"{top[base]}.{kind}"
    _, _, layer, rest = base.split(".", 3)
    return f"blk.{layer}.{HF_TO_GGUF[rest]}.{kind}"


def permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's `LlamaModel.permute` of q/k rows (convert_hf_to_gguf.py)."""
    return (
        rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
        .swapaxes(1, 2)
        .reshape(rows.shape)
    )


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)[..., None].view(np.uint8)


def _divide(values: np.ndarray, by: np.ndarray) -> np.ndarray:
    return np.divide(values, by, out=np.zeros_like(values), where=by != 0)


def quantize_q4_k(values: np.ndarray, bits: int = 4) -> np.ndarray:
    """`values [rows, cols]` (cols a multiple of 256) as Q4_K blocks (Q5_K with ``bits`` 5): a
    plain min/max rounding per 32-value sub-block (not llama.cpp's search), packed as ggml lays
    them out (``d, dmin, 12 bytes of 6-bit scales and mins``, Q5_K's 32 bytes of fifth bits,
    ``128 of nibbles``); gguf quantizes no K-quant."""
    top = (1 << bits) - 1
    sub = values.astype(np.float32).reshape(-1, 8, 32)  # super-blocks of 8 sub-blocks
    low, high = np.minimum(sub.min(-1), 0), np.maximum(sub.max(-1), 0)
    scale, minimum = (high - low) / top, -low
    d = scale.max(-1, keepdims=True) / 63
    dmin = minimum.max(-1, keepdims=True) / 63
    d, dmin = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_divide(scale, d)), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_divide(minimum, dmin)), 0, 63).astype(np.uint8)
    step = (d * sc)[..., None]
    q = np.clip(np.rint(_divide(sub + (dmin * mn)[..., None], step)), 0, top).astype(np.uint8)
    scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
        ],
        axis=1,
    )
    pairs = q.reshape(-1, 4, 2, 32) & 0xF  # sub-blocks 2g and 2g+1 share 32 bytes
    nibbles = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    fifth = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(1, dtype=np.uint8)  # bit j
    parts = [_fp16_bytes(d[:, 0]), _fp16_bytes(dmin[:, 0]), scales]
    parts += [fifth] if bits == 5 else []
    blocks = np.concatenate([*parts, nibbles], axis=1)
    return blocks.reshape(values.shape[0], -1)


def quantize_q6_k(values: np.ndarray) -> np.ndarray:
    """`values [rows, cols]` (cols a multiple of 256) as Q6_K blocks (``128 bytes of low
    nibbles, 64 of 2-bit highs, 16 int8 scales, d``): each 16 values rounded to -32..31
    against their max."""
    sub = values.astype(np.float32).reshape(-1, 16, 16)  # super-blocks of 16 sub-blocks
    scale = np.abs(sub).max(-1) / 31
    d = (scale.max(-1, keepdims=True) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(_divide(scale, d)), -128, 127).astype(np.int8)
    step = (d * sc)[..., None]
    q = (np.clip(np.rint(_divide(sub, step)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(-1, 2, 4, 32)  # per 128-value chunk: four runs of 32
    ql = np.concatenate(
        [q[:, :, 0] & 0xF | (q[:, :, 2] & 0xF) << 4, q[:, :, 1] & 0xF | (q[:, :, 3] & 0xF) << 4],
        axis=2,
    ).reshape(-1, 128)
    qh = q[:, :, 0] >> 4 | (q[:, :, 1] >> 4) << 2 | (q[:, :, 2] >> 4) << 4 | (q[:, :, 3] >> 4) << 6
    blocks = np.concatenate(
        [ql, qh.reshape(-1, 64), sc.view(np.uint8), _fp16_bytes(d[:, 0])], axis=1
    )
    return blocks.reshape(values.shape[0], -1)


def add_tensor(writer: GGUFWriter, name: str, values: np.ndarray, qtype: Q) -> None:
    """`values` (fp32) stored as `qtype` (norms and other 1-D tensors stay F32, as llama.cpp
    keeps them)."""
    if values.ndim == 1 or qtype == Q.F32:
        writer.add_tensor(name, values.astype(np.float32))
    elif qtype == Q.F16:
        writer.add_tensor(name, values.astype(np.float16))
    elif qtype in (Q.Q4_K, Q.Q5_K):
        writer.add_tensor(name, quantize_q4_k(values, 4 if qtype == Q.Q4_K else 5), raw_dtype=qtype)
    elif qtype == Q.Q6_K:
        writer.add_tensor(name, quantize_q6_k(values), raw_dtype=qtype)
    else:
        writer.add_tensor(name, quantize(values, qtype), raw_dtype=qtype)


def folder_to_gguf(
    folder: Path,
    path: Path,
    qtype: Q = Q.F32,
    mixed: dict[str, Q] | None = None,
    **fields: Any,
) -> Path:
    """The engine's tiny Hugging Face folder (Llama, byte-level BPE) as a GGUF file; ``mixed``:
    the weights whose names hold a key (``"down_proj"``, ``"v_proj"``) in another type, as
    llama.cpp's K-quant files mix types (the down projections are the only matrices of the
    tiny model whose rows hold whole K-quant super-blocks); `fields` add or override metadata
    (`llama.rope.freq_base=...`)."""
    config = json.loads((folder / "config.json").read_text())
    spec = json.loads((folder / "tokenizer.json").read_text())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    writer = GGUFWriter(path, "llama")
    writer.add_file_type(FILE_TYPES[qtype])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_rope_dimension_count(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    vocab = spec["model"]["vocab"] | {t["content"]: t["id"] for t in spec["added_tokens"]}
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in spec["added_tokens"] if t["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [TokenType.CONTROL if t in special else TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges([" ".join(m) for m in spec["model"]["merges"]])
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(tokenizer_config["chat_template"])
    for key, value in fields.items():
        add = writer.add_float32 if isinstance(value, float) else writer.add_string
        add(key, value)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for name, tensor in load_file(folder / "model.safetensors").items():
        values = tensor.to(torch.float32).numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            values = permute(values, heads if "q_proj" in name else kv_heads)
        kind = next((t for part, t in (mixed or {}).items() if part in name), qtype)
        add_tensor(writer, gguf_name(name), values, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
