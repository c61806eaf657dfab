"""GGUF metadata -> ModelConfig for each family served, and the vocabulary kinds -> Tokenizer,
on metadata-only files written with gguf.GGUFWriter."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter, RopeScalingType, TokenType

from kvgate.engine.errors import ModelLoadError
from kvgate.engine.loading.gguf.metadata import model_config
from kvgate.engine.loading.gguf.vocab import gguf_tokenizer

Fill = Callable[[GGUFWriter], None]


def sizes(writer: GGUFWriter) -> None:
    writer.add_block_count(3)
    writer.add_context_length(4096)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(512)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(500000.0)
    writer.add_vocab_size(1000)


def read(tmp_path: Path, arch: str, *fills: Fill, output: bool = True) -> GGUFReader:
    writer = GGUFWriter(tmp_path / f"{arch}.gguf", arch)
    for fill in fills:
        fill(writer)
    if output:
        writer.add_tensor("output.weight", np.zeros((2, 2), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return GGUFReader(tmp_path / f"{arch}.gguf")


def test_llama_metadata_maps_to_the_config(tmp_path: Path) -> None:
    def ids(writer: GGUFWriter) -> None:
        writer.add_eos_token_id(7)
        writer.add_eot_token_id(9)
        writer.add_bos_token_id(1)
        writer.add_file_type(15)  # Q4_K_M
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(2.0)

    config = model_config(read(tmp_path, "llama", sizes, ids))
    assert config.architecture == "LlamaForCausalLM"
    assert (config.num_layers, config.hidden_size, config.intermediate_size) == (3, 256, 512)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (8, 2, 32)
    assert (config.max_model_len, config.rope_theta, config.vocab_size) == (4096, 500000.0, 1000)
    assert config.rms_norm_eps == pytest.approx(1e-6)
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.eos_token_ids == [7, 9] and config.bos_token_id == 1
    assert config.torch_dtype == "bfloat16" and not config.tie_word_embeddings


def test_qwen_families_keep_their_structure(tmp_path: Path) -> None:
    qwen2 = model_config(read(tmp_path, "qwen2", sizes, output=False))
    assert qwen2.architecture == "Qwen2ForCausalLM" and qwen2.attention_bias
    assert qwen2.tie_word_embeddings  # no output.weight: tied, as llama.cpp writes it

    def head_dim(writer: GGUFWriter) -> None:
        writer.add_key_length(64)

    qwen3 = model_config(read(tmp_path, "qwen3", sizes, head_dim))
    assert qwen3.architecture == "Qwen3ForCausalLM" and qwen3.qk_norm
    assert qwen3.head_dim == 64 and not qwen3.attention_bias


def test_missing_or_per_layer_sizes_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"GGUF metadata lacks llama.block_count"):
        model_config(read(tmp_path, "llama"))

    def per_layer(writer: GGUFWriter) -> None:
        writer.add_array("qwen2.attention.head_count_kv", [2, 0, 2])

    with pytest.raises(
        ModelLoadError, match=r"unsupported per-layer qwen2.attention.head_count_kv"
    ):
        model_config(read(tmp_path, "qwen2", sizes, per_layer))


def test_a_sentencepiece_vocabulary_merges_by_score(tmp_path: Path) -> None:
    tokens = ["<unk>", "<s>", "</s>", "▁", "h", "e", "l", "o", "he", "ll", "▁he", "llo", "▁hello"]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    scores = [0.0] * 3 + [-10.0] * 5 + [-3.0, -2.0, -1.5, -1.0, -0.5] + [0.0] * 256
    kinds = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.NORMAL] * 10
    kinds += [TokenType.BYTE] * 256

    def vocab(writer: GGUFWriter) -> None:
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(kinds)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)

    tokenizer = gguf_tokenizer(read(tmp_path, "llama", vocab))
    ids = tokenizer.encode("hello hel!")
    assert [tokens[i] for i in ids] == ["<s>", "▁hello", "▁he", "l", "<0x21>"]
    assert tokenizer.decode(ids) == "hello hel!"
    assert tokenizer.encode("</s>", add_special_tokens=False) == [2]  # control tokens stay whole
    assert tokenizer.eos_token_ids == [2] and tokenizer.bos_token_id == 1


def test_a_byte_level_vocabulary_keeps_chat_templates_and_added_tokens(tmp_path: Path) -> None:
    tokens = ["<|end|>", "<think>", "a", "b", "ab", "Ġ", "Ġab"]

    def vocab(writer: GGUFWriter) -> None:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("qwen2")
        writer.add_token_list(tokens)
        kinds = [TokenType.CONTROL, TokenType.USER_DEFINED] + [TokenType.NORMAL] * 5
        writer.add_token_types(kinds)
        writer.add_token_merges(["a b", "Ġ ab"])
        writer.add_eos_token_id(0)
        writer.add_chat_template("{{ messages[0]['content'] }}{{ eos_token }}")
        writer.add_string("tokenizer.chat_template.tool_use", "tools: {{ tools | length }}")

    tokenizer = gguf_tokenizer(read(tmp_path, "qwen2", vocab))
    assert tokenizer.encode("ab<think> ab<|end|>") == [4, 1, 6, 0]  # no BOS: none asked for
    assert tokenizer.decode([4, 1, 6, 0]) == "ab<think> ab"
    messages = [{"role": "user", "content": "x"}]
    assert tokenizer.apply_chat_template(messages) == "x<|end|>"
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert tokenizer.apply_chat_template(messages, tools=tools) == "tools: 1"


def test_an_unsupported_vocabulary_kind_names_it(tmp_path: Path) -> None:
    def vocab(writer: GGUFWriter) -> None:
        writer.add_tokenizer_model("bert")
        writer.add_token_list(["[CLS]"])

    with pytest.raises(ModelLoadError, match=r"unsupported GGUF tokenizer 'bert'"):
        gguf_tokenizer(read(tmp_path, "llama", vocab))
