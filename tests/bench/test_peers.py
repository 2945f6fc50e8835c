"""The peers suites' own parts that run without llama.cpp: the resident memory read from /proc (on a process
that wrote a known amount, and on processes shaped like Rill's shards and router), the workload's clients,
the summary lines."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.peers import (
    CONTEXT_PER_SLOT,
    children,
    format_gguf_run,
    memory_ratio,
    process_status,
    rill_memory,
    workload,
)
from bench.suite import int_list

SLEEPER = "import time; time.sleep(60)"


@pytest.fixture
def rill_like() -> Iterator[dict[str, list[subprocess.Popen[bytes]]]]:
    """Children of this process shaped like a Rill launcher's: two `python -m rill.shard.server` and one
    other (the router), all sleeping; killed after the test."""
    shard_command = [sys.executable, "-c", SLEEPER, "-m", "rill.shard.server"]
    processes = {
        "shards": [subprocess.Popen(shard_command) for _ in range(2)],
        "router": [subprocess.Popen([sys.executable, "-c", SLEEPER])],
    }
    yield processes
    for process in [*processes["shards"], *processes["router"]]:
        process.kill()
        process.wait()


def resident_child(megabytes: int) -> subprocess.Popen[str]:
    """A Python process that has written `megabytes` MiB of its own memory, once it says so."""
    code = f"import sys, time; block = b'x' * ({megabytes} << 20); print('ready', flush=True); time.sleep(60)"
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline() == "ready\n"
    return process


def test_resident_memory_counts_the_memory_a_process_wrote() -> None:
    baseline, writer = resident_child(0), resident_child(64)
    try:
        grown = process_status(writer.pid)["VmRSS"] - process_status(baseline.pid)["VmRSS"]
        status = process_status(writer.pid)
    finally:
        for process in (baseline, writer):
            process.kill()
            process.wait()
    assert 63 * 2**20 <= grown <= 72 * 2**20  # give or take the pages the two interpreters differ by
    assert status["RssAnon"] >= 63 * 2**20
    assert status["VmRSS"] <= status["VmHWM"]
    assert status["RssAnon"] + status["RssFile"] <= status["VmRSS"]


def test_rill_memory_sums_the_shards_and_keeps_the_router_apart(
    rill_like: dict[str, list[subprocess.Popen[bytes]]],
) -> None:
    shard_pids = [process.pid for process in rill_like["shards"]]
    (router,) = rill_like["router"]
    assert set(shard_pids) | {router.pid} <= set(children(os.getpid()))
    memory = rill_memory(os.getpid())
    assert memory["shards"]["count"] == 2
    # Read again a moment later: a process may still touch a few pages in between (seen: 32 KiB).
    shards_again = sum(process_status(pid)["VmRSS"] for pid in shard_pids)
    assert abs(memory["shards"]["VmRSS"] - shards_again) <= 2**20
    assert abs(memory["router"]["VmRSS"] - process_status(router.pid)["VmRSS"]) <= 2**20
    assert memory["router"]["VmRSS"] > 0
    assert memory["launcher"]["VmRSS"] > 0


def test_children_reads_the_parent_past_a_name_with_parentheses(tmp_path: Path) -> None:
    for pid, name, parent in [(10, "(odd) name)", 7), (11, "plain", 7), (12, "other", 3)]:
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) S {parent} {pid} {pid} 0 -1\n")
    assert children(7, proc=tmp_path) == [10, 11]
    assert children(3, proc=tmp_path) == [12]


def test_workload_runs_the_given_clients() -> None:
    flags = workload(argparse.Namespace(num_requests=8), clients=1)
    assert flags[flags.index("--concurrency") + 1] == "1"
    assert flags[flags.index("--num-requests") + 1] == "8"
    assert "--ignore-eos" in flags


def test_clients_list() -> None:
    assert int_list("1,16") == [1, 16]
    with pytest.raises(argparse.ArgumentTypeError):
        int_list("0,16")


def test_summary_lines_give_both_figures_and_rill_over_llama_cpp() -> None:
    def summary(tokens_per_s: float, ttft_ms: float | None) -> dict[str, object]:
        return {"output_tokens_per_s": tokens_per_s, "ttft_ms": {"p50": ttft_ms}, "itl_ms": {"p50": 20.0}}

    report = {
        "a": {"summary": summary(50.0, 400.0)},
        "b": {"summary": summary(100.0, None)},
        "ratios": {"output_tokens_per_s": 2.0, "ttft_ms.p50": None, "itl_ms.p50": 1.0},
        "memory": {
            "llama.cpp": {"VmRSS": 200 * 2**20},
            "rill": {
                "shards": {"VmRSS": 500 * 2**20, "count": 1},
                "router": {"VmRSS": 30 * 2**20},
                "launcher": {"VmRSS": 60 * 2**20},
            },
        },
        "kv": {
            "context_tokens": CONTEXT_PER_SLOT,
            "rill_dtype": "float32",
            "rill_kv_pool_bytes": 24 * 2**20,
            "rill_kv_tokens": CONTEXT_PER_SLOT,
            "llama_cpp_kv_type": "f32",
            "llama_cpp_log": "load_model: initializing, n_slots = 1, n_ctx_slot = 1024",
        },
    }
    assert memory_ratio(report) == 2.5
    text = format_gguf_run("Q4_1, 1 clients", report)
    assert "output tokens/s 50.0, 100.0 (2.00x)" in text
    assert "TTFT p50 400.0 ms, n/a (n/a)" in text
    assert "llama-server 200 MiB, Rill's 1 shard(s) 500 MiB (2.50x)" in text
    assert "router 30 MiB, launcher 60 MiB" in text
    assert "n_slots = 1, n_ctx_slot = 1024" in text
