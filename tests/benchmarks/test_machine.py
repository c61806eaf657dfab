"""The roofline's inputs: the model's matmul weights counted as the engine holds them, the
bound that applies at each batch size, the measured rates, and the vLLM peer's environment."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.machine import Machine, ModelCost, describe_cpu, matmul_gflops, memory_gbps
from benchmarks.vllm_peer import peer_environment
from kvgate.engine.loading.loader import load_model
from kvgate.engine.loading.tiny_model import make_tiny_model
from kvgate.engine.models import model_class


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), seed=0)


def test_counts_every_matmul_weight_of_the_engine_model(tiny_model_dir: Path) -> None:
    loaded = load_model(tiny_model_dir, dtype="float32")
    cost = ModelCost.of(loaded.config, 4, 2)
    model = model_class(loaded.config.architecture)(loaded.config, torch.float32, "meta")
    names = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
    held = sum(p.numel() for n, p in model.named_parameters() if n.endswith(names))
    assert cost.layer_params == held
    # What the last layer computes for a sampled row alone: all but its K/V projections.
    kv_projections = 2 * loaded.config.kv_size * loaded.config.hidden_size
    assert cost.output_only_params == held // loaded.config.num_layers - kv_projections
    assert cost.head_params == loaded.config.vocab_size * loaded.config.hidden_size
    assert cost.weight_bytes == 4 * (held + cost.head_params)


def test_decode_is_bandwidth_bound_alone_and_compute_bound_in_bulk(tiny_model_dir: Path) -> None:
    cost = ModelCost.of(load_model(tiny_model_dir, dtype="float32").config, 4, 4)
    machine = Machine(gflops=100.0, gbps=10.0)
    one = cost.decode_step_seconds(machine, 1, 1)
    assert one > cost.weight_bytes / 10e9 > 2 * (cost.layer_params + cost.head_params) / 100e9
    bulk = cost.decode_step_seconds(machine, 4096, 1)
    assert bulk > 4096 * 2 * cost.layer_params / 100e9 > cost.weight_bytes / 10e9
    whole = cost.generation_seconds(machine, 2, 16, 8)
    assert whole > cost.prefill_seconds(machine, 2, 16) + 7 * cost.decode_step_seconds(
        machine, 2, 17
    )


def test_measures_the_machine() -> None:
    assert "usable cores" in describe_cpu() and "load average" in describe_cpu()
    assert matmul_gflops(torch.float32, 64, 64, m=64) > 0.01
    assert memory_gbps(8 << 20) > 0.01


def test_peer_environment(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    env = peer_environment(str(tmp_path / "bin" / "python"), threads=2)
    assert env["LD_PRELOAD"].split(":")[-1] == str(tmp_path / "lib" / "libiomp5.so")
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_KVCACHE_SPACE"] == "1"
