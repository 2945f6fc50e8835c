"""The one-call decoder stack (rill.kernels.cpu.decoder_stack, installed by the runner as FusedDecoderLayers)
against the per-layer modules on the CPU kernels: bitwise the same logits and the same K/V written, for
prefill, chunked and decode rows in one batch, with biases (Qwen2) and sliding windows (Mistral), in float32
and bfloat16, over KV pools of the model's dtype and int8 ones; used exactly where it applies, by what a layer
computes rather than by its class."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rill.kernels import cpu
from rill.shard.layers.decoder_stack import FusedDecoderLayers
from rill.shard.models import llama
from rill.shard.runner import ModelRunner
from torch import nn

from .conftest import chunk, logits_of, make_runner, save_tiny_model

PROMPT = [(7 * i + 3) % 300 for i in range(30)]
OTHER = [(11 * i + 5) % 300 for i in range(13)]

# name: (model_type, config overrides)
MODELS = {
    "llama": ("llama", {}),
    "qwen2-bias": ("qwen2", {}),
    "mistral-windowed": ("mistral", {"sliding_window": 8, "head_dim": None}),
}


def dtypes() -> list[str]:
    return ["float32", "bfloat16"] if torch.bfloat16 in cpu.linear_dtypes() else ["float32"]


def fused_runs(runner: ModelRunner) -> list[FusedDecoderLayers]:
    return [unit for unit in runner.model.model.layers if isinstance(unit, FusedDecoderLayers)]


def unfuse(runner: ModelRunner) -> None:
    """Back to the per-layer modules."""
    model = runner.model.model
    units = [unit.layers if isinstance(unit, FusedDecoderLayers) else [unit] for unit in model.layers]
    model.layers = nn.ModuleList(layer for unit in units for layer in unit)


def three_calls(runner: ModelRunner) -> list[torch.Tensor]:
    """Logits of a prefill beside another one, then a chunk beside a decode row, then two decode rows."""
    return [
        logits_of(runner, chunk(1, PROMPT[:20], 0, first_block=1), chunk(2, OTHER, 0, first_block=20)),
        logits_of(
            runner,
            chunk(1, PROMPT[20:], 20, first_block=1),
            chunk(2, [5], len(OTHER), first_block=20),
        ),
        logits_of(
            runner,
            chunk(1, [9], len(PROMPT), first_block=1),
            chunk(2, [6], len(OTHER) + 1, first_block=20),
        ),
    ]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("name", list(MODELS))
def test_stack_is_bitwise_the_layer_modules(
    tmp_path: Path, name: str, dtype: str, kv_cache_dtype: str
) -> None:
    model_type, overrides = MODELS[name]
    path = save_tiny_model(tmp_path / name, model_type=model_type, **overrides)
    runners = [
        make_runner(path, attention_backend="cpu", dtype=dtype, kv_cache_dtype=kv_cache_dtype)
        for _ in range(2)
    ]
    num_layers = len(runners[0].model.model.layers)
    assert len(fused_runs(runners[0])) == 1, "one run: every layer of a plain Llama-family model"
    unfuse(runners[1])
    assert len(runners[1].model.model.layers) > num_layers and not fused_runs(runners[1])
    with_stack, with_modules = (three_calls(runner) for runner in runners)
    for call, (a, b) in enumerate(zip(with_stack, with_modules, strict=True)):
        assert torch.equal(a, b), f"call {call}: max diff {(a - b).abs().max().item()}"
    caches = [runner.kv_cache for runner in runners]
    assert caches[0] is not None and caches[1] is not None
    assert caches[0].is_int8 == (kv_cache_dtype == "int8")
    for (pools, _), (other_pools, _) in zip(caches[0].pool_pairs(), caches[1].pool_pairs(), strict=True):
        for layer, (pool, other) in enumerate(zip(pools, other_pools, strict=True)):
            assert torch.equal(pool, other), f"layer {layer}"  # K, V (and their int8 scales)


def test_stack_is_used_only_where_it_applies(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path / "llama")
    assert not fused_runs(make_runner(path, attention_backend="torch"))
    qwen3 = save_tiny_model(tmp_path / "qwen3", model_type="qwen3")  # q/k norms: the family's own layer
    assert not fused_runs(make_runner(qwen3, attention_backend="cpu"))


class SameMathLayer(llama.LlamaDecoderLayer):
    """A family's layer that changes nothing of the math (only its class)."""


class OtherMathLayer(llama.LlamaDecoderLayer):
    """A family's layer with a forward of its own."""

    def forward(self, positions, hidden, residual):
        return super().forward(positions, hidden, residual)


def test_a_subclass_is_fused_by_what_it_computes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = save_tiny_model(tmp_path / "llama")
    monkeypatch.setattr(llama.LlamaModel, "layer_class", SameMathLayer)
    assert len(fused_runs(make_runner(path, attention_backend="cpu"))) == 1
    monkeypatch.setattr(llama.LlamaModel, "layer_class", OtherMathLayer)
    assert not fused_runs(make_runner(path, attention_backend="cpu"))


def test_stack_rejects_pools_that_do_not_match(tmp_path: Path) -> None:
    runner = make_runner(save_tiny_model(tmp_path / "llama"), attention_backend="cpu")
    (run,) = fused_runs(runner)
    assert runner.kv_cache is not None
    stack, cache = run.kernel, runner.kv_cache
    hidden = torch.zeros(1, 64)
    cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
    # No LoRA slots, no int8 scale pools.
    metadata = (torch.tensor([[1]]), torch.tensor([0, 1]), torch.tensor([4]), None, [], [])
    with pytest.raises(RuntimeError, match="one K and one V pool per layer"):
        stack.forward(hidden, None, torch.tensor([0]), cos, sin, cache.k[:1], cache.v[:1], *metadata)
    with pytest.raises(RuntimeError, match="outside the pool"):
        outside = torch.tensor([[10**6]])
        stack.forward(hidden, None, torch.tensor([0]), cos, sin, cache.k, cache.v, outside, *metadata[1:])
