"""kvgate's native library: its sources and its ISA variants.

Every C++ kernel (``kvgate/engine/csrc``) builds into one library per ISA variant, as vLLM's CPU
wheels ship one ``_C`` per instruction set: ``kvgate/engine/_C_avx2``, ``_C_avx512``,
``_C_avx512bf16`` and ``_C_amx``. ``setup.py`` builds them at install (a wheel every one, an
editable install the one the machine serves with, see `host_variants`); `kvgate.engine.native` loads, at
run time, the best one the CPU runs. Each variant targets a level every CPU that has its flags
runs (``-march=x86-64-v3``/``-v4`` plus extensions), never ``-march=native``: a wheel built on
one machine serves another.

This file imports the standard library only: ``setup.py`` reads it before kvgate (or, under
pip's build isolation, torch) can be imported.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).with_name("csrc")
# registration.cpp (the torch ops' schemas) and each kernel; ops.h and kvgate_simd.h beside them.
SOURCES = (CSRC / "registration.cpp", *sorted((CSRC / "kernels").glob("*.cpp")))
HEADERS = tuple(sorted(CSRC.glob("*.h")))
# -O3 and OpenMP (torch's thread pool); no debug information (Python's own CFLAGS ask for -g:
# a slower compile and a larger library); hidden symbols keep two variants loaded in one
# process (the tests load the AVX2 one beside the machine's) each calling its own kernels.
COMMON_FLAGS = ("-O3", "-g0", "-fopenmp", "-fvisibility=hidden")
LINK_FLAGS = ("-fopenmp",)

_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Variant:
    """One build of the library: the CPU flags (``/proc/cpuinfo``) its instructions need and the
    compiler flags that target them."""

    name: str
    cpu_flags: frozenset[str]
    march: tuple[str, ...]

    @property
    def library(self) -> str:
        """The library's module name in the ``engine`` package."""
        return f"_C_{self.name}"

    def compile_flags(self) -> list[str]:
        return [
            *COMMON_FLAGS,
            *self.march,
            f"-DKVGATE_VARIANT={self.name}",
            f"-DKVGATE_SOURCES={sources_digest()}",
        ]


# Best first. amx: the GEMM's AMX tiles (Xeon since Sapphire Rapids); avx512bf16: vdpbf16ps in
# the GEMM and attention, and VNNI's vpdpwssd in the quantized products (Zen 4+, Cooper Lake:
# every CPU with AVX-512-BF16 has VNNI); avx512: AVX-512 F/BW/DQ/VL (Skylake-SP, Ice
# Lake); avx2: AVX2 + FMA (Haswell+, Zen 1-3).
VARIANTS = (
    Variant(
        "amx",
        _V4 | {"avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16"},
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
    ),
    Variant(
        "avx512bf16",
        _V4 | {"avx512_vnni", "avx512_bf16"},
        ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16"),
    ),
    Variant("avx512", _V4, ("-march=x86-64-v4",)),
    Variant("avx2", _V3, ("-march=x86-64-v3",)),
)
BY_NAME = {variant.name: variant for variant in VARIANTS}
# A machine none of them fits (no AVX2, or not x86) can still build one for itself at run time,
# on request (kvgate.engine.native): the compiler's own idea of this CPU, scalar loops where no
# vector path is written. Never shipped.
HOST = Variant("host", frozenset(), ("-march=native",))


def sources_digest() -> str:
    """A digest of the library's sources and headers, built into the library
    (``sources_digest()``): one built from other sources than those beside it (an editable
    install's, after an edit) is noticed when it loads."""
    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.relative_to(CSRC).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def read_cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (x86 "flags", Arm "Features"; empty if unknown)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def runnable(cpu_flags: Iterable[str]) -> list[Variant]:
    """The variants a CPU with these flags runs, best first."""
    flags = frozenset(cpu_flags)
    return [variant for variant in VARIANTS if variant.cpu_flags <= flags]


def host_variants(cpu_flags: Iterable[str]) -> list[Variant]:
    """What an editable install builds: the best variant this machine runs, the one it serves
    with. Each variant costs the whole library's compile (about 33 s on 2 Zen 5 cores), which
    a new user waits for before the first answer: the others are left to a wheel, and to the
    tests, which build the AVX2 one at run time where it is not the machine's own."""
    fits = runnable(cpu_flags)
    return fits[:1]


def to_build(requested: str, editable: bool, cpu_flags: Iterable[str]) -> list[Variant]:
    """The variants an install builds: every one for a wheel, `host_variants` for an editable
    install, unless ``requested`` (``KVGATE_CPU_VARIANTS``: ``all``, or names) says."""
    requested = requested.strip()
    if requested == "all" or (not requested and not editable):
        return list(VARIANTS)
    if not requested:
        return host_variants(cpu_flags)
    names = [name.strip() for name in requested.split(",")]
    unknown = sorted(set(names) - set(BY_NAME))
    if unknown:
        raise ValueError(f"KVGATE_CPU_VARIANTS: unknown {unknown}; known: {sorted(BY_NAME)}")
    return [BY_NAME[name] for name in names]
