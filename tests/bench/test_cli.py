"""The command line end to end against fake servers: tables, JSON, plots, sweep, compare, --help."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.cli import main
from tests.bench.fake_server import FakeServer

StartFake = Callable[..., FakeServer]
ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SUMMARY_KEYS = {
    "num_planned", "num_sent", "num_completed", "num_errors", "num_rejected_429", "errors_by_kind",
    "duration_s", "requests_per_s", "output_tokens_per_s", "num_output_tokens", "num_prompt_tokens",
    "ttft_ms", "itl_ms", "tpot_ms", "e2e_ms",
}  # fmt: skip
RECORD_KEYS = {
    "index", "session", "turn", "prompt_tokens", "max_tokens", "start_s", "is_ok", "status", "error_kind",
    "error", "ttft_s", "e2e_s", "itl_s", "output_tokens", "server_prompt_tokens",
}  # fmt: skip


def fast(*flags: str) -> list[str]:
    return ["--num-requests", "6", "--max-tokens", "4", "--no-progress", *flags]


def check_run_json(run: dict) -> None:
    assert set(run) == {"target", "summary", "requests"}
    assert set(run["summary"]) == SUMMARY_KEYS
    assert set(run["summary"]["ttft_ms"]) == {"mean", "p50", "p90", "p99", "max"}
    for record in run["requests"]:
        assert set(record) == RECORD_KEYS


def assert_pngs(directory: Path, names: list[str]) -> None:
    for name in names:
        assert (directory / name).read_bytes()[:8] == PNG_MAGIC, name


def test_run_prints_a_table_and_writes_json_and_plots(
    fake_server: StartFake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = fake_server(ttft_s=0.01, itl_s=0.002, status_for=lambda n: 429 if n == 2 else 200)
    argv = ["run", "--url", server.url, "--api", "openai", "--concurrency", "2",
            "--json", str(tmp_path / "out.json"), "--plot", str(tmp_path / "plots"), *fast()]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "output tokens/s" in out and "TTFT" in out and "ITL" in out and "e2e" in out
    assert "rejected with 429: 1" in out
    document = json.loads((tmp_path / "out.json").read_text())
    assert document["schema_version"] == 1 and document["mode"] == "run"
    assert document["config"]["workload"] == "mixed"
    check_run_json(document["run"])
    assert document["run"]["summary"]["num_rejected_429"] == 1
    assert document["run"]["summary"]["num_completed"] == 5
    assert len(document["run"]["requests"]) == 6
    assert_pngs(tmp_path / "plots", ["ttft_cdf.png", "itl_cdf.png", "e2e_cdf.png"])


@pytest.mark.parametrize("workload", ["bursts", "shared-prefix", "chat", "long-prompts", "repeat"])
def test_every_workload_runs(
    fake_server: StartFake, workload: str, capsys: pytest.CaptureFixture[str]
) -> None:
    server = fake_server(ttft_s=0.0, itl_s=0.0)
    argv = ["run", "--url", server.url, "--workload", workload, "--request-rate", "200", *fast()]
    assert main(argv) == 0
    assert "completed         6 of 6 sent" in capsys.readouterr().out


def test_sweep_writes_throughput_against_load(
    fake_server: StartFake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = fake_server(ttft_s=0.005, itl_s=0.001)
    argv = ["sweep", "--url", server.url, "--request-rates", "50,100", "--json", str(tmp_path / "sweep.json"),
            "--plot", str(tmp_path), *fast()]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "sweep (latencies in ms)" in out
    document = json.loads((tmp_path / "sweep.json").read_text())
    assert [run["request_rate"] for run in document["runs"]] == [50.0, 100.0]
    for run in document["runs"]:
        check_run_json({key: value for key, value in run.items() if key != "request_rate"})
    assert len(server.bodies) == 12
    assert_pngs(tmp_path, ["throughput_vs_load.png", "ttft_cdf.png", "itl_cdf.png", "e2e_cdf.png"])


def test_compare_prints_ratios_of_b_over_a(
    fake_server: StartFake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    slow = fake_server(ttft_s=0.06, itl_s=0.01)
    fast_server = fake_server(ttft_s=0.02, itl_s=0.01)
    argv = ["compare", "--a", f"slow={slow.url}", "--a-api", "native", "--b", f"fast={fast_server.url}",
            "--b-api", "openai", "--concurrency", "3", "--json", str(tmp_path / "cmp.json"),
            "--plot", str(tmp_path), *fast()]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ratios are b/a" in out and "a: slow" in out and "b: fast" in out
    row = re.search(r"TTFT p50 \(ms\)\s+([\d.,]+)\s+([\d.,]+)\s+([\d.]+)", out)
    assert row is not None, out
    assert 0.2 < float(row.group(3)) < 0.6  # ~20 ms / ~60 ms
    document = json.loads((tmp_path / "cmp.json").read_text())
    assert document["mode"] == "compare"
    check_run_json(document["a"])
    check_run_json(document["b"])
    assert set(document["ratios"]) >= {"output_tokens_per_s", "ttft_ms.p50", "ttft_ms.p99", "itl_ms.p99"}
    assert document["ratios"]["output_tokens_per_s"] > 1.0
    assert document["a"]["target"]["label"] == "slow"
    # the same seeded prompts went to both
    assert [body["inputs"] for body in slow.bodies] == [body["prompt"] for body in fast_server.bodies]
    assert_pngs(tmp_path, ["ttft_cdf.png"])


def test_compare_rounds_alternate_and_pool(
    fake_server: StartFake, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = fake_server(ttft_s=0.0, itl_s=0.0), fake_server(ttft_s=0.0, itl_s=0.0)
    assert main(["compare", "--a", a.url, "--b", b.url, "--concurrency", "2", "--rounds", "2", *fast()]) == 0
    assert "2 round(s)" in capsys.readouterr().out
    assert len(a.bodies) == len(b.bodies) == 12


def test_compare_fresh_prompts_give_each_round_new_prompts_and_its_own_ratio(
    fake_server: StartFake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a, b = fake_server(ttft_s=0.0, itl_s=0.0), fake_server(ttft_s=0.0, itl_s=0.0)
    argv = ["compare", "--a", a.url, "--b", b.url, "--concurrency", "2", "--rounds", "2", "--fresh-prompts",
            "--json", str(tmp_path / "cmp.json"), *fast()]  # fmt: skip
    assert main(argv) == 0
    assert "output tokens/s b/a by round" in capsys.readouterr().out
    rounds_a = [{body["inputs"] for body in a.bodies[i : i + 6]} for i in (0, 6)]
    rounds_b = [{body["inputs"] for body in b.bodies[i : i + 6]} for i in (0, 6)]
    assert rounds_a == rounds_b, "both sides get the same prompts in a round"
    assert rounds_a[0].isdisjoint(rounds_a[1]), "no round repeats an earlier one's prompts"
    round_ratios = json.loads((tmp_path / "cmp.json").read_text())["round_ratios"]
    assert len(round_ratios) == 2 and all(ratio > 0 for ratio in round_ratios)


def test_bad_flags_get_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--workload", "bursts", "--concurrency", "2", *fast()]) == 2
    assert "bursts need --request-rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--request-rate", "0"])
    with pytest.raises(SystemExit):
        main(["run"])  # neither --request-rate nor --concurrency


def test_python_m_bench_help() -> None:
    result = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT,
                            capture_output=True, text=True, check=True)  # fmt: skip
    assert "usage: python -m bench" in result.stdout
    assert all(command in result.stdout for command in ("run", "sweep", "compare"))


@pytest.mark.parametrize("command", ["run", "sweep", "compare"])
def test_help_explains_every_subcommand(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    flags = [
        "--workload",
        "--num-requests",
        "--seed",
        "--max-tokens",
        "--api",
        "--duration",
        "--json",
        "--plot",
    ]
    flags += {"run": ["--request-rate", "--concurrency", "--url"], "sweep": ["--request-rates", "--url"],
              "compare": ["--a", "--b", "--rounds", "--concurrency"]}[command]  # fmt: skip
    for flag in flags:
        assert flag in out, flag
