"""kvgate.engine.native: which variant of the native library a machine loads, the torch ops it
registers, the warning where none is installed, and the run-time build's cache (one build per
checkout, found again by the next start, whatever else shares the cache)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import kvgate.engine.native as native
from kvgate.engine.config import cpu_flags
from kvgate.engine.native_variants import BY_NAME, HOST, VARIANTS, host_variants, runnable

V3_ONLY = BY_NAME["avx2"].cpu_flags | {"sse4_2"}


def test_a_machine_loads_the_best_variant_it_runs_unless_one_is_forced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(native.ISA_ENV, raising=False)
    fits = runnable(cpu_flags())
    assert native.variant() == (fits[0] if fits else HOST)
    monkeypatch.setattr(native, "cpu_flags", lambda: V3_ONLY)  # a Zen 3
    assert native.variant() == BY_NAME["avx2"]
    assert host_variants(V3_ONLY) == [BY_NAME["avx2"]]
    monkeypatch.setenv(native.ISA_ENV, "avx512")
    with pytest.raises(ValueError, match="lacks avx512bw avx512cd avx512dq avx512f avx512vl"):
        native.variant()
    monkeypatch.setenv(native.ISA_ENV, "sse9")
    with pytest.raises(ValueError, match="KVGATE_CPU_ISA"):
        native.variant()
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"fp", "asimd"}))  # an Arm CPU
    monkeypatch.setenv(native.ISA_ENV, "native")
    assert native.variant() == HOST
    assert [v.name for v in VARIANTS] == ["amx", "avx512bf16", "avx512", "avx2"]


def test_disabled_kernels_load_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    native.library.cache_clear()
    try:
        assert native.library() is None
    finally:
        native.library.cache_clear()


def test_the_kernels_are_torch_ops_the_profiler_names() -> None:
    ops = native.library()
    if ops is None:
        pytest.skip("no native library")
    assert ops.isa() == native.variant().name
    x, weight = torch.randn(4, 64), torch.randn(64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        ops.rms_norm(x, weight, 1e-6)
    assert f"{ops.name}::rms_norm" in {event.name for event in profile.events()}


def test_without_an_installed_library_the_torch_path_serves_with_one_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "installed", lambda target: None)
    monkeypatch.delenv(native.BUILD_ENV, raising=False)
    uncached = native._load.__wrapped__  # this process keeps the library it loaded
    with caplog.at_level(logging.WARNING, logger="kvgate.engine.native"):
        assert uncached(native.variant()) is None
    (record,) = caplog.records
    assert "torch path" in record.message and f"{native.BUILD_ENV}=1" in record.message


def test_a_library_built_from_other_sources_serves_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """An editable install's library after an edit of its sources: still the one loaded."""
    target = native.variant()
    path = native.installed(target)
    if path is None or not native.enabled():
        pytest.skip("no installed library")
    with caplog.at_level(logging.WARNING, logger="kvgate.engine.native"):
        assert native._open(path, target).isa() == target.name
        assert not caplog.records
        monkeypatch.setattr(native, "sources_digest", lambda: "edited")
        native._open(path, target)
    (record,) = caplog.records
    assert "built from other sources" in record.message and "pip install -e ." in record.message


def test_a_build_says_what_changed_since_the_variants_last_one(tmp_path: Path) -> None:
    inputs = {
        "sources": {"/a/engine/csrc/kernels/gemm.cpp": "1", "/a/engine/csrc/ops.h": "2"},
        "flags": ["-O3"],
        "include_paths": ["/a/engine/csrc"],
        "compiler": ["/usr/bin/c++", "c++ 12.2.0"],
        "torch": ["2.13.0", "/venv/torch"],
    }
    first = tmp_path / "avx2-1111"
    assert native.why_build(inputs, first) == "no earlier build of it in this cache"
    first.mkdir()
    (first / native.MANIFEST).write_text(json.dumps(inputs))
    other = {
        **inputs,
        "sources": {"/b/engine/csrc/kernels/gemm.cpp": "1", "/b/engine/csrc/ops.h": "3"},
        "include_paths": ["/b/engine/csrc"],
        "torch": ["2.14.0", "/venv/torch"],
    }
    why = native.why_build(other, tmp_path / "avx2-2222")
    assert why.startswith("changed since avx2-1111: sources (gemm.cpp, ops.h), include paths")
    assert "another checkout: ['/a/engine/csrc']" in why and "torch (2.13.0 -> 2.14.0)" in why


