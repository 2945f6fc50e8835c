"""`python -m bench soak` against the fake server: outcome classes, disconnects, malformed bodies, leaks."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from bench.cli import main
from bench.soak import malformed_request
from tests.bench.fake_server import FakeServer

StartFake = Callable[..., FakeServer]


def soak_argv(server: FakeServer, *flags: str) -> list[str]:
    return ["soak", "--url", server.url, "--num-requests", "60", "--max-tokens", "4", "--no-progress", *flags]


def test_soak_counts_every_outcome_and_passes_a_healthy_server(
    fake_server: StartFake, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = fake_server(ttft_s=0.01, itl_s=0.01, status_for=lambda n: 429 if n % 7 == 3 else 200)
    server.outcomes = {"cancelled": 0}
    argv = soak_argv(server, "--disconnect-share", "0.3", "--malformed-share", "0.2",
                     "--disconnect-max-s", "0.05", "--json", str(tmp_path / "soak.json"))  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "verdict               PASS" in out and "4 (max_concurrent_requests); 8 in flight" in out
    result = json.loads((tmp_path / "soak.json").read_text())["result"]
    outcomes = result["outcomes"]
    assert sum(outcomes.values()) == result["num_sent"] == 60
    assert outcomes["ok"] > 0 and outcomes["429"] > 0 and outcomes["disconnected"] > 0, outcomes
    assert sum(count for kind, count in outcomes.items() if kind in ("400", "422")) > 0, outcomes
    assert result["leaked_kv_blocks"] == 0 and result["health_status"] == 200
    assert result["num_disconnected"] == outcomes["disconnected"] <= result["num_disconnects_sent"]
    assert result["cancelled_delta"] == 0 and result["is_ok"]


def test_soak_fails_on_a_leak_or_a_5xx(fake_server: StartFake, capsys: pytest.CaptureFixture[str]) -> None:
    leaky = fake_server(ttft_s=0.0, itl_s=0.0, used_blocks=3)
    assert main(soak_argv(leaky)) == 1
    assert "leaked KV blocks      3" in capsys.readouterr().out
    failing = fake_server(ttft_s=0.0, itl_s=0.0, status_for=lambda n: 500 if n == 5 else 200)
    assert main(soak_argv(failing, "--malformed-share", "0")) == 1
    out = capsys.readouterr().out
    assert "5xx 1" in out and "verdict               FAIL" in out


def test_soak_mixes_in_slow_readers_deadlines_and_idle_connections(
    fake_server: StartFake, tmp_path: Path
) -> None:
    """The fake ignores `timeout` and never cuts a reader off or closes an idle connection: each fault
    kind ends as a request the fake served, or an idle connection the soak gave up on."""
    server = fake_server(ttft_s=0.01, itl_s=0.01)
    argv = soak_argv(server, "--malformed-share", "0", "--disconnect-share", "0",
                     "--slow-reader-share", "0.2", "--slow-reader-hold-s", "0.05",
                     "--deadline-share", "0.2", "--idle-connection-share", "0.2",
                     "--idle-connection-max-s", "0.05", "--json", str(tmp_path / "soak.json"))  # fmt: skip
    assert main(argv) == 0
    result = json.loads((tmp_path / "soak.json").read_text())["result"]
    outcomes = result["outcomes"]
    assert sum(outcomes.values()) == 60 and outcomes["idle-open"] > 0 and outcomes["ok"] > 0, outcomes
    deadlines = [body for body in server.bodies if "timeout" in body.get("parameters", {})]
    assert deadlines and all(body["parameters"]["timeout"] == 0.2 for body in deadlines)
    # Every streamed request (normal, slow reader, streaming deadline) was read to its end.
    assert len(server.bodies) == outcomes["ok"], (len(server.bodies), outcomes)


def test_malformed_requests_are_seeded_and_varied() -> None:
    draws = [malformed_request(random.Random(seed)) for seed in range(200)]
    assert draws == [malformed_request(random.Random(seed)) for seed in range(200)]
    assert len({body for _, body, _ in draws}) >= 10 and len({route for route, _, _ in draws}) == 5
    assert any(content_type != "application/json" for _, _, content_type in draws)


def test_soak_help_lists_its_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["soak", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--capacity-multiple",
        "--num-requests",
        "--disconnect-share",
        "--malformed-share",
        "--slow-reader-share",
        "--deadline-share",
        "--idle-connection-share",
        "--duration",
    ):
        assert flag in out, flag
