"""The backend dispatch: which kernels a runner picks, and when it falls back to the torch references.

The kernel ops are chosen once per model (the CPU kernels under auto, the GPU's Triton kernels for a CUDA
device, the references when they cannot run or when asked); the fused residual + RMSNorm equals the unfused
form bitwise. The Triton kernels themselves are tested in test_triton_ops.py and test_triton_attention.py (on
the CPU under Triton's interpreter without a GPU), and bench/gpu_check.py checks and times them at GPU sizes.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from rill.kernels import cpu as cpu_kernels
from rill.kernels import gpu
from rill.launcher import shard_command
from rill.shard.config import ShardConfig
from rill.shard.layers.backend import KernelLayer
from rill.shard.layers.norm import RMSNorm
from rill.shard.runner import ModelRunner
from rill.shard.server import parse_args

from .conftest import make_runner, save_tiny_model


def test_backend_flag_must_match_the_device(tmp_path):
    assert ShardConfig(model_path=tmp_path, socket_path=tmp_path / "s").attention_backend == "auto"
    for backend in ("torch", "cpu"):
        ShardConfig(model_path=tmp_path, socket_path=tmp_path / "s", attention_backend=backend)
    with pytest.raises(ValueError, match="needs device 'cuda'"):
        ShardConfig(model_path=tmp_path, socket_path=tmp_path / "s", attention_backend="cuda")
    with pytest.raises(ValueError, match="needs device 'cpu'"):
        ShardConfig(model_path=tmp_path, socket_path=tmp_path / "s", device="cuda", attention_backend="cpu")


def test_attention_backend_flag_reaches_the_shard(tmp_path):
    config = parse_args(["--model-id", str(tmp_path), "--socket", "s", "--attention-backend", "torch"])
    assert config.attention_backend == "torch"
    assert parse_args(["--model-id", str(tmp_path), "--socket", "s"]).attention_backend == "auto"


def test_launcher_passes_the_backend(monkeypatch, tmp_path):
    from rill import launcher

    (tmp_path / "model").mkdir()
    router = tmp_path / "rill-router"
    router.write_text("")
    config = launcher.parse_args(
        ["--model-id", str(tmp_path / "model"), "--router-bin", str(router), "--device", "cpu",
         "--attention-backend", "torch"],
        environ={},
    )  # fmt: skip
    command = shard_command(config, tmp_path / "sock", 0)
    assert command[command.index("--attention-backend") + 1] == "torch"
    with pytest.raises(SystemExit):
        launcher.parse_args(
            ["--model-id", str(tmp_path / "model"), "--router-bin", str(router), "--device", "cpu",
             "--attention-backend", "cuda"],
            environ={},
        )  # fmt: skip


def kernel_layer_ops(runner) -> set[type | None]:
    return {type(m.ops) if m.ops else None for m in runner.model.modules() if isinstance(m, KernelLayer)}


def test_runner_on_cpu_picks_the_cpu_kernels_once(llama_runner):
    assert isinstance(llama_runner.ops, cpu_kernels.CpuOps)
    assert kernel_layer_ops(llama_runner) == {cpu_kernels.CpuOps}
    assert llama_runner.decode_graphs is None


def test_torch_backend_runs_the_references(llama_dir):
    runner = make_runner(llama_dir, attention_backend="torch")
    assert runner.ops is None and kernel_layer_ops(runner) == {None}


def test_auto_falls_back_to_torch_when_the_kernels_cannot_build(llama_dir, monkeypatch, caplog):
    monkeypatch.setattr(
        cpu_kernels.CpuOps, "unavailable_reason", lambda self: "no C++ compiler (g++/c++) on PATH"
    )
    with caplog.at_level(logging.WARNING):
        runner = make_runner(llama_dir)
    assert runner.ops is None and kernel_layer_ops(runner) == {None}
    assert "no C++ compiler (g++/c++) on PATH: using the torch references" in caplog.text
    with pytest.raises(ValueError, match="no C\\+\\+ compiler"):
        make_runner(llama_dir, attention_backend="cpu")


def test_a_head_dim_the_cpu_kernel_cannot_run_keeps_the_references(tmp_path):
    path = save_tiny_model(
        tmp_path, hidden_size=40, num_attention_heads=2, num_key_value_heads=1
    )  # head_dim 20
    assert make_runner(path).ops is None
    with pytest.raises(ValueError, match="multiple of 16"):
        make_runner(path, attention_backend="cpu")


def choose_ops_on_cuda(runner, attention_backend: str):
    """`ModelRunner._choose_ops` as a runner of this model on a CUDA device would run it."""
    fake = SimpleNamespace(
        config=SimpleNamespace(attention_backend=attention_backend, kv_cache_dtype="auto"),
        device=torch.device("cuda"),
        model=runner.model,
    )
    return ModelRunner._choose_ops(fake)


def test_a_cuda_runner_picks_the_triton_kernels_or_says_why_not(llama_runner, monkeypatch, caplog):
    if not torch.cuda.is_available():
        with caplog.at_level(logging.WARNING):
            assert choose_ops_on_cuda(llama_runner, "auto") is None
        assert "no CUDA device for Rill's Triton kernels: using the torch references" in caplog.text
        with pytest.raises(ValueError, match="no CUDA device"):
            choose_ops_on_cuda(llama_runner, "cuda")
        monkeypatch.setattr(gpu.GpuOps, "unavailable_reason", lambda self: None)
    for backend in ("auto", "cuda"):
        assert isinstance(choose_ops_on_cuda(llama_runner, backend), gpu.GpuOps)
    assert choose_ops_on_cuda(llama_runner, "torch") is None


def test_a_head_dim_the_triton_attention_cannot_run_keeps_the_references(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu.GpuOps, "unavailable_reason", lambda self: None)
    path = save_tiny_model(tmp_path, hidden_size=40, num_attention_heads=2, num_key_value_heads=1)
    runner = make_runner(path, attention_backend="torch")  # head_dim 20
    assert choose_ops_on_cuda(runner, "auto") is None
    with pytest.raises(ValueError, match="multiple of 16"):
        choose_ops_on_cuda(runner, "cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_norm_equals_unfused_reference(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6).to(dtype)
    norm.weight.data = torch.randn(64).to(dtype)
    x, residual = torch.randn(5, 64).to(dtype), torch.randn(5, 64).to(dtype)
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(out, norm(residual + x))
