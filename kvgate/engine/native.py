"""kvgate's native CPU library: the ISA variant this machine runs, loaded once.

The kernels (``kvgate/engine/csrc``) are one library per ISA variant (`kvgate.engine.native_variants`), built
at install by ``setup.py`` next to this file (``kvgate/engine/_C_<variant>.*.so``) and registered as
torch ops (``torch.ops.kvgate_<variant>``): `library` loads the best variant the CPU runs and
returns it as a `Library`, or None where the torch path serves instead.

``KVGATE_CPU_ISA`` forces a variant (``native``, the default, picks the best one the CPU
runs): how the AVX2 kernels are tested and timed on a machine whose own would be AVX-512.
``KVGATE_CPU_KERNELS=0`` turns the kernels off. Where the wanted variant is not installed
(kvgate installed without torch present, or a CPU no variant fits), the torch path serves with
one warning, unless ``KVGATE_BUILD_KERNELS=1`` asks for a build here at run time (a C++
compiler and minutes): into the kvgate cache directory, in a folder named by a hash of
everything that goes into the build (sources and headers, flags, include paths, compiler,
torch), so two checkouts or two torch versions sharing the cache never rebuild each other's;
a build logs why it was needed (what differs from the cache's last build of that variant).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import importlib.machinery
import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kvgate.engine.config import cache_dir, cpu_flags
from kvgate.engine.native_variants import (
    BY_NAME,
    HEADERS,
    HOST,
    LINK_FLAGS,
    SOURCES,
    Variant,
    runnable,
    sources_digest,
)

log = logging.getLogger(__name__)
DISABLE_ENV = "KVGATE_CPU_KERNELS"
ISA_ENV = "KVGATE_CPU_ISA"
BUILD_ENV = "KVGATE_BUILD_KERNELS"
PACKAGE_DIR = Path(__file__).parent
# A run-time build unused this long is removed. Not sooner: two kvgate versions sharing a cache
# (a rolling upgrade, a second checkout) would otherwise remove each other's build mid-load.
STALE_AFTER_S = 7 * 24 * 3600
MANIFEST = "inputs.json"


class Library:
    """A loaded variant: ``lib.gemm(...)`` is op ``kvgate_<variant>::gemm`` as the dispatcher's
    own callable (`OpOverload._op`), which the op packet and the overload reach through a
    Python frame each: per call 1.6 us against the packet's 2.1 (and pybind11's 1.8), a 1-row
    RMSNorm on a 2-core Zen 4, where a decode layer run from Python makes ~10 such calls.
    ``classes`` holds the library's torch classes (the decode stack's)."""

    def __init__(self, variant: Variant):
        self.name = f"kvgate_{variant.name}"
        self._ops = getattr(torch.ops, self.name)
        self.classes = getattr(torch.classes, self.name)

    def __getattr__(self, op: str) -> Any:
        entry = getattr(self._ops, op).default._op
        setattr(self, op, entry)  # found once
        return entry


def switched_on(env: str, default: str = "1") -> bool:
    """A kernel switch read from ``env``: on unless set to 0/false/no/off."""
    return os.environ.get(env, default).lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    return switched_on(DISABLE_ENV)


def variant() -> Variant:
    """The variant to load: ``KVGATE_CPU_ISA``'s, else the best this CPU runs (`HOST` where none
    does). A variant the CPU cannot run is an error, not a crash at the first instruction."""
    chosen = os.environ.get(ISA_ENV, "native").lower()
    if chosen == "native":
        fits = runnable(cpu_flags())
        return fits[0] if fits else HOST
    if chosen not in BY_NAME:
        raise ValueError(f"{ISA_ENV}={chosen!r}: expected native or one of {sorted(BY_NAME)}")
    missing = BY_NAME[chosen].cpu_flags - cpu_flags()
    if missing:
        raise ValueError(f"{ISA_ENV}={chosen}: this CPU lacks {' '.join(sorted(missing))}")
    return BY_NAME[chosen]


@functools.cache
def library(name: str | None = None) -> Library | None:
    """Variant ``name`` (default `variant`), or None where the kernels are off or not to be
    had. Decided once a process (``cache_clear`` to read the switches again)."""
    if not enabled():
        return None
    return _load(BY_NAME[name] if name is not None else variant())


def built(name: str) -> Library:
    """Variant ``name`` built at run time in the cache (or found built there): a variant the
    install did not build, as the tests' AVX2 one beside an AVX-512 machine's own."""
    return _build(BY_NAME[name])


def installed(target: Variant) -> Path | None:
    """The library ``setup.py`` built for ``target`` beside this file, if any."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = PACKAGE_DIR / f"{target.library}{suffix}"
        if path.is_file():
            return path
    return None


