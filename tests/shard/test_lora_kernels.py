"""The LoRA kernels (`KernelOps.lora_add`: the CPU's C++ lora.cpp and the Triton shrink/expand, the latter
under Triton's interpreter where there is no GPU) against the torch reference `lora_add_reference`, and the
CPU decoder stack with LoRA against the same layers run one module at a time.

Bounds: float32 within 1e-5 of the reference relative to the output's largest magnitude (the kernels sum in
another order than torch's matmul: h over `in` inputs, then R products per output); bfloat16 within 2e-2
and float16 (Triton only) within 4e-3 (the same rounding points, from float32 sums that differ in their last
bits). Bitwise, for each kernel: a
row alone and inside a batch of mixed slots, an adapter in slot 0 and in slot 3, rows without a slot left as
they were; on the CPU also 1 and 2 threads, and the fused decoder stack against the modules.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from rill.kernels import cpu, gpu
from rill.kernels.ops import KernelOps
from rill.shard.layers.lora import lora_add_reference
from rill.shard.runner import ModelRunner

from bench.kernel_cases import max_relative_error

from .conftest import chunk, logits_of, make_runner, save_tiny_model
from .test_decoder_stack import MODELS, fused_runs, unfuse
from .test_lora import lora_runner, save_adapter, with_adapter

DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"
OPS: dict[str, KernelOps] = {"cpu": cpu.CpuOps(), "triton": gpu.GpuOps()}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def device_of(name: str) -> str:
    return "cpu" if name == "cpu" else DEVICE


def adapters(
    num_slots: int, rank: int, in_features: int, part_ends: tuple[int, ...], seed: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacks (a, b) whose slot s holds an adapter of a random rank in 1..R (zero-padded to R), one of them
    leaving a part alone (zero in both) when there are several parts."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(num_slots, len(part_ends) * rank, in_features, generator=generator) / in_features**0.5
    b = torch.randn(num_slots, part_ends[-1], rank, generator=generator)
    for slot in range(num_slots):
        adapter_rank = int(torch.randint(1, rank + 1, (1,), generator=generator))
        b[slot, :, adapter_rank:] = 0
        for part in range(len(part_ends)):
            a[slot, part * rank + adapter_rank : (part + 1) * rank] = 0
    if len(part_ends) > 1:
        a[0, rank : 2 * rank] = 0
        b[0, part_ends[0] : part_ends[1]] = 0
    return a.to(dtype), b.to(dtype)


def run(name: str, y: torch.Tensor, x, a, b, slots, part_ends) -> torch.Tensor:
    """y + the kernel's LoRA product (y untouched), on CPU tensors."""
    device = device_of(name)
    out = y.clone().to(device)
    OPS[name].lora_add(out, x.to(device), a.to(device), b.to(device), slots.to(device), part_ends)
    return out.cpu()


def kernels() -> list[str]:
    return ["cpu", "triton"]


# (rows, in, part_ends, R): decode and prefill row counts, in/out sizes off the vector widths, 1 to 3 parts.
SHAPES = [
    (1, 64, (48, 64, 80), 16),
    (5, 37, (21,), 1),
    (16, 100, (70, 140), 8),
    (64, 96, (96, 120, 144), 64),
    (600, 33, (17, 34, 51), 5),
]


# The CPU kernels take float32 and bfloat16; the GPU's float16 too.
KERNEL_DTYPES = [
    ("cpu", torch.float32),
    ("cpu", torch.bfloat16),
    ("triton", torch.float32),
    ("triton", torch.bfloat16),
    ("triton", torch.float16),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"rows{s[0]}-in{s[1]}-out{s[2][-1]}-R{s[3]}")
@pytest.mark.parametrize(("name", "dtype"), KERNEL_DTYPES)
def test_lora_add_matches_the_reference(name: str, dtype: torch.dtype, shape: tuple) -> None:
    rows, in_features, part_ends, rank = shape
    if name == "triton" and rows > 64 and DEVICE == "cpu":
        rows = 64  # the interpreter runs every program in Python
    torch.manual_seed(rows)
    a, b = adapters(4, rank, in_features, part_ends, seed=rows, dtype=dtype)
    x = torch.randn(rows, in_features).to(dtype)
    y = torch.randn(rows, part_ends[-1]).to(dtype)
    slots = torch.randint(-1, 4, (rows,), dtype=torch.int32)
    slots[0] = 2  # at least one row with an adapter
    expected = y.clone()
    lora_add_reference(expected, x, a, b, slots, part_ends)
    actual = run(name, y, x, a, b, slots, part_ends)
    assert max_relative_error(actual, expected) <= TOLERANCE[dtype]
    assert not torch.equal(expected[slots >= 0], y[slots >= 0]), "the adapters change the rows they serve"
    base = slots < 0
    assert torch.equal(actual[base], y[base]), "rows without a slot are left as they were"


