"""Tests of rill/launcher.py: flag parsing, the commands it builds, supervision with stand-in children, and
(once `rill-router` is built) the real launcher with the default model."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rill import launcher
from rill.launcher import ChildExited, LaunchConfig, ShutdownRequested, Supervisor, parse_args

ROUTER_BIN = Path("/bin/true")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "model").mkdir()
    return tmp_path / "model"


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_default_device", lambda: "cpu")


def parse(model_dir: Path, *argv: str, **environ: str) -> LaunchConfig:
    return parse_args(["--model-id", str(model_dir), "--router-bin", str(ROUTER_BIN), *argv], environ)


def test_defaults(model_dir: Path) -> None:
    config = parse(model_dir)
    assert config == LaunchConfig(
        model_id=model_dir,
        hostname="127.0.0.1",
        port=8080,
        num_shard=1,
        device="cpu",
        dtype="float32",
        max_input_tokens=4095,
        max_total_tokens=4096,
        max_batch_tokens=2048,
        max_batch_total_tokens=0,
        max_batch_size=64,
        kv_block_size=16,
        max_concurrent_requests=128,
        max_waiting_requests=128,
        max_queue_time=0,
        scheduling="continuous",
        static_batch_wait_ms=1000,
        target_itl_ms=None,
        served_model_name=None,
        shutdown_timeout=30,
        prefix_caching=True,
        preemption_mode="auto",
        swap_space=4.0,
        kv_admission="incremental",
        max_body_bytes=2 << 20,
        api_key=None,
        json_logs=False,
        otlp_endpoint=None,
        log_prompts=False,
        restart_shards=False,
        num_threads=launcher._num_cpus(),
        attention_backend="auto",
        router_bin=ROUTER_BIN,
        log_level="info",
    )


def test_cuda_defaults(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_default_device", lambda: "cuda")
    config = parse(model_dir)
    assert (config.device, config.dtype, config.num_threads) == ("cuda", "bfloat16", None)


def test_model_defaults_to_the_built_in_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_default_model", lambda: tmp_path)
    assert parse_args(["--router-bin", str(ROUTER_BIN)], {}).model_id == tmp_path


@pytest.mark.parametrize(
    ("flag", "value", "field", "expected"),
    [
        ("--hostname", "0.0.0.0", "hostname", "0.0.0.0"),
        ("--port", "9000", "port", 9000),
        ("--num-shard", "1", "num_shard", 1),
        ("--device", "cpu", "device", "cpu"),
        ("--dtype", "bfloat16", "dtype", "bfloat16"),
        ("--max-input-tokens", "100", "max_input_tokens", 100),
        ("--max-total-tokens", "5000", "max_total_tokens", 5000),
        ("--max-batch-tokens", "512", "max_batch_tokens", 512),
        ("--max-batch-total-tokens", "65536", "max_batch_total_tokens", 65536),
        ("--max-batch-size", "8", "max_batch_size", 8),
        ("--kv-block-size", "32", "kv_block_size", 32),
        ("--max-concurrent-requests", "7", "max_concurrent_requests", 7),
        ("--num-threads", "3", "num_threads", 3),
        ("--log-level", "DEBUG", "log_level", "debug"),
    ],
)
def test_every_flag_reads_its_env_var_and_the_flag_wins(
    model_dir: Path, flag: str, value: str, field: str, expected: object
) -> None:
    env_name = "RILL_" + flag.removeprefix("--").upper().replace("-", "_")
    assert getattr(parse(model_dir, **{env_name: value}), field) == expected
    assert getattr(parse(model_dir, flag, value, **{env_name: "garbage"}), field) == expected


def test_model_and_router_bin_read_env_vars(model_dir: Path, tmp_path: Path) -> None:
    router_bin = tmp_path / "my-router"
    config = parse_args([], {"RILL_MODEL_ID": str(model_dir), "RILL_ROUTER_BIN": str(router_bin)})
    assert (config.model_id, config.router_bin) == (model_dir, router_bin)


def test_help_names_each_env_var_and_default() -> None:
    parser = launcher.build_parser({})
    for action in parser._actions:
        if action.dest != "help":
            env_name = "RILL_" + action.dest.upper()
            assert f"env {env_name}" in action.help and "default:" in action.help, action.help


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--num-shard", "0"], {}, "--num-shard must be >= 1"),
        ([], {"RILL_PORT": "http"}, "invalid int value: 'http'"),
        (["--device", "tpu"], {}, "--device must be cpu or cuda"),
        (["--dtype", "int8"], {}, "--dtype must be float32, bfloat16 or float16"),
        (["--max-input-tokens", "4096"], {}, "--max-input-tokens (4096) must be > 0 and less than"),
        (["--log-level", "loud"], {}, "--log-level must be"),
    ],
)
def test_bad_flags_get_a_clear_error(
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    environ: dict[str, str],
    message: str,
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse(model_dir, *argv, **environ)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_model_folder_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(tmp_path / "nope")
    assert "is not a folder" in capsys.readouterr().err


def test_router_bin_falls_back_to_the_cargo_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(launcher.shutil, "which", lambda name, path=None: None)
    with pytest.raises(RuntimeError, match="cargo build --release"):
        launcher.find_router_bin({})
    debug_bin = tmp_path / "target" / "debug" / "rill-router"
    debug_bin.parent.mkdir(parents=True)
    debug_bin.write_text("#!/bin/sh\n")
    debug_bin.chmod(0o755)
    assert launcher.find_router_bin({}) == debug_bin
    assert launcher.find_router_bin({"CARGO_TARGET_DIR": str(tmp_path / "target")}) == debug_bin


def test_router_command(model_dir: Path) -> None:
    config = parse(model_dir, "--port", "9000")
    sockets = [Path("/run/x/shard-0.sock")]
    assert launcher.router_command(config, sockets) == [
        str(ROUTER_BIN),
        "--model-id", str(model_dir),
        "--hostname", "127.0.0.1",
        "--port", "9000",
        "--shard-socket", "/run/x/shard-0.sock",
        "--max-input-tokens", "4095",
        "--max-total-tokens", "4096",
        "--max-batch-tokens", "2048",
        "--max-batch-total-tokens", "0",
        "--max-batch-size", "64",
        "--max-concurrent-requests", "128",
        "--max-waiting-requests", "128",
        "--max-queue-time", "0",
        "--scheduling", "continuous",
        "--static-batch-wait-ms", "1000",
        "--shutdown-timeout", "30",
        "--max-body-bytes", str(2 << 20),
        "--preemption-mode", "auto",
        "--swap-space", "4.0",
        "--kv-admission", "incremental",
    ]  # fmt: skip
    flags = ["--no-prefix-caching", "--json-logs", "--target-itl-ms", "50", "--api-key", "k"]
    switched = parse(model_dir, *flags)
    command = launcher.router_command(switched, sockets)
    assert {"--no-prefix-caching", "--json-logs", "50.0"} <= set(command)
    assert "k" not in command, "the API key must not appear on a command line"


def test_shard_command(model_dir: Path) -> None:
    config = parse(model_dir, "--num-threads", "2", "--kv-block-size", "32")
    assert launcher.shard_command(config, Path("/run/x/shard-0.sock"), 0) == [
        sys.executable, "-m", "rill.shard.server",
        "--model-id", str(model_dir),
        "--socket", "/run/x/shard-0.sock",
        "--device", "cpu",
        "--dtype", "float32",
        "--kv-block-size", "32",
        "--rank", "0",
        "--world-size", "1",
        "--attention-backend", "auto",
        "--num-threads", "2",
    ]  # fmt: skip


def test_otlp_endpoint_goes_to_router_and_shards(model_dir: Path) -> None:
    config = parse(model_dir, "--otlp-endpoint", "http://collector:4318")
    for command in (
        launcher.router_command(config, [Path("/run/x/shard-0.sock")]),
        launcher.shard_command(config, Path("/run/x/shard-0.sock"), 0),
    ):
        i = command.index("--otlp-endpoint")
        assert command[i + 1] == "http://collector:4318"
    assert "--otlp-endpoint" not in launcher.router_command(parse(model_dir), [Path("/run/x/shard-0.sock")])


# Supervision, with stand-in children (the launcher itself only ever runs the real shard and router).

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
IGNORES_SIGTERM = [
    sys.executable,
    "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('ready', flush=True); time.sleep(60)",
]


@pytest.fixture
def supervisor() -> Iterator[Supervisor]:
    supervisor = Supervisor()
    yield supervisor
    supervisor.stop_all(router_grace_s=1.0)


def test_a_dying_child_is_named_and_the_others_are_stopped(supervisor: Supervisor) -> None:
    supervisor.start("shard-0", SLEEPER)
    supervisor.start("router", [sys.executable, "-c", "import sys, time; time.sleep(0.3); sys.exit(3)"])
    started = time.monotonic()
    with pytest.raises(ChildExited, match="router exited with code 3") as error:
        supervisor.supervise()
    assert (error.value.name, error.value.returncode) == ("router", 3)
    assert time.monotonic() - started < 5
    supervisor.stop_all()
    assert all(process.poll() is not None for process in supervisor.children.values())
    assert supervisor.children["shard-0"].returncode == -signal.SIGTERM


def test_a_killed_child_is_reported_with_its_signal(supervisor: Supervisor) -> None:
    supervisor.start("shard-0", SLEEPER)
    os.kill(supervisor.children["shard-0"].pid, signal.SIGKILL)
    with pytest.raises(ChildExited, match=r"shard-0 exited with code -9 \(killed by SIGKILL\)"):
        supervisor.supervise()


def test_the_router_stops_first_and_shards_wait_for_it(supervisor: Supervisor) -> None:
    supervisor.start("shard-0", SLEEPER)
    supervisor.start("router", [sys.executable, "-c", "import signal, sys, time; "
                                "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), sys.exit(0))); "
                                "time.sleep(60)"])  # fmt: skip
    time.sleep(0.3)
    supervisor.stop_all(router_grace_s=5.0)
    # The router drained (exit 0) while the shard was still alive; the shard was stopped after it.
    assert supervisor.children["router"].returncode == 0
    assert supervisor.children["shard-0"].returncode == -signal.SIGTERM


def test_stop_escalates_to_sigkill(supervisor: Supervisor) -> None:
    process = subprocess.Popen(IGNORES_SIGTERM, stdout=subprocess.PIPE, start_new_session=True)
    supervisor.children["router"] = process
    assert process.stdout is not None and process.stdout.readline() == b"ready\n"
    started = time.monotonic()
    supervisor.stop_all(router_grace_s=0.5)
    assert process.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 5


def test_a_signal_stops_supervision(supervisor: Supervisor) -> None:
    supervisor.start("shard-0", SLEEPER)
    threading.Timer(0.2, supervisor.stop_requested.set).start()
    with pytest.raises(ShutdownRequested):
        supervisor.supervise()


def test_waiting_fails_fast_when_a_child_dies(supervisor: Supervisor) -> None:
    supervisor.start("shard-0", [sys.executable, "-c", "import sys; sys.exit(7)"])
    with pytest.raises(ChildExited, match="shard-0 exited with code 7"):
        supervisor.wait_until(lambda: False, "shard-0", timeout_s=30)


def test_waiting_times_out(supervisor: Supervisor) -> None:
    supervisor.start("shard-0", SLEEPER)
    with pytest.raises(TimeoutError, match="shard-0 was not ready after 0 s"):
        supervisor.wait_until(lambda: False, "shard-0", timeout_s=0.3)


# The real launcher: default model, real shard, real router.


def _router_bin_or_none() -> Path | None:
    try:
        return launcher.find_router_bin(os.environ)
    except RuntimeError:
        return None


requires_router = pytest.mark.skipif(
    _router_bin_or_none() is None,
    reason="rill-router is not built yet (cargo build --release, or pip install .)",
)


class RunningLauncher:
    """`python -m rill` on a free port, its output collected by a thread."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.process = subprocess.Popen(
            [sys.executable, "-m", "rill", "--device", "cpu", "--port", str(self.port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        threading.Thread(target=self._collect, daemon=True).start()

    def _collect(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while "Rill is serving" not in self.output:
            assert self.process.poll() is None, f"launcher exited early:\n{self.output}"
            assert time.monotonic() < deadline, f"launcher not ready:\n{self.output}"
            time.sleep(0.2)

    def pid_of(self, name: str) -> int:
        match = re.search(rf"{name} has pid (\d+)", self.output)
        assert match, self.output
        return int(match.group(1))


def _is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def running_launcher() -> Iterator[RunningLauncher]:
    running = RunningLauncher()
    yield running
    if running.process.poll() is None:
        running.process.send_signal(signal.SIGTERM)
        running.process.wait(30)


@requires_router
def test_killed_shard_stops_rill(running_launcher: RunningLauncher) -> None:
    running_launcher.wait_ready()
    router_pid = running_launcher.pid_of("router")
    os.kill(running_launcher.pid_of("shard-0"), signal.SIGKILL)
    returncode = running_launcher.process.wait(timeout=15)
    assert returncode != 0
    assert "shard-0 exited with code -9 (killed by SIGKILL)" in running_launcher.output
    assert _is_gone(router_pid)


@requires_router
def test_sigterm_stops_rill_cleanly(running_launcher: RunningLauncher) -> None:
    running_launcher.wait_ready()
    pids = [running_launcher.pid_of("router"), running_launcher.pid_of("shard-0")]
    running_launcher.process.send_signal(signal.SIGTERM)
    assert running_launcher.process.wait(timeout=30) == 0, running_launcher.output
    assert all(_is_gone(pid) for pid in pids)


def test_the_readme_documents_every_flag() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for action in launcher.build_parser({})._actions:
        for option in action.option_strings:
            if option.startswith("--") and option != "--help":
                assert f"`{option}`" in readme, f"README.md does not document {option}"
