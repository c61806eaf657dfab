"""The CPU dtype rule: bf16 only where the CPU computes it natively, fp32 otherwise; an
explicit bf16 on an emulating CPU works but warns; the KV cache's ``auto`` follows suit."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from kvgate.engine import LLM, config
from kvgate.engine.config import (
    EngineConfig,
    apply_threads,
    choose_dtype,
    choose_kv_cache_dtype,
    cpu_flags,
    log_dtype_choice,
    native_bf16_flags,
)

ZEN3 = frozenset({"avx2", "fma", "f16c"})  # AVX2 only: bf16 is emulated
ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16"})
SAPPHIRE_RAPIDS = frozenset({"avx512f", "amx_tile", "amx_bf16"})


@pytest.mark.parametrize(
    ("flags", "expected"), [(ZEN3, "float32"), (ZEN4, "bfloat16"), (SAPPHIRE_RAPIDS, "bfloat16")]
)
def test_auto_on_cpu_is_bf16_only_when_native(flags: frozenset[str], expected: str) -> None:
    choice = choose_dtype("auto", "cpu", flags)
    assert choice.name == expected
    assert ("natively" in choice.reason) == (expected == "bfloat16")


def test_auto_elsewhere_is_the_checkpoint_dtype() -> None:
    assert choose_dtype("auto", "cuda", ZEN3).name == "auto"


def test_explicit_bf16_without_native_support_warns(caplog: pytest.LogCaptureFixture) -> None:
    emulated = choose_dtype("bfloat16", "cpu", ZEN3)
    native = choose_dtype("bfloat16", "cpu", ZEN4)
    assert emulated.name == native.name == "bfloat16"
    with caplog.at_level(logging.INFO, logger="kvgate.engine.config"):
        log_dtype_choice("dtype", emulated)
        log_dtype_choice("dtype", native)
    levels = [(r.levelno, "emulated" in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.WARNING, True), (logging.INFO, False)]


def test_kv_cache_auto_follows_the_rule() -> None:
    assert choose_kv_cache_dtype("auto", "torch.bfloat16", "cpu", ZEN4).name == "bfloat16"
    assert choose_kv_cache_dtype("auto", "torch.bfloat16", "cpu", ZEN3).name == "float32"
    assert choose_kv_cache_dtype("auto", "torch.bfloat16", "cuda", ZEN3).name == "bfloat16"
    assert choose_kv_cache_dtype("auto", "torch.float32", "cpu", ZEN4).name == "float32"
    assert choose_kv_cache_dtype("fp8", "torch.bfloat16", "cpu", ZEN3).name == "fp8"


def test_this_machine_follows_its_flags(tiny_model_dir: Path) -> None:
    """The flags are read from /proc/cpuinfo, and the engine loads what the rule says."""
    expected = "bfloat16" if native_bf16_flags(cpu_flags()) else "float32"
    llm = LLM(str(tiny_model_dir), kv_cache_memory="1MiB")
    assert llm.core.model.embed_weight.dtype == getattr(torch, expected)
    assert llm.stats().cache_dtype == expected


def test_threads_option() -> None:
    with pytest.raises(ValueError, match="threads"):
        EngineConfig(threads=0)
    before = torch.get_num_threads()
    try:
        assert apply_threads(1) == 1 == torch.get_num_threads()
        assert apply_threads(None) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (4, 3), (16, 15)])
def test_serving_leaves_the_event_loop_a_core(
    cores: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(config, "usable_cores", lambda: cores)
    assert config.serving_threads() == threads
