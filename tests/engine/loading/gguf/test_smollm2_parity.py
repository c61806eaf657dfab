"""The real SmolLM2-135M-Instruct GGUF (tests/real_model.py): kvgate's greedy answers, prompt
tokens and rendered chat template equal transformers' own GGUF loader on the same file
(dequantized, fp32), with the weights dequantized at load and kept quantized (int16
activations per 32-block: see kvgate/engine/models/quant/qgemm.cpp)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from tests.real_model import smollm2_file

transformers = pytest.importorskip("transformers")

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a CPU does in one sentence.",
    "Name three colors of the rainbow.",
    "How do I boil an egg?",
]


@pytest.fixture(scope="module")
def gguf_file() -> Path:
    return smollm2_file()


@pytest.fixture(scope="module")
def reference(gguf_file: Path) -> Iterator[tuple[Any, Any]]:
    folder, name = str(gguf_file.parent), gguf_file.name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    yield model, tokenizer


@pytest.mark.slow  # two loads of a 135M model, 5 x 32 greedy tokens through transformers
@pytest.mark.parametrize("dequantize", [True, False], ids=["dequantized", "quantized"])
def test_greedy_answers_equal_transformers(
    gguf_file: Path, reference: tuple[Any, Any], dequantize: bool
) -> None:
    model, hf_tokenizer = reference
    llm = LLM(str(gguf_file), dtype="float32", kv_cache_memory="32MiB", gguf_dequantize=dequantize)
    chats = [[{"role": "user", "content": prompt}] for prompt in PROMPTS]
    prompts = [llm.tokenizer.encode_chat(chat) for chat in chats]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0))
    for chat, prompt, output in zip(chats, prompts, outputs, strict=True):
        text = hf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == llm.tokenizer.apply_chat_template(chat)  # the template from the metadata
        assert hf_tokenizer(text, add_special_tokens=False)["input_ids"] == prompt
        with torch.no_grad():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
        assert output.token_ids == expected[0, len(prompt) :].tolist(), output.text
    assert "Paris" in outputs[0].text
