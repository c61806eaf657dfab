"""A GGUF file's vocabulary as the engine's `Tokenizer` (a `tokenizers` pipeline).

A GGUF has no `tokenizer.json`: it stores llama.cpp's `tokenizer.ggml.*` metadata (the model
kind, tokens, merges or scores, token types, special ids, add-BOS flag) and the chat template.
The pipelines rebuilt here are the ones transformers' GGUF loader builds
(`integrations/gguf/gguf_tokenizer_mapping.py`): byte-level BPE for ``gpt2`` (GPT-2's
splitting unless ``tokenizer.ggml.pre`` names another), SentencePiece-style BPE with byte
fallback for ``llama``. Control tokens (type 3) become special added tokens, user-defined ones
(type 4) plain added tokens, so both stay whole. One deliberate difference: ``pre = smollm``
splits digits one by one, as llama.cpp and SmolLM's own `tokenizer.json` do (transformers
falls back to GPT-2's splitting there).
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend

from kvgate.engine.errors import ModelLoadError
from kvgate.engine.loading.gguf.metadata import field_value
from kvgate.engine.tokenization.tokenizer import Tokenizer

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the text splitting its merges were learned on (others: GPT-2's).
SPLITS = {
    "llama3": LLAMA3_SPLIT,
    "llama-v3": LLAMA3_SPLIT,
    "llama-bpe": LLAMA3_SPLIT,
    "smaug-bpe": LLAMA3_SPLIT,
    "qwen2": QWEN2_SPLIT,
    "deepseek-r1-qwen": QWEN2_SPLIT,
}
SPECIAL_IDS = {
    "bos_token": "bos",
    "eos_token": "eos",
    "unk_token": "unknown",
    "pad_token": "padding",
}


def gguf_tokenizer(reader: GGUFReader) -> Tokenizer:
    kind = field_value(reader, "tokenizer.ggml.model")
    tokens: list[str] = field_value(reader, "tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError("the GGUF file has no vocabulary (tokenizer.ggml.tokens)")
    types: list[int] = field_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [_pair(m) for m in field_value(reader, "tokenizer.ggml.merges") or []]
    config = _special_tokens(reader, tokens)
    if kind == "gpt2":
        backend = _byte_level(tokens, merges, field_value(reader, "tokenizer.ggml.pre"))
        add_bos = field_value(reader, "tokenizer.ggml.add_bos_token", False)
        alphabet = set(pre_tokenizers.ByteLevel.alphabet())
        control = [
            t for t, k in zip(tokens, types, strict=True) if k == CONTROL and set(t) <= alphabet
        ]
    elif kind == "llama":
        scores = field_value(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
        prefix = bool(field_value(reader, "tokenizer.ggml.add_space_prefix", True))
        backend = _sentencepiece(tokens, merges or _merges_from_scores(tokens, scores), prefix)
        add_bos = field_value(reader, "tokenizer.ggml.add_bos_token", True)
        control = [t for t, k in zip(tokens, types, strict=True) if k == CONTROL]
    else:
        raise ModelLoadError(
            f"unsupported GGUF tokenizer {kind!r} (tokenizer.ggml.model); supported: gpt2, llama"
        )
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    user = [t for t, k in zip(tokens, types, strict=True) if k == USER_DEFINED]
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    bos = config.get("bos_token")
    if add_bos and bos is not None:
        bos_id = tokens.index(bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    return Tokenizer(backend, config, _chat_templates(reader))


def _pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def _special_tokens(reader: GGUFReader, tokens: list[str]) -> dict[str, Any]:
    config: dict[str, Any] = {}
    for name, key in SPECIAL_IDS.items():
        token_id = field_value(reader, f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and 0 <= token_id < len(tokens):
            config[name] = tokens[token_id]
    return config


def _byte_level(tokens: list[str], merges: list[tuple[str, str]], pre: str | None) -> Backend:
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Backend(models.BPE(vocab, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=pre not in SPLITS)
    if pre in SPLITS:
        split = pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated")
        backend.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "smollm":
        digits = pre_tokenizers.Digits(individual_digits=True)
        backend.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece(tokens: list[str], merges: list[tuple[str, str]], prefix: bool) -> Backend:
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = models.BPE(vocab, merges, fuse_unk=True, byte_fallback=True, unk_token=tokens[0])
    backend = Backend(bpe)
    scheme = "first" if prefix else "never"
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges a SentencePiece vocabulary implies: every split of a token into two tokens,
    best score first (transformers' `generate_merges`)."""
    vocab = {token: i for i, token in enumerate(tokens)}
    found: list[tuple[str, str, float]] = []
    for token, score in zip(tokens, scores, strict=True):
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        pairs = sorted(
            (p for p in pairs if p[0] in vocab and p[1] in vocab),
            key=lambda p: (vocab[p[0]], vocab[p[1]]),
        )
        found.extend((left, right, score) for left, right in pairs)
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _chat_templates(reader: GGUFReader) -> str | dict[str, str] | None:
    """`tokenizer.chat_template`, plus named ones (`tokenizer.chat_template.tool_use`)."""
    default = field_value(reader, "tokenizer.chat_template")
    prefix = "tokenizer.chat_template."
    named = {
        k[len(prefix) :]: f.contents() for k, f in reader.fields.items() if k.startswith(prefix)
    }
    if not named:
        return default  # type: ignore[no-any-return]
    return {"default": default, **named} if default is not None else named
