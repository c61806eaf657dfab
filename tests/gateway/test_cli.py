import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.gateway.cli import main
from kvgate.gateway.settings import Settings, options


def test_make_tiny_model_writes_a_loadable_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    main(["make-tiny-model", str(tmp_path / "m")])
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (tmp_path / "m" / "tokenizer.json").is_file()
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_python_dash_m_gateway_is_the_cli() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0
    for option in options():
        if option.flag is not None:
            assert option.flag in done.stdout


def test_a_missing_model_folder_is_a_clear_error(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", "--port", "0", "--model", str(tmp_path / "no")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1
    assert done.stderr.strip().startswith("kvgate: cannot load the model:")
    assert "Traceback" not in done.stderr


def test_an_unknown_tool_call_parser_is_a_startup_error() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "serve", "--tool-call-parser", "qwen"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip() == (
        "kvgate: --tool-call-parser: unknown parser 'qwen'; "
        "one of ['hermes', 'llama3_json', 'mistral']"
    )
    assert Settings.from_env({"KVGATE_TOOL_CALL_PARSER": "mistral"}).tool_call_parser == "mistral"


def test_limit_flags_reach_the_settings_and_the_engine() -> None:
    from kvgate.gateway.cli import build_parser, engine_limits, settings_from_args

    args = build_parser().parse_args(
        [
            "serve",
            "--max-waiting",
            "8",
            "--max-prompt-tokens",
            "1000",
            "--max-tokens-limit",
            "256",
            "--max-model-len",
            "512",
            "--max-concurrency-per-client",
            "4",
            "--request-timeout",
            "60",
            "--step-timeout",
            "30",
            "--body-timeout",
            "5",
            "--header-timeout",
            "6",
            "--max-header-bytes",
            "8192",
            "--max-json-depth",
            "32",
            "--max-listen-streams",
            "10",
        ]
    )
    settings = settings_from_args(args)
    assert (
        settings.max_concurrency_per_client,
        settings.request_timeout_s,
        settings.body_timeout_s,
        settings.header_timeout_s,
        settings.max_header_bytes,
        settings.max_json_depth,
        settings.max_listen_streams,
    ) == (4, 60.0, 5.0, 6.0, 8192, 32, 10)
    assert engine_limits(settings) == {
        "max_waiting": 8,
        "step_timeout_s": 30.0,
        "max_prompt_tokens": 1000,
        "max_tokens_limit": 256,
        "max_model_len": 512,
    }
    assert engine_limits(Settings())["max_prompt_tokens"] is None  # 0 = no limit
    assert engine_limits(Settings())["max_model_len"] is None  # 0 = the model's own


def test_limits_have_environment_twins() -> None:
    settings = Settings.from_env({"KVGATE_MAX_WAITING": "3", "KVGATE_REQUEST_TIMEOUT_S": "9.5"})
    assert (settings.max_waiting, settings.request_timeout_s) == (3, 9.5)


def test_fetch_model_prints_the_cached_path(tmp_path: Path) -> None:
    models = tmp_path / "models"
    models.mkdir()
    (models / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"cached")
    done = subprocess.run(
        [sys.executable, "-m", "kvgate", "fetch-model", "smollm2"],
        env=os.environ | {"KVGATE_CACHE_DIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"{models / 'SmolLM2-135M-Instruct.Q4_1.gguf'}\n"