@functools.cache
def _load(target: Variant) -> Library | None:
    path = installed(target)
    if path is not None:
        try:
            return _open(path, target)
        except OSError as exc:  # built against another torch: its symbols are not this one's
            log.warning("kvgate's CPU kernels %s do not load (%s)", path.name, exc)
    if not switched_on(BUILD_ENV, default="0"):
        log.warning(
            "kvgate's CPU kernels (%s) are not installed for this machine: the torch path "
            "serves, slower. Install kvgate where torch is already installed (pip install -e . "
            "builds them), or set %s=1 to build them here (a C++ compiler, a few minutes)",
            target.name, BUILD_ENV,
        )  # fmt: skip
        return None
    try:
        return _build(target)
    except Exception as exc:  # noqa: BLE001 - no compiler, a failed build: the torch path serves
        log.warning("kvgate's CPU kernels (%s) could not be built (%s): the torch path serves",
                    target.name, exc)  # fmt: skip
        return None


def _open(path: Path, target: Variant) -> Library:
    """Loads ``path``, a library of ``target``. One built from other sources than those beside
    it (an editable install's, after an edit) still serves, with a warning."""
    torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]
    ops = Library(target)
    if ops.sources_digest() != sources_digest():
        log.warning("kvgate's CPU kernels %s were built from other sources than %s holds: "
                    "pip install -e . rebuilds them", path.name, SOURCES[0].parent)  # fmt: skip
    return ops


def build_inputs(target: Variant) -> dict[str, Any]:
    """Everything a run-time build of ``target`` depends on; its hash names the build."""
    compiler = os.environ.get("CXX", "c++")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True)
    files = (*SOURCES, *HEADERS)
    return {
        "sources": {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in files},
        "flags": target.compile_flags(),
        "include_paths": [str(SOURCES[0].parent)],
        "compiler": [shutil.which(compiler) or compiler, version.stdout.splitlines()[0]],
        "torch": [torch.__version__, str(Path(torch.__file__).parent)],
    }


def _build(target: Variant) -> Library:
    """The library of ``target`` built in the cache (or found there, built before), loaded."""
    from torch.utils import cpp_extension

    try:  # ninja's wheel: usable even when its venv's bin/ is not on PATH
        import ninja

        os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
    except ImportError:
        pass

    inputs = build_inputs(target)
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    directory = cache_dir() / "cpu-kernels" / f"{target.name}-{digest}"
    library = directory / f"{target.library}.so"
    directory.mkdir(parents=True, exist_ok=True)
    with _building(directory):
        if library.is_file():
            ops = _open(library, target)
        else:
            log.warning("building kvgate's CPU kernels (%s) in %s: %s", target.name, directory,
                        why_build(inputs, directory))  # fmt: skip
            started = time.monotonic()
            cpp_extension.load(
                name=target.library,
                sources=[str(p) for p in SOURCES],
                extra_cflags=target.compile_flags(),
                extra_ldflags=list(LINK_FLAGS),
                extra_include_paths=inputs["include_paths"],
                build_directory=str(directory),
                is_python_module=False,  # loaded as torch.ops.load_library loads it
            )
            ops = Library(target)  # its sources: these
            (directory / MANIFEST).write_text(json.dumps(inputs, indent=1, sort_keys=True))
            log.warning("built kvgate's CPU kernels (%s) in %.0f s", target.name,
                        time.monotonic() - started)  # fmt: skip
    os.utime(directory)  # in use: not stale
    _remove_stale_builds(target, directory)
    return ops


def why_build(inputs: dict[str, Any], directory: Path) -> str:
    """Why ``directory`` (the build of ``inputs``) is not in the cache: what differs from the
    variant's most recent build there, if any."""
    variant_name = directory.name.rsplit("-", 1)[0]
    earlier = sorted(
        (m for m in directory.parent.glob(f"{variant_name}-*/{MANIFEST}") if m.parent != directory),
        key=lambda m: m.stat().st_mtime,
    )
    if not earlier:
        return "no earlier build of it in this cache"
    last = json.loads(earlier[-1].read_text())
    changed = [key for key in inputs if inputs[key] != last.get(key)]
    sources = [
        Path(path).name
        for path, digest in inputs["sources"].items()
        if last.get("sources", {}).get(path) != digest
    ]
    detail = {
        "sources": f"sources ({', '.join(sources) or 'moved'})",
        "include_paths": f"include paths (another checkout: {last.get('include_paths')})",
        "torch": f"torch ({last.get('torch', ['?'])[0]} -> {inputs['torch'][0]})",
    }
    what = ", ".join(detail.get(key, key) for key in changed)
    return f"changed since {earlier[-1].parent.name}: {what}"


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


def _remove_stale_builds(target: Variant, current: Path) -> None:
    """This variant's other run-time builds (other sources, torch, checkout) that no process
    has loaded for ``STALE_AFTER_S``: dropped. A process still running one keeps its mapped copy."""
    cutoff = time.time() - STALE_AFTER_S
    for other in current.parent.glob(f"{target.name}-*"):
        if other != current and other.is_dir() and other.stat().st_mtime < cutoff:
            shutil.rmtree(other, ignore_errors=True)
            other.with_name(f"{other.name}.lock").unlink(missing_ok=True)
