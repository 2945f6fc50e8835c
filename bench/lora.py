"""Many LoRA adapters on one server: the peers workload with 0, 1 and 8 adapters mixed evenly, each against
the same model served without LoRA, side by side in one run.

    python -m bench.suite lora [--num-requests 24] [--rounds 2] [--num-threads N]

Makes 8 random rank-16 adapters of the model (every attention and MLP projection, as a fine-tune usually
targets; `peft`, a dev dependency), starts Rill twice — plain, and with `--max-loras 8 --lora-adapters` — with
the prefix cache off on both (requests of different adapters never share it; this measures the forward), and
runs `python -m bench compare` three times: the LoRA server's requests all on the base model, all on one
adapter, and spread over the 8 (request i on adapter i mod 8). Ratios are LoRA server / plain server, rounds
alternating in order with fresh prompts each round.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from bench import peers
from bench.harness import compare, ratio, rill

NUM_ADAPTERS = 8
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(model: Path, folder: Path, count: int, rank: int) -> dict[str, Path]:
    """`count` PEFT adapters of `model` with random A and B, saved as `peft` saves them."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    adapters = {}
    for index in range(count):
        torch.manual_seed(index)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False)
        adapters[f"adapter-{index}"] = folder / f"adapter-{index}"
        get_peft_model(base, config).save_pretrained(adapters[f"adapter-{index}"])
    return adapters


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rill.convert import ensure_default_model

    model = args.model_id or ensure_default_model()
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rill-bench-lora-") as folder:
        adapters = make_adapters(Path(model), Path(folder), NUM_ADAPTERS, RANK)
        flags = ["--max-batch-size", str(peers.CLIENTS), "--no-prefix-caching"]
        listed = ",".join(f"{name}={path}" for name, path in adapters.items())
        lora_flags = [
            "--max-loras",
            str(NUM_ADAPTERS),
            "--max-lora-rank",
            str(RANK),
            "--lora-adapters",
            listed,
        ]
        with rill(args, "plain", *flags) as plain, rill(args, "lora", *flags, *lora_flags) as lora:
            names = list(adapters)
            mixes = {"0 adapters": [], "1 adapter": names[:1], f"{NUM_ADAPTERS} adapters": names}
            for label, mix in mixes.items():
                models = ["--b-model", ",".join(mix)] if mix else []
                alternating = ["--rounds", str(args.rounds), "--fresh-prompts"]
                print(f"\n[lora] {label}", flush=True)
                results[label] = compare(args, plain, lora, *peers.workload(args), *alternating, *models)
    print(f"\nLoRA server / plain server, rank {RANK}, {args.num_threads} thread(s), peers workload:")
    print("| requests on | output tok/s | TTFT p50 | ITL p50 |")
    print("| --- | ---: | ---: | ---: |")
    for label, report in results.items():
        r = report["ratios"]
        print(f"| {label} | {ratio(r['output_tokens_per_s'])} | {ratio(r['ttft_ms.p50'])} | "
              f"{ratio(r['itl_ms.p50'])} |")  # fmt: skip
    return results
