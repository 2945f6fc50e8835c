"""Tests of rill/launcher.py: its own flags, the pass-through of every other flag to the router (checked by
the real `rill-router` once built), the commands it builds, supervision with stand-in children, and the real
launcher with the default model. Defaults are not restated here: each lives with the flag that declares it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rill import launcher
from rill.launcher import ChildExited, LaunchConfig, ShutdownRequested, Supervisor, parse_args

from bench.servers import Server, free_port, rill_command, start, stop

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


def test_auto_values_resolve_on_cpu(model_dir: Path) -> None:
    config = parse(model_dir)
    assert (config.device, config.dtype, config.num_threads) == ("cpu", "float32", launcher._num_cpus())
    assert (config.kv_block_size, config.router_args, config.restart_shards) == (None, (), False)


def test_cuda_defaults(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_default_device", lambda: "cuda")
    config = parse(model_dir)
    assert (config.device, config.dtype, config.num_threads) == ("cuda", "bfloat16", None)


def test_model_defaults_to_the_built_in_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Served from its GGUF file as it is on a CPU with one shard; expanded when --dtype asks or the shards
    split it."""
    monkeypatch.setattr(launcher, "_default_model", lambda quantized: tmp_path / str(quantized))
    for path in ("True", "False"):
        (tmp_path / path).mkdir()
    base = ["--router-bin", str(ROUTER_BIN), "--device", "cpu"]
    assert parse_args(base, {}).model_id == tmp_path / "True"
    assert parse_args([*base, "--dtype", "float32"], {}).model_id == tmp_path / "False"
    assert parse_args([*base, "--num-shard", "2"], {}).model_id == tmp_path / "False"


@pytest.mark.parametrize(
    ("flag", "value", "field", "expected"),
    [
        ("--num-shard", "2", "num_shard", 2),
        ("--device", "cpu", "device", "cpu"),
        ("--dtype", "bfloat16", "dtype", "bfloat16"),
        ("--quantize", "q4_0", "quantize", "q4_0"),
        ("--quantized-activations", "int8", "quantized_activations", "int8"),
        ("--kv-block-size", "32", "kv_block_size", 32),
        ("--kv-cache-dtype", "int8", "kv_cache_dtype", "int8"),
        ("--num-threads", "3", "num_threads", 3),
        ("--otlp-endpoint", "http://collector:4318", "otlp_endpoint", "http://collector:4318"),
        ("--log-level", "DEBUG", "log_level", "debug"),
    ],
)
def test_launcher_flags_read_their_env_var_and_the_flag_wins(
    model_dir: Path, flag: str, value: str, field: str, expected: object
) -> None:
    env_name = "RILL_" + flag.removeprefix("--").upper().replace("-", "_")
    assert getattr(parse(model_dir, **{env_name: value}), field) == expected
    assert getattr(parse(model_dir, flag, value, **{env_name: "garbage"}), field) == expected


def test_model_and_router_bin_read_env_vars(model_dir: Path, tmp_path: Path) -> None:
    router_bin = tmp_path / "my-router"
    config = parse_args([], {"RILL_MODEL_ID": str(model_dir), "RILL_ROUTER_BIN": str(router_bin)})
    assert (config.model_id, config.router_bin) == (model_dir, router_bin)


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        ([], {}, False),
        (["--restart-shards"], {}, True),
        ([], {"RILL_RESTART_SHARDS": "1"}, True),
        (["--restart-shards=false"], {"RILL_RESTART_SHARDS": "1"}, False),
        (["--restart-shards", "off"], {"RILL_RESTART_SHARDS": "yes"}, False),
        (["--restart-shards=true"], {"RILL_RESTART_SHARDS": "0"}, True),
    ],
)
def test_a_switch_set_in_the_environment_turns_off_on_the_command_line(
    model_dir: Path, argv: list[str], environ: dict[str, str], expected: bool
) -> None:
    assert parse(model_dir, *argv, **environ).restart_shards is expected


def test_every_other_flag_passes_through_in_order(model_dir: Path) -> None:
    argv = ["--max-batch-tokens", "256", "--num-shard", "1", "--no-prefix-caching", "--port=9000",
            "--preemption-mode", "swap", "--json-logs=false", "--max-batch-tok", "5"]  # fmt: skip
    config = parse(model_dir, *argv)
    # Router flags, and a typo, all go to the router untouched: it, not the launcher, judges them.
    assert config.router_args == tuple(argv[:2] + argv[4:])
    assert config.num_shard == 1


