from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from engine import native


def test_a_new_build_removes_this_cpu_kinds_and_isas_long_unused_ones_only(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A build another kvgate version loaded recently stays (it may be loading it now)."""
    kind = native._cpu_kind()
    current = tmp_path / f"kvgate_gemm_{kind}_native_111111111111"
    older = tmp_path / f"kvgate_gemm_{kind}_native_000000000000"
    recent = tmp_path / f"kvgate_gemm_{kind}_native_222222222222"
    other_isa = tmp_path / f"kvgate_gemm_{kind}_avx2_000000000000"
    other_family = tmp_path / f"kvgate_cpu_attention_{kind}_native_000000000000"
    other_machine = tmp_path / "kvgate_gemm_ffffffff_native_000000000000"
    for folder in (current, older, recent, other_isa, other_family, other_machine):
        folder.mkdir()
        if folder is not recent and folder is not current:
            long_ago = time.time() - native.STALE_AFTER_S - 60
            os.utime(folder, (long_ago, long_ago))
    native._remove_stale_builds("gemm", current)
    assert not older.exists()
    assert all(f.is_dir() for f in (current, recent, other_isa, other_family, other_machine))


def test_the_isa_is_named_in_the_build_and_an_unknown_one_refused(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(native.ISA_ENV, "avx2")
    assert "_avx2_" in native._build_name("gemm", [])
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="KVGATE_CPU_ISA"):
        native.isa()


def test_disabled_kernels_build_nothing(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native.build("gemm", []) is None


def test_a_build_lock_left_by_a_killed_build_holds_nobody_up(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A process killed while building leaves torch's lock file behind; the next build
    removes it instead of waiting on it forever, and the kernel's lock died with the
    killed process."""
    directory = tmp_path / "kvgate_gemm_x_native_0"
    directory.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from engine import native\n"
            "with native._building(Path(sys.argv[1])):\n"
            "    (Path(sys.argv[1]) / 'lock').touch(); print('held', flush=True); time.sleep(60)",
            str(directory),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        holder.send_signal(signal.SIGKILL)  # mid-build: torch's lock file stays
        holder.wait(10)
        assert (directory / "lock").exists()
        started = time.monotonic()
        with native._building(directory):
            assert not (directory / "lock").exists()
        assert time.monotonic() - started < 5
    finally:
        holder.kill()
        holder.wait()
        assert holder.stdout is not None
        holder.stdout.close()
