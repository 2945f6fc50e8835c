"""Speculative decoding (`--speculative ngram`, and `draft`): Rill with and without it, side by side in one
run, where answers copy their prompt and where nothing asks them to.

    python -m bench.suite speculative [--num-requests 24] [--num-threads N]

Starts Rill twice — speculation off, and `--speculative ngram --num-speculative-tokens 4` — and runs
`python -m bench compare` (off first, then on) on the `repeat` workload through the chat API (greedy: copy
a function or two paragraphs with one rename) at 1, 4 and 16 clients (`--num-requests` requests, at most 8
a client), then on the peers workload (random words, 16 clients, `--num-requests`), which asks for no
copying: what speculation costs with less to copy. Then a third server, `--speculative draft` with the model
as its own draft (no smaller model with its tokenizer is at hand: every proposal is right and costs a full
forward), against the first at 1 client on `repeat`: what the draft machinery costs. Ratios are on / off.

After each run it reads the speculating server's `/metrics` for its acceptance rate (accepted / proposed
tokens) and the tokens accepted per draft. Speculation changes no token, so the two sides' answers have the
same lengths, request by request; the suite checks that too. Last, it asks the server without speculation
for the answer to each of the 20 repeat prompts and prints the share of their tokens a prompt lookup would
have had accepted: the ceiling the acceptance is measured against.
"""

from __future__ import annotations

import argparse
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench import peers
from bench.harness import compare, metrics, ratio, rill
from bench.servers import Server
from bench.workloads import REPEAT_OUTPUT_TOKENS, repeat_prompts

NUM_SPECULATIVE_TOKENS = 4
SPECULATIVE_FLAGS = ["--speculative", "ngram", "--num-speculative-tokens", str(NUM_SPECULATIVE_TOKENS)]
LOOKUP_NGRAMS = (3, 2, 1)  # the ceiling's lookup: the longest of these suffixes that occurred before
REPEAT_CLIENTS = (1, 4, 16)
REQUESTS_PER_CLIENT = 8
DRAFTS = "rill_spec_decode_num_drafts_total"
DRAFT_TOKENS = "rill_spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "rill_spec_decode_num_accepted_tokens_total"


def repeat_workload(args: argparse.Namespace, clients: int) -> list[str]:
    """`python -m bench` flags of the repeat workload at `clients` concurrent clients: `--num-requests`, but
    at most 8 a client (a single client's answers come one at a time; this keeps the suite short)."""
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


def lookup_proposal(ids: list[int], end: int, k: int) -> list[int]:
    """Prompt lookup's proposal after `ids[:end]`: the up to `k` tokens that followed the latest earlier
    occurrence of its last 3 tokens, else 2, else 1 (none if no suffix occurred before), never past `end`."""
    for n in LOOKUP_NGRAMS:
        suffix = ids[end - n : end]
        for start in range(end - n - 1, -1, -1):
            if ids[start : start + n] == suffix:
                return ids[start + n : min(start + n + k, end)]
    return []


def accepted_by_lookup(ids: list[int], num_prompt: int, k: int) -> tuple[int, int]:
    """(tokens accepted, steps) of greedy decoding that speculates by `lookup_proposal` and produces
    `ids[num_prompt:]`: each step accepts the longest run of its proposal that matches the answer, plus the
    one token the model samples after it."""
    accepted, steps, end = 0, 0, num_prompt
    while end < len(ids):
        run = 0
        for token in lookup_proposal(ids, end, k):
            if end + run >= len(ids) or ids[end + run] != token:
                break
            run += 1
        accepted, steps, end = accepted + run, steps + 1, end + run + 1
    return accepted, steps


def _post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{server.url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=900) as response:
        return dict(json.loads(response.read()))


