"""Choosing the attention backend."""

import pytest

from kvgate.engine.attention import get_attention_backend
from kvgate.engine.attention.backend import TORCH_BACKEND, cpu_backend
from kvgate.engine.attention.cpu import native_decode


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    assert get_attention_backend("auto", "cpu").name == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("triton", "cpu")
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("cudnn", "cpu")


def test_cpu_backend_fuses_bf16_prefills_only_where_there_is_amx() -> None:
    amx = cpu_backend(frozenset({"avx512_bf16", "amx_bf16", "amx_tile"}))
    assert amx.paged_attention.keywords == {
        "fused": True,
        "decode_kernel": None,
        "prefill_kernel": None,
    }
    assert cpu_backend(frozenset({"avx512_bf16"})) is TORCH_BACKEND
    assert cpu_backend(frozenset()) is TORCH_BACKEND


def test_cpu_backend_hands_decode_rows_to_the_native_kernel_where_there_is_one() -> None:
    kernel = native_decode()
    if kernel is None:
        pytest.skip("no native kernel on this machine")
    backend = cpu_backend(frozenset({"avx512_bf16"}), kernel)
    assert backend.paged_attention.keywords == {
        "fused": False,
        "decode_kernel": kernel,
        "prefill_kernel": None,
    }