@pytest.mark.parametrize("name", kernels())
def test_a_row_has_the_same_bits_alone_in_a_batch_and_in_any_slot(name: str) -> None:
    in_features, part_ends, rank = 75, (40, 56, 72), 12
    a, b = adapters(4, rank, in_features, part_ends, seed=1, dtype=torch.float32)
    torch.manual_seed(1)
    rows = 40
    x, y = torch.randn(rows, in_features), torch.randn(rows, part_ends[-1])
    slots = torch.tensor([(-1, 0, 1, 3, 2)[r % 5] for r in range(rows)], dtype=torch.int32)
    batch = run(name, y, x, a, b, slots, part_ends)
    for r in (3, 17, 38):  # slot 3, slot 3 and slot 1, each alone
        alone = run(name, y[r : r + 1], x[r : r + 1], a, b, slots[r : r + 1], part_ends)
        assert torch.equal(alone[0], batch[r]), f"row {r}"
    # The adapter of slot 3 moved to slot 0 (another adapter now in slot 3): the same bits for its rows.
    swapped = [3, 1, 2, 0]
    moved_slots = torch.where(slots == 3, 0, torch.where(slots == 0, 3, slots)).to(torch.int32)
    moved = run(name, y, x, a[swapped], b[swapped], moved_slots, part_ends)
    assert torch.equal(moved, batch)


def test_cpu_lora_add_does_not_depend_on_the_thread_count() -> None:
    in_features, part_ends, rank = 300, (256, 320, 384), 16
    a, b = adapters(3, rank, in_features, part_ends, seed=2, dtype=torch.float32)
    torch.manual_seed(2)
    x, y = torch.randn(200, in_features), torch.randn(200, part_ends[-1])
    slots = torch.randint(-1, 3, (200,), dtype=torch.int32)
    threads = torch.get_num_threads()
    try:
        results = []
        for num_threads in (1, 2):
            torch.set_num_threads(num_threads)
            results.append(run("cpu", y, x, a, b, slots, part_ends))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0], results[1])


def test_cpu_lora_add_refuses_what_does_not_fit() -> None:
    a, b = adapters(2, 4, 8, (6,), seed=3, dtype=torch.float32)
    x, y = torch.randn(3, 8), torch.randn(3, 6)
    slots = torch.tensor([0, -1, 1], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"row_slots\[2\] = 2 is neither -1 nor one of the 2 LoRA slots"):
        OPS["cpu"].lora_add(y, x, a, b, torch.tensor([0, -1, 2], dtype=torch.int32), (6,))
    with pytest.raises(RuntimeError, match="row_slots must be a contiguous Int"):
        OPS["cpu"].lora_add(y, x, a, b, slots.long(), (6,))
    with pytest.raises(RuntimeError, match="part_ends must end at y's 6 outputs"):
        OPS["cpu"].lora_add(y, x, a, b, slots, (5,))
    with pytest.raises(RuntimeError, match="lora_a must be"):
        OPS["cpu"].lora_add(y, x, a, b, slots, (3, 6))
    with pytest.raises(RuntimeError, match="y must be a contiguous"):
        OPS["cpu"].lora_add(torch.randn(6, 3).T, x, a, b, slots, (6,))


# --- the decoder stack with LoRA --------------------------------------------------------------------------

NUM_SLOTS, RANK = 4, 8
PROMPT = [(7 * i + 3) % 300 for i in range(30)]
OTHER = [(11 * i + 5) % 300 for i in range(13)]


def adapter_runner(path: Path, adapter_dirs: list[Path]) -> ModelRunner:
    """A runner on the CPU kernels with the PEFT adapters in `adapter_dirs` loaded as ids 1, 2, ..."""
    runner = lora_runner(path, attention_backend="cpu", max_loras=NUM_SLOTS, max_lora_rank=RANK)
    for adapter_id, folder in enumerate(adapter_dirs, start=1):
        runner.load_adapter(adapter_id, folder)
    return runner


