"""The engine's light modules and names import without torch: the package ``__init__`` files
re-export lazily (``kvgate.engine._lazy``), so ``import kvgate.engine.sampling_params`` or ``from kvgate.engine import
SamplingParams`` (the gateway's validation, the router, the tokenizer) stays torch-free while
``from kvgate.engine import LLM`` loads the engine as before."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAZY_PACKAGES = ("kvgate.engine", "kvgate.engine.attention", "kvgate.engine.models")

# Run in a fresh interpreter; the first import of torch records who asked for it.
PROBE = textwrap.dedent(
    """
    import sys, traceback

    class RecordTorch:
        stack = None

        def find_spec(self, name, path=None, target=None):
            if name == "torch" and RecordTorch.stack is None:
                RecordTorch.stack = "".join(traceback.format_stack(limit=30))
            return None

    sys.meta_path.insert(0, RecordTorch())

    import kvgate.engine.sampling_params, kvgate.engine.errors, kvgate.engine.outputs, kvgate.engine.stats
    import kvgate.engine.tokenization.tokenizer, kvgate.engine.core.router, kvgate.engine.core.block_hash
    from kvgate.engine import SamplingParams, AdmissionRefused

    assert "torch" not in sys.modules, "torch was imported by:\\n" + RecordTorch.stack
    assert SamplingParams.__module__ == "kvgate.engine.sampling_params"
    assert AdmissionRefused.__module__ == "kvgate.engine.errors"

    from kvgate.engine import LLM

    assert LLM.__module__ == "kvgate.engine.llm" and "torch" in sys.modules
    print("ok")
    """
)


def test_light_engine_modules_and_names_do_not_import_torch() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _type_checking_imports(package: str) -> dict[str, str]:
    """name -> defining module, as the package's ``if TYPE_CHECKING:`` block imports them."""
    path = ROOT.joinpath(*package.split("."), "__init__.py")
    names = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for statement in node.body:
                assert isinstance(statement, ast.ImportFrom) and statement.module
                for alias in statement.names:
                    names[alias.asname or alias.name] = statement.module
    return names


@pytest.mark.parametrize("package", LAZY_PACKAGES)
def test_the_lazy_exports_are_what_the_type_checkers_see(package: str) -> None:
    """Each name of ``__all__`` is imported for type checkers, and the lazy look-up returns the
    object of that same defining module."""
    module = importlib.import_module(package)
    declared = _type_checking_imports(package)
    assert sorted(declared) == sorted(module.__all__)
    for name, defined_in in declared.items():
        assert getattr(module, name) is getattr(importlib.import_module(defined_in), name)
    assert set(module.__all__) <= set(dir(module))
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        _ = module.nothing_here
