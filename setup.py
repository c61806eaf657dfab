"""kvgate's native CPU library, built at install (the rest of the build is pyproject.toml's).

One library per ISA variant (``kvgate/engine/native_variants.py``): a wheel (``python -m build
--wheel``, ``pip wheel .``, ``pip install .``) carries every variant, so it serves on any x86-64
machine with AVX2 and needs no compiler there; an editable install (``pip install -e .``) builds
the one the build machine serves with, its best. ``KVGATE_CPU_VARIANTS``
overrides either (``all``, or names: ``avx512bf16,avx2``); ``KVGATE_CPU_KERNELS=0`` builds
none (the torch path then serves).

The library is compiled against the torch of the environment kvgate is installed into, which
must be there first (``pip install torch``: the CPU wheel, or the CUDA build a GPU user has).
The build never installs torch for itself: a build requirement would fetch the index's default,
a CUDA build, of whatever version. Under pip's build isolation that environment's
site-packages are hidden; they are appended to ``sys.path`` (after the build's own packages),
so its torch is the one imported.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
VARIANTS_ENV = "KVGATE_CPU_VARIANTS"


def _variants() -> ModuleType:
    """kvgate/engine/native_variants.py, read without importing the engine package."""
    spec = importlib.util.spec_from_file_location(
        "kvgate_native_variants", ROOT / "kvgate" / "engine" / "native_variants.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _torch() -> ModuleType | None:
    """The torch of the environment kvgate is installed into, or None."""
    try:
        import torch
    except ImportError:
        paths = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
        if os.environ.get("VIRTUAL_ENV"):  # pypa/build's isolation runs in a venv of its own
            version = f"python{sys.version_info.major}.{sys.version_info.minor}"
            paths.add(str(Path(os.environ["VIRTUAL_ENV"]) / "lib" / version / "site-packages"))
        sys.path.extend(sorted(path for path in paths if path not in sys.path))
        try:
            import torch
        except ImportError:
            return None
    return torch


NV = _variants()
# Python's own CFLAGS bring -Wall, under which GCC 12 reports its AVX-512 headers'
# _mm512_undefined_ps (hundreds of "may be used uninitialized" lines a variant).
QUIET = ("-Wno-uninitialized", "-Wno-maybe-uninitialized")
KERNELS = os.environ.get("KVGATE_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")
# The commands that compile. pip runs this file three times for one install (egg_info for the
# build requirements, dist_info for the metadata, then the build); importing torch costs
# seconds, so the metadata steps do without it (their extensions are never built).
BUILDS = {"build", "build_ext", "bdist_wheel", "editable_wheel", "develop", "install"}
TORCH = _torch() if KERNELS and BUILDS & set(sys.argv[1:]) else None


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


if TORCH is None:

    class BuildLibrary(build_ext):
        """Where torch is not imported (the metadata steps never build) or cannot be: a clear
        error instead of a build."""

        def run(self) -> None:
            raise SystemExit(
                "kvgate's CPU kernels are built against the installed torch, and none is "
                "installed here: install torch first (pip install torch, or your CUDA build), "
                "then kvgate; or set KVGATE_CPU_KERNELS=0 to install without them"
            )

    EXTENSIONS = [
        Extension(f"kvgate.engine.{v.library}", [_relative(s) for s in NV.SOURCES])
        for v in NV.VARIANTS
    ]
else:
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    class BuildLibrary(BuildExtension):  # type: ignore[no-redef]
        """torch's extension build (ninja, one job per core) of the variants
        ``native_variants.to_build`` picks, one progress line per variant."""

        def run(self) -> None:
            editable = bool(self.inplace or getattr(self, "editable_mode", False))
            requested = os.environ.get(VARIANTS_ENV, "")
            try:
                wanted = NV.to_build(requested, editable, NV.read_cpu_flags())
            except ValueError as exc:
                raise SystemExit(str(exc)) from exc
            names = [f"kvgate.engine.{variant.library}" for variant in wanted]
            self.extensions = [ext for ext in self.extensions if ext.name in names]
            what = ", ".join(names) or "none (no variant fits this CPU: the torch path serves)"
            print(f"kvgate: CPU kernels against torch {TORCH.__version__}: {what}", flush=True)
            super().run()

        def build_extension(self, ext: Extension) -> None:
            step = f"{self.extensions.index(ext) + 1}/{len(self.extensions)}"
            print(f"kvgate: [{step}] compiling {ext.name} ({len(ext.sources)} files)", flush=True)
            started = time.monotonic()
            super().build_extension(ext)
            print(f"kvgate: [{step}] {ext.name} built in {time.monotonic() - started:.0f} s",
                  flush=True)  # fmt: skip

    EXTENSIONS = [
        CppExtension(
            f"kvgate.engine.{variant.library}",
            [_relative(source) for source in NV.SOURCES],
            include_dirs=[str(NV.CSRC)],  # absolute: ninja compiles from its build folder
            extra_compile_args=[*variant.compile_flags(), *QUIET],
            extra_link_args=list(NV.LINK_FLAGS),
            py_limited_api=True,  # no Python in it: loaded by torch.ops.load_library
        )
        for variant in NV.VARIANTS
    ]

setup(
    ext_modules=EXTENSIONS if KERNELS else [],
    cmdclass={"build_ext": BuildLibrary},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
