import json
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli import main


def test_make_tiny_model_writes_a_loadable_folder(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    main(["make-tiny-model", str(tmp_path / "m")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_python_dash_m_gateway_is_the_cli() -> None:
    done = subprocess.run([sys.executable, "-m", "gateway", "serve", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    for flag in ("--host", "--port", "--model", "--replicas", "--kv-cache-dtype",
                 "--kv-cache-memory", "--redis-url", "--allowed-origins", "--max-body-bytes",
                 "--catalog-config", "--admin-api-key", "--drain-timeout", "--log-format"):
        assert flag in done.stdout


def test_a_missing_model_folder_is_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "gateway", "serve", "--model", str(tmp_path / "no")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().startswith("kvgate: cannot load the model:")
    assert "Traceback" not in done.stderr