def three_calls(runner: ModelRunner, adapters: bool = True) -> list[torch.Tensor]:
    """Sequence 1 runs adapter 1, sequence 2 the base model, sequence 3 adapter 2 (all the base model without
    `adapters`): a prefill of 1 beside one of 2, a chunk of 1 beside the prefill of 3, decode rows of 1 and
    2, then a base-only call (no slots)."""
    first, second = (1, 2) if adapters else (0, 0)
    return [
        logits_of(
            runner,
            with_adapter(chunk(1, PROMPT[:20], 0, first_block=1), first),
            chunk(2, OTHER, 0, first_block=20),
        ),
        logits_of(
            runner,
            chunk(1, PROMPT[20:], 20, first_block=1, params=None),
            with_adapter(chunk(3, OTHER[:7], 0, first_block=40), second),
        ),
        logits_of(
            runner,
            chunk(1, [9], len(PROMPT), first_block=1, params=None),
            chunk(2, [6], len(OTHER), first_block=20, params=None),
        ),
        logits_of(runner, chunk(2, [7], len(OTHER) + 1, first_block=20, params=None)),
    ]


@pytest.mark.parametrize("name", list(MODELS))
def test_stack_with_lora_is_bitwise_the_layer_modules(tmp_path: Path, name: str) -> None:
    model_type, overrides = MODELS[name]
    path = save_tiny_model(tmp_path / name, model_type=model_type, **overrides)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    folders = [
        save_adapter(path, tmp_path / "all", seed=1, r=RANK, lora_alpha=16, target_modules=every),
        save_adapter(path, tmp_path / "mlp", seed=2, r=3, lora_alpha=4, target_modules=every[4:]),
    ]
    runners = [adapter_runner(path, folders) for _ in range(2)]
    assert len(fused_runs(runners[0])) == 1, "the adapters' stacks fuse with their layers"
    unfuse(runners[1])
    without_lora = make_runner(path, attention_backend="cpu")
    with_stack, with_modules = (three_calls(runner) for runner in runners)
    base = three_calls(without_lora, adapters=False)
    for call, (a, b) in enumerate(zip(with_stack, with_modules, strict=True)):
        assert torch.equal(a, b), f"call {call}: max diff {(a - b).abs().max().item()}"
    # The adapters change the rows that use them, and only those (sequence 2 runs the base model).
    assert not torch.equal(with_stack[0][0], base[0][0])
    assert not torch.equal(with_stack[1][1], base[1][1])
    assert torch.equal(with_stack[0][1], base[0][1]) and torch.equal(with_stack[3], base[3])


def test_stack_refuses_lora_that_does_not_fit(tmp_path: Path) -> None:
    path = save_tiny_model(tmp_path / "llama")
    runner = adapter_runner(
        path, [save_adapter(path, tmp_path / "qv", seed=6, target_modules=["q_proj", "v_proj"])]
    )
    unfuse(runner)
    parts = [layer.block_parts() for layer in runner.model.model.layers]
    weights = [p.weights() for p in parts]
    shapes = dict(
        intermediate_size=parts[0].down.packed.in_features,
        num_heads=parts[0].attention.num_heads,
        num_kv_heads=parts[0].attention.num_kv_heads,
        head_dim=parts[0].attention.head_dim,
        rms_norm_eps=parts[0].input_norm.eps,
        scale=parts[0].attention.scale,
    )
    stack = cpu.decoder_stack(weights, **shapes)
    assert runner.kv_cache is not None
    cache, hidden = runner.kv_cache, torch.zeros(1, 64)
    cos, sin = torch.ones(1, 8), torch.zeros(1, 8)
    metadata = (torch.tensor([[1]]), torch.tensor([0, 1]), torch.tensor([4]))
    outside = torch.tensor([NUM_SLOTS], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=f"is neither -1 nor one of the {NUM_SLOTS} LoRA slots"):
        stack.forward(hidden, None, torch.tensor([0]), cos, sin, cache.k, cache.v, *metadata, outside, [], [])
    with pytest.raises(RuntimeError, match="down_lora_a and down_lora_b must be given together"):
        cpu.decoder_stack([{**weights[0], "down_lora_b": None}], **shapes)
    with pytest.raises(RuntimeError, match="qkv_lora_b must be"):
        cpu.decoder_stack([{**weights[0], "qkv_lora_b": weights[0]["qkv_lora_b"][:, 1:]}], **shapes)
