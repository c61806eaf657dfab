"""Choosing the attention backend."""

import pytest

from engine.attention import get_attention_backend


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_attention_backend("auto", "cpu").name == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("cudnn", "cpu")
