"""What a model folder and the engine options decide beyond the weights: the context bound
(`max_model_len`), generation_config.json (EOS ids, sampling defaults), and chat templates
with tools and template variables through `LLM.chat` and `AsyncLLM`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from kvgate.engine import LLM, AsyncLLM, SamplingParams
from kvgate.engine.loading.loader import load_model
from tests.engine.tokenization.test_chat_templates import TEMPLATES, TOOL_TURN_TEXT, WEATHER


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_json(path: Path, **changes: object) -> None:
    data = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**data, **changes}))


def test_max_model_len_sizes_rope_tables_and_admission(hf_checkpoint, tmp_path: Path) -> None:
    """A Mistral-Nemo-like config claims 1,024,000 positions; the engine computes 256."""
    path = _copy(hf_checkpoint("mistral"), tmp_path / "nemo")
    _edit_json(path / "config.json", max_position_embeddings=1_024_000, sliding_window=None)
    lm = load_model(path, dtype="float32", max_model_len=256)
    assert lm.config.max_model_len == 256 and lm.model.rope_cos_0.shape[0] == 256
    llm = LLM(str(path), dtype="float32", kv_cache_memory="4MiB", max_model_len=256)
    assert llm.core.max_model_len == 256
    with pytest.raises(ValueError, match="max_model_len 256"):
        llm.generate([list(range(10, 266))], SamplingParams(max_tokens=2))
    out = llm.generate([list(range(10, 250))], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.prompt_token_ids) + len(out.token_ids) == 256  # stopped at the bound


def test_generation_config_defaults_and_eos_ids(tiny_model_dir: Path, tmp_path: Path) -> None:
    path = _copy(tiny_model_dir, tmp_path / "gen")
    prompt = list(range(40, 60))
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    tokens = LLM(str(path), dtype="float32").generate([prompt], greedy)[0].token_ids
    stop_at = tokens[3]
    config = json.loads((path / "config.json").read_text())
    _edit_json(
        path / "generation_config.json",
        eos_token_id=[config["eos_token_id"], stop_at],
        temperature=0.0,
        top_k=5,
    )
    llm = LLM(str(path), dtype="float32")
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k, defaults.top_p) == (0.0, 5, 1.0)
    out = llm.generate([prompt])[0]  # no params: greedy from generation_config
    assert out.token_ids == tokens[: tokens.index(stop_at) + 1]
    assert out.finish_reason == "stop"
    assert (
        SamplingParams.from_dict({"temperature": 0.5}, {"temperature": 0.0, "top_k": 5}).temperature
        == 0.5
    )


@pytest.fixture
def qwen3_chat_model(tiny_model_dir: Path, tmp_path: Path) -> Path:
    path = _copy(tiny_model_dir, tmp_path / "chat")
    template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    _edit_json(path / "tokenizer_config.json", chat_template=template)
    return path


def test_llm_chat_passes_tools_and_template_variables(qwen3_chat_model: Path) -> None:
    llm = LLM(str(qwen3_chat_model), dtype="float32")
    reference = AutoTokenizer.from_pretrained(qwen3_chat_model)
    params = SamplingParams(max_tokens=2, temperature=0)
    out = llm.chat(
        TOOL_TURN_TEXT, params, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False}
    )[0]
    expected = reference.apply_chat_template(
        TOOL_TURN_TEXT, tools=[WEATHER], enable_thinking=False, add_generation_prompt=True,
        return_dict=False,
    )  # fmt: skip
    assert out.prompt_token_ids == list(expected)
    plain = llm.chat(TOOL_TURN_TEXT, params)[0]
    assert plain.prompt_token_ids != out.prompt_token_ids


async def test_async_llm_chat_template_takes_tools(qwen3_chat_model: Path) -> None:
    engine = AsyncLLM(model=str(qwen3_chat_model), dtype="float32", kv_cache_memory="4MiB")
    try:
        ids = engine.apply_chat_template(
            TOOL_TURN_TEXT, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False}
        )
        assert ids == engine.tokenizer.encode_chat(
            TOOL_TURN_TEXT, tools=[WEATHER], chat_template_kwargs={"enable_thinking": False}
        )
        assert "get_weather" in engine.tokenizer.decode(ids)
        assert engine.default_sampling_fields == {}
    finally:
        engine.shutdown()