def lookup_ceiling(server: Server) -> dict[str, float]:
    """What prompt lookup could save on the repeat workload at most (verification free): the server's
    greedy answer to each repeat prompt, and the share of its tokens `accepted_by_lookup` with
    `NUM_SPECULATIVE_TOKENS` proposals a step. The answer's ids are its text tokenized again (as a rule the
    ids generated; the end token left out)."""

    def one(prompt: str) -> tuple[int, int, int]:
        messages = [{"role": "user", "content": prompt}]
        body = {"messages": messages, "max_tokens": REPEAT_OUTPUT_TOKENS, "temperature": 0}
        answer = _post(server, "/v1/chat/completions", body)
        text = answer["choices"][0]["message"]["content"]
        prompt_ids = [token["id"] for token in _post(server, "/tokenize", {"messages": messages})["tokens"]]
        tokens = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        ids = prompt_ids + [token["id"] for token in tokens]
        return len(tokens), *accepted_by_lookup(ids, len(prompt_ids), NUM_SPECULATIVE_TOKENS)

    with ThreadPoolExecutor(peers.CLIENTS) as pool:
        rows = list(pool.map(one, repeat_prompts()))
    num_tokens, accepted, steps = (sum(row[column] for row in rows) for column in range(3))
    return {
        "answer_tokens": num_tokens,
        "accepted_share": accepted / num_tokens,
        "tokens_per_step": num_tokens / steps,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rill.convert import ensure_default_model

    workloads = {f"repeat, {clients} client{'s' * (clients > 1)}": repeat_workload(args, clients)
                 for clients in REPEAT_CLIENTS}  # fmt: skip
    workloads[f"peers, {peers.CLIENTS} clients"] = peers.workload(args)
    flags = ["--max-batch-size", str(max(*REPEAT_CLIENTS, peers.CLIENTS))]
    runs: dict[str, Any] = {}
    with rill(args, "spec-off", *flags) as off, rill(args, "spec-on", *flags, *SPECULATIVE_FLAGS) as on:
        for label, workload in workloads.items():
            print(f"\n[speculative] {label}", flush=True)
            before = metrics(on)
            report = compare(args, off, on, *workload)
            report["speculation"] = acceptance(before, metrics(on))
            report["length_mismatches"] = length_mismatches(report)
            runs[label] = report
        # A draft model needs a smaller model with the same tokenizer; the only one at hand is the model
        # itself: every proposal right, each costing a full forward of the draft.
        model = str(args.model_id or ensure_default_model())
        with rill(args, "spec-draft", *flags, "--speculative", "draft", "--draft-model-id", model) as draft:
            label = "repeat, 1 client, the model as its own draft"
            print(f"\n[speculative] {label}", flush=True)
            before = metrics(draft)
            report = compare(args, off, draft, *repeat_workload(args, 1))
            report["speculation"] = acceptance(before, metrics(draft))
            report["length_mismatches"] = length_mismatches(report)
            runs[label] = report
        # last: its requests fill the off server's prefix cache, which the runs must find as cold as on's
        print("\n[speculative] the lookup ceiling: the repeat prompts' answers, speculation off", flush=True)
        ceiling = lookup_ceiling(off)
    print(f"\nspeculation on / off ({' '.join(SPECULATIVE_FLAGS)}), {args.num_threads} thread(s):")
    # TPOT, not ITL: tokens accepted together reach the client together, so ITL's median says little.
    print("| workload | output tok/s | TPOT p50 | TTFT p50 | acceptance rate | accepted per draft |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for label, report in runs.items():
        r, spec = report["ratios"], report["speculation"]
        rate = "n/a" if spec["acceptance_rate"] is None else f"{100 * spec['acceptance_rate']:.0f}%"
        per_draft = "n/a" if spec["accepted_per_draft"] is None else f"{spec['accepted_per_draft']:.2f}"
        print(f"| {label} | {ratio(r['output_tokens_per_s'])} | {ratio(r['tpot_ms.p50'])} | "
              f"{ratio(r['ttft_ms.p50'])} | {rate} | {per_draft} |")  # fmt: skip
    print(f"\nlookup ceiling, repeat prompts: {100 * ceiling['accepted_share']:.0f}% of "
          f"{ceiling['answer_tokens']:.0f} answer tokens accepted, "
          f"{ceiling['tokens_per_step']:.2f} tokens a step")  # fmt: skip
    for label, report in runs.items():
        if report["length_mismatches"]:
            print(
                f"WARNING: {label}: output lengths differ on/off for requests {report['length_mismatches']}"
            )
    return {"lookup_ceiling": ceiling, "runs": runs}