def test_a_new_build_removes_this_variants_long_unused_ones_only(tmp_path: Path) -> None:
    """A build another checkout or kvgate version loaded recently stays (it may be loading
    it now)."""
    current, older, recent = (tmp_path / f"avx2-{n}" for n in ("111", "000", "222"))
    other_variant = tmp_path / "avx512bf16-000"
    for folder in (current, older, recent, other_variant):
        folder.mkdir()
        if folder is not recent and folder is not current:
            long_ago = time.time() - native.STALE_AFTER_S - 60
            os.utime(folder, (long_ago, long_ago))
    native._remove_stale_builds(BY_NAME["avx2"], current)
    assert not older.exists()
    assert all(f.is_dir() for f in (current, recent, other_variant))


def test_a_build_lock_left_by_a_killed_build_holds_nobody_up(tmp_path: Path) -> None:
    """A process killed while building leaves torch's lock file behind; the next build
    removes it instead of waiting on it forever, and the kernel's lock died with the
    killed process."""
    directory = tmp_path / "avx2-0"
    directory.mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from kvgate.engine import native\n"
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


START = """
import logging
logging.basicConfig(level=logging.WARNING, format="%(message)s")
import kvgate.engine.native as native
assert native.installed(native.variant()) is None, "a checkout without an installed library"
print(native.__file__, native.library().isa())
"""


@pytest.mark.slow
def test_two_checkouts_sharing_a_cache_each_build_once_then_load(tmp_path: Path) -> None:
    """Two copies of the source tree with no installed library and one cache directory, each
    asked to build at run time (``KVGATE_BUILD_KERNELS=1``), started A, B, A, B: each one's
    first start builds (the second says what differs: the other checkout's paths), and each
    later start loads its own build, rebuilding nothing (what two checkouts used to do to each
    other at every start)."""
    if not BY_NAME["avx2"].cpu_flags <= cpu_flags() or shutil.which("c++") is None:
        pytest.skip("builds the AVX2 variant: an x86 CPU with AVX2 and a C++ compiler")
    source = Path(native.__file__).parent
    checkouts = [tmp_path / name for name in ("a", "b")]
    for checkout in checkouts:
        package = checkout / "kvgate"
        shutil.copytree(source, package / "engine", ignore=shutil.ignore_patterns("_C_*", "__pycache__"))  # fmt: skip
        shutil.copy(source.parent / "__init__.py", package / "__init__.py")
    env = {
        **os.environ,
        native.BUILD_ENV: "1",
        native.ISA_ENV: "avx2",
        "KVGATE_CACHE_DIR": str(tmp_path / "cache"),
    }
    logs = []
    for checkout in [*checkouts, *checkouts]:
        started = subprocess.run(
            [sys.executable, "-c", START],
            cwd=checkout,
            env={**env, "PYTHONPATH": str(checkout)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert started.returncode == 0, started.stderr
        assert started.stdout.split() == [str(checkout / "kvgate" / "engine" / "native.py"), "avx2"]
        logs.append(started.stderr)
    first_a, first_b, again_a, again_b = logs
    assert "building kvgate's CPU kernels (avx2)" in first_a
    assert "no earlier build of it in this cache" in first_a
    assert "building kvgate's CPU kernels (avx2)" in first_b
    assert f"another checkout: ['{checkouts[0] / 'kvgate' / 'engine' / 'csrc'}']" in first_b
    assert "building" not in again_a and "building" not in again_b
    assert len(list((tmp_path / "cache" / "cpu-kernels").glob("avx2-*/_C_avx2.so"))) == 2
