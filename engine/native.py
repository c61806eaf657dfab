"""Native CPU kernels (C++), compiled for this machine on first use.

Every kernel family (`engine.attention.cpu`'s paged attention, the model's GEMMs, …) is one
torch extension built by `build` with the C++ compiler torch's extensions use (``-O3``,
OpenMP for torch's thread count) into the kvgate cache directory, once per source, torch
version, CPU kind and ISA; later processes load the build. Where nothing can be built (no
compiler), or with ``KVGATE_CPU_KERNELS=0``, `build` returns None and the torch path serves.

``KVGATE_CPU_ISA`` picks the instruction set a build targets: ``native`` (default,
``-march=native``), ``avx512`` (the same without AMX) or ``avx2`` (``-march=haswell``: AVX2 +
FMA, no AVX-512, AMX or bf16 instructions) — how the vector paths are tested and timed on a
machine whose native build would take AMX or AVX-512 instead.

Every build includes the headers in ``engine/csrc`` (``kvgate_simd.h``: the vector helpers,
widening and paged-cache checks the kernels share), hashed into each build's name.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from engine.config import cache_dir, cpu_flags

log = logging.getLogger(__name__)
DISABLE_ENV = "KVGATE_CPU_KERNELS"
ISA_ENV = "KVGATE_CPU_ISA"
INCLUDE_DIR = Path(__file__).with_name("csrc")
# An earlier build unused this long is removed. Not sooner: two kvgate versions sharing a cache
# (a rolling upgrade, a second checkout) would otherwise remove each other's build mid-load.
STALE_AFTER_S = 7 * 24 * 3600
_ISA_FLAGS = {
    "native": ["-march=native"],
    "avx512": ["-march=native", "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"],
    "avx2": ["-march=haswell", "-mtune=native"],
}


def switched_on(env: str) -> bool:
    """A kernel switch read from ``env``: on unless set to 0/false/no/off."""
    return os.environ.get(env, "1").lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    return switched_on(DISABLE_ENV)


def isa() -> str:
    """The ISA builds target (``KVGATE_CPU_ISA``); an unknown value is an error, not a guess."""
    chosen = os.environ.get(ISA_ENV, "native").lower()
    if chosen not in _ISA_FLAGS:
        raise ValueError(f"{ISA_ENV}={chosen!r}: expected one of {sorted(_ISA_FLAGS)}")
    return chosen


def _cpu_kind() -> str:
    return hashlib.sha256(" ".join(sorted(cpu_flags())).encode()).hexdigest()[:8]


def _build_name(family: str, sources: list[Path]) -> str:
    """A name unique to the CPU kind, the ISA, the sources, the shared headers and torch: a
    build never meets another machine's (a cache directory may be shared)."""
    digest = hashlib.sha256(torch.__version__.encode())
    for source in [*sources, *sorted(INCLUDE_DIR.glob("*.h"))]:
        digest.update(source.read_bytes())
    return f"kvgate_{family}_{_cpu_kind()}_{isa()}_{digest.hexdigest()[:12]}"


def build(family: str, sources: list[Path]) -> ModuleType | None:
    """The extension ``family`` built from ``sources`` for this machine, or None where it
    cannot be had. Callers cache the result (one build per process)."""
    if not enabled():
        return None
    name = _build_name(family, sources)
    directory = cache_dir() / "cpu-kernels" / name
    try:
        from torch.utils import cpp_extension

        try:  # ninja's wheel: usable even when its venv's bin/ is not on PATH
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        except ImportError:
            pass
        directory.mkdir(parents=True, exist_ok=True)
        with _building(directory):
            if not any(directory.glob(f"{name}*.so")):
                log.info("building the CPU kernels %s for this machine (once)", family)
            module: ModuleType = cpp_extension.load(
                name=name,
                sources=[str(source) for source in sources],
                extra_cflags=["-O3", *_ISA_FLAGS[isa()], "-fopenmp"],
                extra_include_paths=[str(INCLUDE_DIR)],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - any build failure: the torch path serves
        log.warning("CPU kernels %s unavailable (%s); using the torch path", family, exc)
        return None
    os.utime(directory)  # in use: not stale
    _remove_stale_builds(family, directory)
    return module


@contextmanager
def _building(directory: Path) -> Iterator[None]:
    """One process at a time builds or loads in ``directory``, under a lock the kernel
    releases when its holder dies. torch's own lock is a file that a process killed mid-build
    (Ctrl-C on a first start) leaves behind, and every later process then waits on it
    forever; under this lock nobody else is building, so such a file is stale: removed."""
    with open(directory.parent / f"{directory.name}.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            (directory / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def _remove_stale_builds(family: str, current: Path) -> None:
    """This CPU kind's and ISA's other builds (another source or torch) that no process has
    loaded for ``STALE_AFTER_S``: drop them. A process still running one keeps its mapped copy."""
    cutoff = time.time() - STALE_AFTER_S
    for other in current.parent.glob(f"kvgate_{family}_{_cpu_kind()}_{isa()}_*"):
        if other != current and other.is_dir() and other.stat().st_mtime < cutoff:
            shutil.rmtree(other, ignore_errors=True)
            other.with_name(f"{other.name}.lock").unlink(missing_ok=True)
