"""Tokenizer behaviour against transformers' AutoTokenizer on the same folder, and the
token-count floor that refuses a text too long to fit before tokenizing it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jinja2
import pytest
from tokenizers import Tokenizer as HFTokenizer
from transformers import AutoTokenizer

from kvgate.engine.errors import TooManyTokens
from kvgate.engine.tokenization.tokenizer import GIL_FREE_CHARS, Tokenizer, max_token_bytes

TEXTS = [
    "",
    "Hello, world!",
    "  leading and trailing spaces  ",
    "The quick brown fox.\nNew line\tand tab",
    "Größe 你好 😀 🚀 → ∞",
    "special <s> and </s> and <|im_start|> inside text",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello. 😀"},
    {"role": "user", "content": "Größe?"},
]


@pytest.fixture(scope="module")
def pair(tiny_model_dir: Path) -> tuple[Tokenizer, object]:
    return Tokenizer.from_dir(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)


def _variant(tiny_model_dir: Path, tmp_path: Path, **config_changes: object) -> Path:
    path = tmp_path / "tok"
    path.mkdir()
    shutil.copy(tiny_model_dir / "tokenizer.json", path / "tokenizer.json")
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    config.update(config_changes)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers(pair, text: str, add_special_tokens: bool) -> None:
    ours, theirs = pair
    expected = theirs(text, add_special_tokens=add_special_tokens).input_ids
    assert ours.encode(text, add_special_tokens=add_special_tokens) == expected


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip", [True, False])
def test_decode_matches_transformers(pair, text: str, skip: bool) -> None:
    ours, theirs = pair
    ids = theirs(text).input_ids
    assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
        ids, skip_special_tokens=skip
    )


@pytest.mark.parametrize("post_processor", [True, False])
def test_special_tokens_come_from_tokenizer_json(
    tiny_model_dir: Path, tmp_path: Path, post_processor: bool
) -> None:
    path = _variant(tiny_model_dir, tmp_path, add_bos_token=False, add_eos_token=True)
    if not post_processor:
        spec = json.loads((path / "tokenizer.json").read_text())
        spec["post_processor"] = None
        (path / "tokenizer.json").write_text(json.dumps(spec))
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    ids = ours.encode("Hello there")
    assert ids == theirs("Hello there").input_ids
    assert (ids[0] == ours.bos_token_id) == post_processor


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(pair, add_generation_prompt: bool) -> None:
    ours, theirs = pair
    expected = theirs.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    rendered = ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
    assert rendered == expected
    ids = theirs.apply_chat_template(
        CONVERSATION, tokenize=True, add_generation_prompt=add_generation_prompt
    )
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ours.encode_chat(CONVERSATION, add_generation_prompt=add_generation_prompt) == list(ids)


def test_template_features_match_transformers(tiny_model_dir: Path, tmp_path: Path) -> None:
    template = (
        "{%- for m in messages %}\n"
        "  {%- if loop.index > 3 %}{% break %}{% endif %}\n"
        "  [{{ m.role | upper }}] {{ m | tojson }}{{ eos_token }}\n"
        "{%- endfor %}\n"
        "{% if add_generation_prompt %}[ASSISTANT]{% endif %}"
    )
    path = _variant(tiny_model_dir, tmp_path, chat_template=template)
    ours, theirs = Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)
    expected = theirs.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(CONVERSATION) == expected


def test_template_raise_exception(pair) -> None:
    ours, _ = pair
    with pytest.raises(ValueError, match="unknown role: robot") as caught:
        ours.apply_chat_template([{"role": "robot", "content": "beep"}])
    assert isinstance(caught.value.__cause__, jinja2.TemplateError)


def test_vocab_and_eos(pair) -> None:
    ours, theirs = pair
    assert ours.vocab_size == len(theirs)
    assert ours.eos_token_ids == [theirs.eos_token_id]
    assert ours.bos_token_id == theirs.bos_token_id


@pytest.mark.parametrize("with_prompt", [False, True])
def test_incremental_detokenizer_never_splits_characters(pair, with_prompt: bool) -> None:
    ours, _ = pair
    prompt = ours.encode("Prompt: ")
    text = "Größe 你好世界 😀🚀 done → ∞ ok"
    ids = ours.encode(text, add_special_tokens=False)
    # Byte-level BPE splits some characters over several tokens: the test needs that case.
    assert any("\ufffd" in ours.decode(ids[:i]) for i in range(1, len(ids)))
    stream = ours.incremental(prompt if with_prompt else None)
    pieces = [stream.push([token]) for token in ids]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) + stream.flush() == text


def test_incremental_flush_releases_an_incomplete_tail(pair) -> None:
    ours, _ = pair
    ids = ours.encode("😀", add_special_tokens=False)
    partial = next(i for i in range(1, len(ids) + 1) if "\ufffd" in ours.decode(ids[:i]))
    stream = ours.incremental()
    assert stream.push(ids[:partial]) == ""
    assert stream.flush() == ours.decode(ids[:partial])


class CountingBackend:
    """The HF tokenizer, counting the calls that tokenize."""

    def __init__(self, backend: object) -> None:
        self.backend, self.calls = backend, 0

    def encode(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        return self.backend.encode(*args, **kwargs)  # type: ignore[attr-defined]

    def encode_batch(self, *args: object, **kwargs: object) -> object:
        self.calls += 1
        return self.backend.encode_batch(*args, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.backend, name)


def _spec(tiny_model_dir: Path) -> dict:
    return json.loads((tiny_model_dir / "tokenizer.json").read_text())


def test_no_token_stands_for_more_bytes_than_max_token_bytes(pair) -> None:
    ours, _ = pair
    assert ours.max_token_bytes == len("<|im_start|>")  # the longest entry, a special token
    longest = max(
        len(ours.decode([i], skip_special_tokens=False).encode()) for i in range(ours.vocab_size)
    )
    assert longest <= ours.max_token_bytes


@pytest.mark.parametrize("text", [*TEXTS, "word " * 5000, "ab" * 3000, "😀" * 700, "\n" * 900])
def test_min_tokens_is_a_floor(pair, text: str) -> None:
    ours, _ = pair
    assert ours.min_tokens(text) <= len(ours.encode(text, add_special_tokens=False))


def test_a_text_that_cannot_fit_is_refused_without_tokenizing(pair) -> None:
    ours, _ = pair
    counting = CountingBackend(ours.backend)
    tokenizer = Tokenizer(counting, {}, ours.chat_template)  # type: ignore[arg-type]
    text = "x" * (12 * 100 + 1)  # 1201 bytes: at least 101 tokens of at most 12 bytes
    with pytest.raises(TooManyTokens, match="at least 101 tokens") as refused:
        tokenizer.encode(text, max_tokens=100)
    assert refused.value.at_least == 101 and refused.value.limit == 100
    assert counting.calls == 0
    assert tokenizer.encode(text, max_tokens=101) == ours.encode(text)  # a floor, not a count
    assert counting.calls == 1
    with pytest.raises(TooManyTokens):
        tokenizer.encode_chat([{"role": "user", "content": text}], max_tokens=100)
    assert counting.calls == 1


def test_long_texts_tokenize_as_short_ones_do(pair) -> None:
    ours, _ = pair
    text = "Größe 你好 😀 fox " * 2000  # past GIL_FREE_CHARS: encode_batch, the GIL released
    assert len(text) > GIL_FREE_CHARS
    for special in (True, False):
        expected = ours.backend.encode(text, add_special_tokens=special).ids
        assert ours.encode(text, add_special_tokens=special) == expected


@pytest.mark.parametrize(
    "change",
    [
        {"model": {"type": "WordPiece", "vocab": {"a": 0}}},
        {"pre_tokenizer": {"type": "Whitespace"}},  # drops the spaces it splits on
        {"pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed"}},
        {"normalizer": {"type": "StripAccents"}},
        {"normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": ""}},
        {"normalizer": {"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}},
        {"truncation": {"max_length": 8}},
    ],
)
def test_no_floor_where_the_pipeline_can_drop_input(tiny_model_dir: Path, change: dict) -> None:
    spec = _spec(tiny_model_dir) | change
    assert max_token_bytes(spec) is None


def test_no_floor_when_an_added_token_strips_whitespace(tiny_model_dir: Path) -> None:
    spec = _spec(tiny_model_dir)
    spec["added_tokens"][0]["rstrip"] = True  # it would swallow any run of spaces after it
    assert max_token_bytes(spec) is None


def test_no_floor_when_unknown_characters_fuse(tiny_model_dir: Path) -> None:
    spec = _spec(tiny_model_dir)
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}
    spec["model"] |= {"unk_token": "<s>", "fuse_unk": True, "byte_fallback": False}
    assert max_token_bytes(spec) is None  # one token for any run of unknown characters
    spec["model"]["fuse_unk"] = False  # one per unknown character: at most 4 bytes
    assert max_token_bytes(spec) == max(len(t.encode()) for t in spec["model"]["vocab"])


def test_byte_level_as_a_normalizer_counts_one_byte_per_character(tiny_model_dir: Path) -> None:
    spec = _spec(tiny_model_dir)
    spec["normalizer"], spec["pre_tokenizer"] = spec["pre_tokenizer"], None
    spec["normalizer"] |= {"type": "ByteLevel"}
    assert max_token_bytes(spec) == 12
    tokenizer = Tokenizer(HFTokenizer.from_str(json.dumps(spec)), {}, None)
    for text in TEXTS[1:] + ["Größe 你好 😀 " * 100, " clockmaker" * 100]:
        assert 0 < tokenizer.min_tokens(text) <= len(tokenizer.encode(text))


def test_a_shrinking_normalizer_loosens_the_floor_enough(tiny_model_dir: Path) -> None:
    """NFKC maps "𝐜" (4 bytes) to "c" (1 byte): " 𝐜𝐥𝐨𝐜𝐤𝐦𝐚𝐤𝐞𝐫" (41 bytes) is one token,
    more than the longest token's 12 bytes; the floor allows for it, and stays one."""
    spec = _spec(tiny_model_dir) | {
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}]}
    }
    assert max_token_bytes(spec) == 4 * 12
    tokenizer = Tokenizer(HFTokenizer.from_str(json.dumps(spec)), {}, None)
    bold = " 𝐜𝐥𝐨𝐜𝐤𝐦𝐚𝐤𝐞𝐫" * 200
    assert len(bold.encode()) / 12 > len(tokenizer.encode(bold))  # unnormalized bytes mislead
    for text in (bold, "𝐀" * 500, "Ａ" * 500, "e\u0301" * 500, "word " * 500):
        assert tokenizer.min_tokens(text) <= len(tokenizer.encode(text))