def test_router_command(model_dir: Path) -> None:
    config = parse(
        model_dir, "--max-batch-tokens", "256", "--otlp-endpoint", "http://c:4318", "--api-key", "k"
    )
    sockets = [Path("/run/x/shard-0.sock"), Path("/run/x/shard-1.sock")]
    assert launcher.router_command(config, sockets) == [
        str(ROUTER_BIN), "--model-id", str(model_dir),
        "--shard-socket", "/run/x/shard-0.sock", "--shard-socket", "/run/x/shard-1.sock",
        "--otlp-endpoint", "http://c:4318",
        "--max-batch-tokens", "256",
    ]  # fmt: skip
    env = launcher.router_env(config, {"PATH": "/bin"})
    assert env == {"RUST_LOG": "info", "PATH": "/bin", "RILL_API_KEY": "k"}, "the key goes in the environment"


def test_the_launcher_sets_the_shard_sockets(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(model_dir, "--shard-socket=/tmp/x")
    assert "--shard-socket is set by the launcher" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--num-shard", "0"], {}, "--num-shard must be >= 1"),
        ([], {"RILL_NUM_SHARD": "two"}, "invalid int value: 'two'"),
        (["--device", "tpu"], {}, "--device must be cpu or cuda"),
        (["--dtype", "int8"], {}, "--dtype must be float32, bfloat16 or float16"),
        (["--restart-shards=maybe"], {}, "expected true or false"),
        (["--log-level", "loud"], {}, "--log-level must be"),
        (["--kv-cache-dtype", "fp8"], {}, "--kv-cache-dtype must be auto or int8"),
        (["--kv-cache-dtype", "int8", "--device", "cuda"], {}, "--kv-cache-dtype int8 needs the CPU kernels"),
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


def test_shard_command(model_dir: Path) -> None:
    config = parse(
        model_dir,
        "--num-threads", "2",
        "--kv-block-size", "32",
        "--kv-cache-dtype", "int8",
        "--otlp-endpoint", "http://c:4318",
        "--quantized-activations", "float32",
    )  # fmt: skip
    assert launcher.shard_command(config, Path("/run/x/shard-0.sock"), 0) == [
        sys.executable, "-m", "rill.shard.server",
        "--model-id", str(model_dir),
        "--socket", "/run/x/shard-0.sock",
        "--device", "cpu",
        "--dtype", "float32",
        "--rank", "0",
        "--world-size", "1",
        "--attention-backend", "auto",
        "--quantized-activations", "float32",
        "--kv-block-size", "32",
        "--kv-cache-dtype", "int8",
        "--num-threads", "2",
        "--otlp-endpoint", "http://c:4318",
    ]  # fmt: skip
    default = launcher.shard_command(parse(model_dir), Path("/s"), 0)
    shard_defaults = {"--kv-block-size", "--kv-cache-dtype", "--quantized-activations"}
    assert not shard_defaults & set(default), "the shard's defaults are not passed"


def test_a_draft_model_gets_one_shard_of_its_own(model_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "draft").mkdir()
    config = parse(
        model_dir, "--draft-model-id", str(tmp_path / "draft"), "--num-shard", "2", "--max-loras", "2",
        "--num-threads", "3", "--speculative", "draft",
    )  # fmt: skip
    socket_dir = Path("/run/x")
    draft_socket = launcher.draft_socket_path(config, socket_dir)
    assert draft_socket is not None and draft_socket not in launcher.shard_socket_paths(config, socket_dir)
    assert launcher.draft_shard_command(config, draft_socket) == [
        sys.executable, "-m", "rill.shard.server",
        "--model-id", str(tmp_path / "draft"),
        "--socket", str(draft_socket),
        "--device", "cpu",
        "--dtype", "float32",
        "--rank", "0",
        "--world-size", "1",
        "--attention-backend", "auto",
        "--num-threads", "3",
    ]  # fmt: skip
    command = launcher.router_command(config, [Path("/run/x/shard-0.sock")], draft_socket)
    assert command[3:7] == [
        "--shard-socket", "/run/x/shard-0.sock", "--draft-shard-socket", str(draft_socket)
    ]  # fmt: skip
    assert command[-2:] == ["--speculative", "draft"]
    assert launcher.draft_socket_path(parse(model_dir), socket_dir) is None


def test_the_draft_model_must_be_a_folder(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse(model_dir, "--draft-model-id", str(tmp_path / "nope"))
    assert "--draft-model-id" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(model_dir, "--draft-shard-socket", "/tmp/x")
    assert "--draft-shard-socket is set by the launcher" in capsys.readouterr().err


def test_shard_environment_sets_the_spin_count_unless_the_environment_chooses() -> None:
    env = launcher.shard_environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GOMP_SPINCOUNT": str(launcher.SHARD_SPIN_COUNT)}
    for own in ({"GOMP_SPINCOUNT": "0"}, {"OMP_WAIT_POLICY": "PASSIVE"}):
        assert launcher.shard_environment({"PATH": "/bin", **own}) == {"PATH": "/bin", **own}


# The router's own checks, with the real rill-router: its flags are judged by it alone.


def _router_bin_or_none() -> Path | None:
    """The router the launcher would use: --router-bin's RILL_ROUTER_BIN, else what it finds."""
    if "RILL_ROUTER_BIN" in os.environ:
        return Path(os.environ["RILL_ROUTER_BIN"])
    try:
        return launcher.find_router_bin(os.environ)
    except RuntimeError:
        return None


requires_router = pytest.mark.skipif(
    _router_bin_or_none() is None,
    reason="rill-router is not built yet (cargo build --release, or pip install .)",
)


def check(model_dir: Path, *argv: str, **environ: str) -> launcher.RouterLaunch:
    router_bin = _router_bin_or_none()
    config = parse_args(["--model-id", str(model_dir), "--router-bin", str(router_bin), *argv], environ)
    return launcher.check_router(config, [Path("/run/x/shard-0.sock")], environ)


@requires_router
def test_router_resolves_flag_then_env_then_default(model_dir: Path) -> None:
    assert (check(model_dir).base_url, check(model_dir).shutdown_timeout_s) == ("http://127.0.0.1:8080", 30)
    from_env = check(model_dir, RILL_PORT="9001", RILL_HOSTNAME="0.0.0.0", RILL_SHUTDOWN_TIMEOUT="5")
    assert (from_env.base_url, from_env.shutdown_timeout_s) == ("http://127.0.0.1:9001", 5)
    from_flags = check(model_dir, "--port", "9002", "--hostname", "[::]", RILL_PORT="9001")
    assert from_flags.base_url == "http://[::1]:9002"


@requires_router
@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (["--max-batch-tokns", "5"], {}, "unexpected argument '--max-batch-tokns'"),
        ([], {"RILL_MAX_BATCH_TOKENS": "0"}, "--max-batch-tokens must be positive"),
        (["--max-input-tokens", "4096"], {}, "--max-input-tokens (4096) must be below --max-total-tokens"),
        (["--preemption-mode", "never"], {}, "invalid value 'never' for '--preemption-mode"),
        ([], {"RILL_NO_PREFIX_CACHING": "maybe"}, "invalid value 'maybe' for '--no-prefix-caching"),
        (["--speculative", "draft"], {}, "--speculative draft needs the draft model's shard"),
    ],
)
def test_the_router_rejects_bad_flags(
    model_dir: Path, argv: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(launcher.RouterFlagsError, match=re.escape(message)):
        check(model_dir, *argv, **environ)


@requires_router
def test_the_router_accepts_a_switch_turned_off_over_its_env_var(model_dir: Path) -> None:
    check(
        model_dir,
        "--no-prefix-caching=false",
        "--json-logs",
        "off",
        RILL_NO_PREFIX_CACHING="1",
        RILL_JSON_LOGS="1",
    )


@requires_router
def test_a_typo_fails_before_any_shard_starts(model_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rill", "--model-id", str(model_dir), "--device", "cpu",
         "--router-bin", str(_router_bin_or_none()), "--max-batch-tokns", "5"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "unexpected argument '--max-batch-tokns'" in result.stderr
    assert "a similar argument exists: '--max-batch-tokens'" in result.stderr
    assert "starting shard" not in result.stderr


@requires_router
def test_help_shows_the_launcher_and_the_router_flags() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rill", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    launcher_part, router_part = result.stdout.split("rill-router --help:")
    assert "--num-shard" in launcher_part and "env RILL_NUM_SHARD" in launcher_part
    assert "--max-batch-tokens" in router_part and "[env: RILL_MAX_BATCH_TOKENS=]" in router_part


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


def output(server: Server) -> str:
    return server.log_path.read_text()


def pid_of(server: Server, name: str) -> int:
    match = re.search(rf"{name} has pid (\d+)", output(server))
    assert match, output(server)
    return int(match.group(1))


def _is_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.fixture
def running_launcher(tmp_path: Path) -> Iterator[Server]:
    """`python -m rill` on a free port, once healthy; its output in a log file."""
    port = free_port()
    log_path = tmp_path / "launcher.log"
    server = start(rill_command(port, "--device", "cpu"), port, log_path, what="launcher", timeout_s=600)
    yield server
    stop(server.process, grace_s=30)


@requires_router
def test_killed_shard_stops_rill(running_launcher: Server) -> None:
    router_pid = pid_of(running_launcher, "router")
    os.kill(pid_of(running_launcher, "shard-0"), signal.SIGKILL)
    returncode = running_launcher.process.wait(timeout=15)
    assert returncode != 0
    assert "shard-0 exited with code -9 (killed by SIGKILL)" in output(running_launcher)
    assert _is_gone(router_pid)


@requires_router
def test_sigterm_stops_rill_cleanly(running_launcher: Server) -> None:
    pids = [pid_of(running_launcher, "router"), pid_of(running_launcher, "shard-0")]
    running_launcher.process.send_signal(signal.SIGTERM)
    assert running_launcher.process.wait(timeout=30) == 0, output(running_launcher)
    assert all(_is_gone(pid) for pid in pids)
