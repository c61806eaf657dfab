"""The wheel: built from a copy of the source tree, installed in a fresh venv on a machine
with no compiler on ``PATH`` (no ``c++``, ``cc``, ``gcc`` or ``ninja``), ``kvgate serve``
answers a tool call on the wheel's native library.

The fresh venv reads its dependencies from this test run's environment (a ``.pth`` line naming
its site-packages, whose own ``.pth`` files, this checkout's editable install among them, are
not processed there), so nothing is downloaded; the wheel carries this machine's variant only,
to keep the build to one library's time (a wheel's default, every variant, is
`native_variants.to_build`'s, tested with it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import httpx
import pytest

import kvgate.engine.native as native
from kvgate.engine.native_variants import BY_NAME, VARIANTS, to_build
from tests.gateway.live_server import free_port
from tests.gateway.upstream.processes import call_tool

REPO = Path(__file__).resolve().parents[1]


def test_a_wheel_carries_every_variant_and_an_editable_install_the_machines_best() -> None:
    zen3 = BY_NAME["avx2"].cpu_flags
    assert to_build("", editable=False, cpu_flags=zen3) == list(VARIANTS)
    assert to_build("", editable=True, cpu_flags=zen3) == [BY_NAME["avx2"]]
    zen4 = BY_NAME["avx512bf16"].cpu_flags
    assert to_build("", editable=True, cpu_flags=zen4) == [BY_NAME["avx512bf16"]]
    assert to_build("", editable=True, cpu_flags={"fp", "asimd"}) == []
    assert to_build("avx2, avx512", editable=False, cpu_flags=zen4) == [
        BY_NAME["avx2"],
        BY_NAME["avx512"],
    ]
    assert to_build("all", editable=True, cpu_flags=zen3) == list(VARIANTS)
    with pytest.raises(ValueError, match="unknown"):
        to_build("sse9", editable=False, cpu_flags=zen3)


def _source_copy(into: Path) -> Path:
    """The tracked (and new, unignored) files of this checkout: what a clone holds."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = REPO / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


@pytest.mark.slow
def test_the_wheel_serves_on_a_machine_with_no_compiler(tmp_path: Path) -> None:
    if shutil.which("c++") is None or shutil.which("git") is None or not native.enabled():
        pytest.skip("builds a wheel: a C++ compiler, git and the native kernels on")
    variant = native.variant()
    if variant.name not in BY_NAME:
        pytest.skip("no shipped variant fits this CPU")
    source = _source_copy(tmp_path / "src")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path / "dist"), str(source)],
        env={**os.environ, "KVGATE_CPU_VARIANTS": variant.name},
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    (wheel,) = (tmp_path / "dist").glob("kvgate-*.whl")
    libraries = [n for n in zipfile.ZipFile(wheel).namelist() if n.startswith("kvgate/engine/_C_")]
    assert libraries == [f"kvgate/engine/{variant.library}.abi3.so"]

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--ignore-installed", str(wheel)],
        check=True, timeout=300,
    )  # fmt: skip
    bare = {**os.environ, "PATH": str(venv / "bin"), "KVGATE_CACHE_DIR": str(tmp_path / "cache")}
    bare.pop("PYTHONPATH", None)
    for tool in ("c++", "cc", "gcc", "g++", "ninja"):
        assert shutil.which(tool, path=bare["PATH"]) is None, tool
    found = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "import kvgate.engine.native as n; print(n.__file__, n.library().isa())"],
        cwd=tmp_path, env=bare, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert found.returncode == 0, found.stderr
    assert found.stdout.split() == [str(site / "kvgate" / "engine" / "native.py"), variant.name]

    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        server = subprocess.Popen(
            [str(venv / "bin" / "kvgate"), "serve", "--port", str(port), "--model", "tiny"],
            cwd=tmp_path, env={**bare, "KVGATE_KV_CACHE_MEMORY": "16MiB"},
            stdout=subprocess.DEVNULL, stderr=out,
        )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while not _ready(base):
            assert server.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.2)
        result = call_tool(base, "generate", {"prompt": "Once upon a time", "max_tokens": 8})
        assert not result.get("isError"), result
        assert 1 <= result["structuredContent"]["completion_tokens"] <= 8  # an EOS may end it
    finally:
        server.kill()
        server.wait()
    assert "CPU kernels" not in log.read_text(errors="replace")  # none missing, none built


def _ready(base: str) -> bool:
    try:
        return httpx.get(base + "/readyz", timeout=1).status_code == 200
    except httpx.TransportError:
        return False
