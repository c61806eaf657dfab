"""Real published chat templates (tests/engine/chat_templates, sources in SOURCES.md)
rendered by kvgate and by transformers' AutoTokenizer on the same folder: the same text and
the same token ids, for plain chats, tools, tool calls and results, documents, reasoning,
content parts and template variables. Where transformers refuses an input (a template's
raise_exception, or a shape it cannot render), kvgate must refuse it too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from kvgate.engine.tokenization.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "chat_templates"
NAMES = sorted(p.stem for p in TEMPLATES.glob("*.jinja"))

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
    },
}
CALL = {
    "id": "call12345",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}},
}
PLAIN = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello. 😀"},
    {"role": "user", "content": "Größe?"},
]
TOOL_TURN = [
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},  # as OpenAI clients send it
    {"role": "tool", "tool_call_id": "call12345", "name": "get_weather", "content": '{"temp": 21}'},
    {"role": "user", "content": "And tomorrow?"},
]
# The same turn as other clients send it: empty content, arguments as a JSON string.
TOOL_TURN_TEXT = [{**m, "content": ""} if m.get("tool_calls") else m for m in TOOL_TURN]
TOOL_TURN_TEXT[2]["tool_calls"] = [
    {
        **CALL,
        "function": {**CALL["function"], "arguments": json.dumps(CALL["function"]["arguments"])},
    }
]
THINKING = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4", "reasoning_content": "Add two and two."},
    {"role": "user", "content": "And 3+3?"},
]
PARTS = [
    {
        "role": "user",
        "content": [{"type": "text", "text": "Describe "}, {"type": "text", "text": "this."}],
    },
]
DOCUMENTS = [
    {"title": "Tides", "text": "The tide rises twice a day."},
    {"title": "Moon", "text": "The moon pulls the sea."},
]
CASES: dict[str, dict[str, Any]] = {
    "plain": dict(messages=PLAIN),
    "plain-no-prompt": dict(messages=PLAIN, add_generation_prompt=False),
    "tools": dict(messages=PLAIN[1:], tools=[WEATHER, SEARCH]),
    "tool-calls": dict(messages=TOOL_TURN, tools=[WEATHER]),
    "tool-calls-text": dict(messages=TOOL_TURN_TEXT, tools=[WEATHER]),
    "thinking-off": dict(messages=THINKING, kwargs={"enable_thinking": False}),
    "thinking-on": dict(messages=THINKING, kwargs={"enable_thinking": True}),
    "variables": dict(
        messages=TOOL_TURN,
        tools=[WEATHER],
        kwargs={
            "date_string": "01 Dec 2026",
            "tools_in_user_message": False,
            "reasoning_effort": "high",
            "builtin_tools": ["browser"],
        },
    ),  # fmt: skip
    "documents": dict(messages=PLAIN[1:], documents=DOCUMENTS),
    "content-parts": dict(messages=PARTS),
}


def _folder(tiny_model_dir: Path, tmp_path: Path, chat_template: Any) -> Path:
    path = tmp_path / "tok"
    path.mkdir(exist_ok=True)
    shutil.copy(tiny_model_dir / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def _compare(ours: Tokenizer, theirs: Any, case: dict[str, Any]) -> str:
    """Render one case both ways; returns transformers' text (or "" when both refused)."""
    messages = case["messages"]
    options = dict(
        add_generation_prompt=case.get("add_generation_prompt", True),
        tools=case.get("tools"),
        documents=case.get("documents"),
    )
    kwargs = case.get("kwargs", {})
    try:
        expected = theirs.apply_chat_template(messages, tokenize=False, **options, **kwargs)
    except Exception:  # noqa: BLE001 - any refusal: kvgate must refuse as well
        with pytest.raises(Exception):  # noqa: B017, PT011
            ours.apply_chat_template(messages, chat_template_kwargs=kwargs, **options)
        return ""
    assert ours.apply_chat_template(messages, chat_template_kwargs=kwargs, **options) == expected
    ids = theirs.apply_chat_template(
        messages, tokenize=True, return_dict=False, **options, **kwargs
    )
    assert ours.encode_chat(messages, chat_template_kwargs=kwargs, **options) == list(ids)
    return expected


@pytest.mark.parametrize("name", NAMES)
def test_published_template_matches_transformers(
    name: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    path = _folder(tiny_model_dir, tmp_path, template)
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    rendered = {label: _compare(ours, theirs, case) for label, case in CASES.items()}
    assert rendered["plain"] or rendered["tools"], f"{name} rendered neither a chat nor tools"
    if "tools" in template:
        assert "get_weather" in rendered["tools"] + rendered["tool-calls"]


def test_qwen3_tools_thinking_and_tool_results_are_rendered(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The inputs reach the template: not only equal to transformers, but present."""
    template = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text(encoding="utf-8")
    ours = Tokenizer.from_dir(_folder(tiny_model_dir, tmp_path, template))
    # Qwen3's template reads the assistant's content even beside tool calls.
    turn = [{**m, "content": m["content"] or ""} for m in TOOL_TURN]
    text = ours.apply_chat_template(turn, tools=[WEATHER])
    assert '"name": "get_weather"' in text and "<tool_call>" in text
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in text
    off = ours.apply_chat_template(THINKING, chat_template_kwargs={"enable_thinking": False})
    assert off.endswith("<think>\n\n</think>\n\n")
    assert not ours.apply_chat_template(THINKING).endswith("</think>\n\n")


def test_named_templates_pick_tool_use_when_tools_are_given(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    tool_use = (TEMPLATES / "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja").read_text()
    default = (TEMPLATES / "Qwen-Qwen2.5-7B-Instruct.jinja").read_text()
    named = [{"name": "default", "template": default}, {"name": "tool_use", "template": tool_use}]
    path = _folder(tiny_model_dir, tmp_path, named)
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    with_tools = _compare(ours, theirs, CASES["tool-calls"])
    without = _compare(ours, theirs, CASES["plain"])
    assert "<tools>" in with_tools and "get_weather" in with_tools
    assert "<tools>" not in without
    chosen = ours.apply_chat_template(PLAIN, template="tool_use", tools=[])
    assert chosen == theirs.apply_chat_template(PLAIN, chat_template="tool_use", tools=[],
                                                tokenize=False, add_generation_prompt=True)  # fmt: skip
    assert "<tools>" in chosen
    with pytest.raises(ValueError, match="no template named 'rag'"):
        ours.apply_chat_template(PLAIN, template="rag")


def test_template_inputs_are_not_modified(tiny_model_dir: Path, tmp_path: Path) -> None:
    template = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text(encoding="utf-8")
    ours = Tokenizer.from_dir(_folder(tiny_model_dir, tmp_path, template))
    messages = json.loads(json.dumps(TOOL_TURN))
    ours.apply_chat_template(messages, tools=[WEATHER])
    assert messages == TOOL_TURN and messages[2]["content"] is None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(messages=[]), "messages"),
        (dict(messages=["hi"]), r"messages\[0\]"),
        (dict(messages=PLAIN, tools=["get_weather"]), "tools"),
        (dict(messages=PLAIN, documents=[1]), "documents"),
        (dict(messages=PLAIN, chat_template_kwargs={"tools": 5}), "template rejected them"),
    ],
)
def test_bad_chat_inputs_are_named(pair_tokenizer: Tokenizer, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pair_tokenizer.apply_chat_template(**options)


@pytest.fixture
def pair_tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)
