"""Constrained outputs are valid UTF-8: the guard's tables against Python's own decoder, and a
grammar's mask after a token ending on ``ED`` (where xgrammar alone let a surrogate through:
``'paily���'`` for a six-character name)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgate.engine import LLM
from kvgate.engine.sampling.structured import GrammarCache, fill_bitmask
from kvgate.engine.sampling.utf8_guard import NEVER, Utf8Guard, invalid_inside
from kvgate.engine.sampling_params import StructuredOutputs


def _completable(prefix: bytes) -> bool:
    """Whether some valid UTF-8 text starts with ``prefix`` (a lead byte and one more)."""
    lead = prefix[0]
    length = 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    tail = b"\x80" if length > 2 and prefix[1] != 0x80 else b"\xa0"  # any continuation will do
    try:
        (prefix + tail * (length - 2)).decode("utf-8")
    except UnicodeDecodeError:
        try:  # the other continuation range, for leads whose third byte is free
            (prefix + b"\xbf" * (length - 2)).decode("utf-8")
        except UnicodeDecodeError:
            return False
    return True


@pytest.mark.parametrize("lead", range(0xC0, 0x100))
def test_a_lead_and_its_second_byte_are_refused_exactly_when_no_text_starts_so(lead: int) -> None:
    for second in range(0x80, 0xC0):
        pair = bytes([lead, second])
        assert invalid_inside(pair) == (not _completable(pair)), pair.hex()


def test_the_bytes_no_text_holds_are_the_never_set() -> None:
    for byte in range(256):
        starts = any(_completable(bytes([byte, s])) for s in range(0x80, 0xC0))
        assert (byte in NEVER) == (byte >= 0xC0 and not starts), hex(byte)


def _allowed(mask: torch.Tensor, token_id: int) -> bool:
    return bool((int(mask[token_id // 32]) >> (token_id % 32)) & 1)


def test_the_masks_are_xgrammars_bit_layout_and_follow_the_lead() -> None:
    vocab = [b"a", b"\xed", b"\xa0x", b"\x9f", b"\xc0", b"", b"\xed\xbf"] + [b"z"] * 30
    guard = Utf8Guard(vocab, len(vocab))
    assert [_allowed(guard.masks[0], t) for t in range(7)] == [1, 1, 1, 1, 0, 1, 0]
    assert [_allowed(guard.masks[0xED], t) for t in range(7)] == [1, 1, 0, 1, 0, 1, 0]
    assert all(_allowed(guard.masks[0xED], t) for t in range(7, len(vocab)))
    assert guard.lead_after(1) == 0xED and guard.lead_after(0) == 0 and guard.lead_after(99) == 0


def test_after_a_token_ending_on_ed_no_surrogate_second_byte_is_allowed(
    tiny_model_dir: Path,
) -> None:
    llm = LLM(str(tiny_model_dir), dtype="float32", kv_cache_memory="4MiB")
    core = llm.core
    cache = GrammarCache(core.tokenizer, core.model_config.vocab_size, [0])
    state = cache.state(StructuredOutputs(json={"type": "string", "maxLength": 6}))
    token_bytes = cache.token_bytes
    ed = token_bytes.index(b"\xed")
    quote = token_bytes.index(b'"')
    assert state.accept(quote) and state.accept(ed)
    mask = fill_bitmask([state], core.model_config.vocab_size)
    assert mask is not None
    starts = {t: b[0] for t, b in enumerate(token_bytes) if b}
    surrogate = [t for t, first in starts.items() if 0xA0 <= first < 0xC0]
    hangul = [t for t, first in starts.items() if 0x80 <= first < 0xA0]
    assert surrogate and hangul
    assert not any(_allowed(mask[0], t) for t in surrogate)
    assert any(_allowed(mask[0], t) for t in hangul)  # U+D000..U+D7FF are still characters
