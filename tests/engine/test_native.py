from __future__ import annotations

import pytest

from engine import native


def test_a_new_build_removes_this_cpu_kinds_and_isas_older_ones_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    kind = native._cpu_kind()
    current = tmp_path / f"kvgate_gemm_{kind}_native_111111111111"
    older = tmp_path / f"kvgate_gemm_{kind}_native_000000000000"
    other_isa = tmp_path / f"kvgate_gemm_{kind}_avx2_000000000000"
    other_family = tmp_path / f"kvgate_cpu_attention_{kind}_native_000000000000"
    other_machine = tmp_path / "kvgate_gemm_ffffffff_native_000000000000"
    for folder in (current, older, other_isa, other_family, other_machine):
        folder.mkdir()
    native._remove_stale_builds("gemm", current)
    assert not older.exists()
    assert all(f.is_dir() for f in (current, other_isa, other_family, other_machine))


def test_the_isa_is_named_in_the_build_and_an_unknown_one_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(native.ISA_ENV, "avx2")
    assert "_avx2_" in native._build_name("gemm", [])
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="KVGATE_CPU_ISA"):
        native.isa()


def test_disabled_kernels_build_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native.build("gemm", []) is None
