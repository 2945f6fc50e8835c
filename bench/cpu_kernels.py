"""Times Rill's CPU paged-attention kernel against the shard's torch reference (one layer, float32), and the
LoRA product beside the linear it adds to.

    python -m bench.cpu_kernels [--repeats 20]

Cases: a decode step of 16 sequences at context 512 and a 512-token prefill, 9 query / 3 KV heads,
head_dim 64, block size 16. Prints the median time per call of each, and the time to read the case's K/V
once at 30 GB/s. One layer's K/V (12.6 MB for the decode case) stays in the last-level cache between calls, so
last, the decode case is timed as a model runs it: 30 layers, each with its own pools (K/V from memory).
Then `lora_add` (4 slots of rank 16, every row with an adapter, slots mixed) beside `linear` for the default
model's qkv (576 -> 960, three parts) and gate_up (576 -> 2 x 1536) projections, at decode and prefill row
counts. Single run on whatever else the machine is doing: a rough figure, not a controlled measurement.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable

import torch
from rill.kernels import cpu

from bench.kernel_cases import AttentionCase, make_case, run_attention

NUM_LAYERS = 30  # the default model's
OPS = cpu.CpuOps()
# The default model's (SmolLM2-135M) projections with LoRA: (name, in, part_ends), and the adapters' shape.
LORA_PROJECTIONS = (("qkv", 576, (576, 768, 960)), ("gate_up", 576, (1536, 3072)))
LORA_SLOTS, LORA_RANK = 4, 16


def decode_case(seed: int = 0) -> AttentionCase:
    return make_case([1] * 16, [512] * 16, 9, 3, 64, 16, torch.float32, device="cpu", seed=seed)


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def kernel_call(case: AttentionCase) -> Callable[[], torch.Tensor]:
    meta = case.metadata()
    return lambda: OPS.paged_attention(case.q, case.k_pool, case.v_pool, meta, case.scale)


def lora_beside_linear(repeats: int) -> None:
    """Median ms of `linear` and of `lora_add` on its output, per projection and row count."""
    print(f"{'projection':<12}{'rows':>6}{'linear ms':>11}{'lora_add ms':>13}{'lora / linear':>15}")
    generator = torch.Generator().manual_seed(0)
    for name, in_features, part_ends in LORA_PROJECTIONS:
        out_features = part_ends[-1]
        packed = OPS.pack_linear(torch.randn(out_features, in_features, generator=generator))
        a = torch.randn(LORA_SLOTS, len(part_ends) * LORA_RANK, in_features, generator=generator)
        b = torch.randn(LORA_SLOTS, out_features, LORA_RANK, generator=generator)
        for rows in (1, 16, 64, 512):
            x = torch.randn(rows, in_features, generator=generator)
            y = OPS.linear(x, packed, out_features)
            slots = (torch.arange(rows, dtype=torch.int32) % LORA_SLOTS).contiguous()
            linear = median_ms(functools.partial(OPS.linear, x, packed, out_features), repeats)
            lora = median_ms(functools.partial(OPS.lora_add, y, x, a, b, slots, part_ends), repeats)
            print(f"{name:<12}{rows:>6}{linear:>11.3f}{lora:>13.3f}{lora / linear:>15.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    cpu.load()
    cases = {
        "decode 16 x 512": decode_case(),
        "prefill 512": make_case([512], [512], 9, 3, 64, 16, torch.float32, device="cpu"),
    }
    print(f"threads: {torch.get_num_threads()}")
    print(
        f"{'case':<18}{'K/V MB':>8}{'read@30GB/s ms':>16}{'kernel ms':>11}{'torch ref ms':>14}{'speedup':>9}"
    )
    for name, case in cases.items():
        OPS.store_kv(case.k, case.v, case.k_pool, case.v_pool, case.slot_mapping)
        kv_bytes = 2 * sum(case.context_lens) * case.k_pool[0, 0].numel() * case.k_pool.element_size()
        kernel = median_ms(kernel_call(case), args.repeats)
        reference = median_ms(lambda c=case: run_attention(c, None), max(3, args.repeats // 5))
        print(
            f"{name:<18}{kv_bytes / 1e6:>8.1f}{kv_bytes / 30e9 * 1e3:>16.2f}{kernel:>11.2f}{reference:>14.1f}"
            f"{reference / kernel:>8.0f}x"
        )
    layers = []
    for layer in range(NUM_LAYERS):
        case = decode_case(seed=layer)
        OPS.store_kv(case.k, case.v, case.k_pool, case.v_pool, case.slot_mapping)
        layers.append(kernel_call(case))
    step = median_ms(lambda: [call() for call in layers], max(3, args.repeats // 4))
    print(f"decode 16 x 512, {NUM_LAYERS} layers, each its own pools (K/V from memory): {step:.1f} ms a step")
    lora_beside_linear(args.repeats)


if __name__ == "__main__":
    main()
