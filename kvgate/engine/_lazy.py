"""Lazy re-exports for the engine's package ``__init__`` files (PEP 562).

A package ``__init__`` that imported its public names eagerly would load them, and torch,
before any submodule: ``import kvgate.engine.sampling_params`` runs ``kvgate/engine/__init__.py`` first.
Each package instead names where its exports live; a name loads its module on first use and
is then cached in the package, so later look-ups are plain attribute reads. The packages keep
an ``if TYPE_CHECKING:`` block importing the same names, for type checkers and editors.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def exports(
    package: str, defined_in: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of `package`, whose public names are those of
    `defined_in` (each module's names)."""
    where = {name: module for module, names in defined_in.items() for name in names}

    def __getattr__(name: str) -> object:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__
