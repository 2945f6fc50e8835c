"""Speculative decoding by prompt lookup (`--speculative ngram`): Rill with and without it, side by side in
one run, where answers copy their prompt and where they do not.

    python -m bench.suite speculative [--num-requests 24] [--num-threads N]

Starts Rill twice — speculation off, and `--speculative ngram --num-speculative-tokens 4` — and runs
`python -m bench compare` (off first, then on) on the `repeat` workload through the chat API (greedy: copy
a function or two paragraphs with one rename) at 1, 4 and 16 clients (`--num-requests` requests, at most 4
a client), then on the peers workload (random words, 16 clients, `--num-requests`), whose answers do not
copy their prompt: what drafts that fail cost. Ratios are on / off. After each run it reads the
speculating server's `/metrics` for its acceptance rate (accepted / proposed tokens) and the tokens accepted
per draft. Speculation changes no token, so the two sides' answers have the same lengths, request by
request; the suite checks that too.
"""

from __future__ import annotations

import argparse
from typing import Any

from bench import peers
from bench.harness import compare, metrics, ratio, rill

SPECULATIVE_FLAGS = ["--speculative", "ngram", "--num-speculative-tokens", "4"]
REPEAT_CLIENTS = (1, 4, 16)
REQUESTS_PER_CLIENT = 4
DRAFTS = "rill_spec_decode_num_drafts_total"
DRAFT_TOKENS = "rill_spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "rill_spec_decode_num_accepted_tokens_total"


def repeat_workload(args: argparse.Namespace, clients: int) -> list[str]:
    """`python -m bench` flags of the repeat workload at `clients` concurrent clients: `--num-requests`, but
    at most 4 a client (a single client's answers come one at a time; this keeps the suite short)."""
    num_requests = min(args.num_requests, REQUESTS_PER_CLIENT * clients)
    return ["--workload", "repeat", "--api", "chat", "--concurrency", str(clients),
            "--num-requests", str(num_requests)]  # fmt: skip


def acceptance(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Drafts, proposed and accepted tokens between two `metrics` samples, their acceptance rate and the
    tokens accepted per draft (None without drafts). A counter the server has not exported yet counts 0."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    drafts, proposed, accepted = delta(DRAFTS), delta(DRAFT_TOKENS), delta(ACCEPTED_TOKENS)
    return {
        "drafts": drafts,
        "draft_tokens": proposed,
        "accepted_tokens": accepted,
        "acceptance_rate": accepted / proposed if proposed else None,
        "accepted_per_draft": accepted / drafts if drafts else None,
    }


def length_mismatches(report: dict[str, Any]) -> list[int]:
    """Indices of the requests whose output lengths differ between the two sides (or that failed on one)."""
    lengths = [
        {record["index"]: record["output_tokens"] for record in report[side]["requests"] if record["is_ok"]}
        for side in ("a", "b")
    ]
    indices = sorted(lengths[0].keys() | lengths[1].keys())
    return [index for index in indices if lengths[0].get(index) != lengths[1].get(index)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    runs = {f"repeat, {clients} client{'s' * (clients > 1)}": repeat_workload(args, clients)
            for clients in REPEAT_CLIENTS}  # fmt: skip
    runs[f"peers, {peers.CLIENTS} clients"] = peers.workload(args)
    flags = ["--max-batch-size", str(max(*REPEAT_CLIENTS, peers.CLIENTS))]
    results: dict[str, Any] = {}
    with rill(args, "spec-off", *flags) as off, rill(args, "spec-on", *flags, *SPECULATIVE_FLAGS) as on:
        for label, workload in runs.items():
            print(f"\n[speculative] {label}", flush=True)
            before = metrics(on)
            report = compare(args, off, on, *workload)
            report["speculation"] = acceptance(before, metrics(on))
            report["length_mismatches"] = length_mismatches(report)
            results[label] = report
    print(f"\nspeculation on / off ({' '.join(SPECULATIVE_FLAGS)}), {args.num_threads} thread(s):")
    print("| workload | output tok/s | ITL p50 | TTFT p50 | acceptance rate | accepted per draft |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, report in results.items():
        r, spec = report["ratios"], report["speculation"]
        rate = "n/a" if spec["acceptance_rate"] is None else f"{100 * spec['acceptance_rate']:.0f}%"
        per_draft = "n/a" if spec["accepted_per_draft"] is None else f"{spec['accepted_per_draft']:.2f}"
        print(f"| {label} | {ratio(r['output_tokens_per_s'])} | {ratio(r['itl_ms.p50'])} | "
              f"{ratio(r['ttft_ms.p50'])} | {rate} | {per_draft} |")  # fmt: skip
    for label, report in results.items():
        if report["length_mismatches"]:
            print(
                f"WARNING: {label}: output lengths differ on/off for requests {report['length_mismatches']}"
            )
    return results
