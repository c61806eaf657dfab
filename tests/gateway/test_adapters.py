"""``--lora-modules`` in both of vLLM's forms, and what enables the runtime endpoints."""

from __future__ import annotations

import json

import pytest

from kvgate.gateway.adapters import LoRAModule, parse_lora_module, runtime_updating
from kvgate.gateway.cli import build_parser, engine_lora, settings_from_args
from kvgate.gateway.settings import Settings


def test_lora_modules_take_vllms_space_separated_form_and_imply_enable_lora() -> None:
    args = build_parser().parse_args(
        ["serve", "--lora-modules", "a=/x/a", "b=/x/b", "--max-loras", "2"]
    )
    settings = settings_from_args(args)
    assert settings.lora_modules == ("a=/x/a", "b=/x/b")
    assert engine_lora(settings) == {"enable_lora": True, "max_lora_rank": 16, "max_loras": 2}
    assert engine_lora(Settings())["enable_lora"] is False


def test_both_module_forms_parse() -> None:
    assert parse_lora_module("sql=/adapters/sql", "base") == LoRAModule("sql", "/adapters/sql")
    spec = json.dumps({"name": "sql", "path": "/a", "base_model_name": "base"})
    assert parse_lora_module(spec, "base") == LoRAModule("sql", "/a")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("sql", "give NAME=PATH"),
        ("=/a", "give NAME=PATH"),
        ('{"name": "sql"}', "give NAME=PATH"),
        ('{"name": "sql", "path": "/a", "base_model_name": "other"}', "is not the model served"),
        ("{nope", "not JSON"),
        ("base=/a", "the base model's own name"),
    ],
)
def test_a_bad_module_is_refused_naming_it(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_lora_module(spec, "base")


def test_runtime_updating_follows_the_flag_or_vllms_variable() -> None:
    assert not runtime_updating(Settings(), {})
    assert runtime_updating(Settings(), {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
    assert not runtime_updating(Settings(), {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "False"})
    assert runtime_updating(Settings(allow_runtime_lora_updating=True), {})
