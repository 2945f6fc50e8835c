"""Starts and supervises Rill: the model shards, then the Rust router in front of them.

Run: python -m rill [flags]   (python -m rill --help lists them; each also reads RILL_<FLAG>)
With no arguments it serves the built-in SmolLM2-135M-Instruct at http://127.0.0.1:8080.

Flags: the launcher declares only those it acts on (the shards', --num-shard, --restart-shards, ...); every
other flag goes to `rill-router` unchanged, which declares it once (router/src/config.rs). Before any shard
starts, the router checks the whole command (`--check-args`) and says where it will listen.

Sequence: parse flags once into a `LaunchConfig`; check the router's flags; start one
`python -m rill.shard.server` per rank on a unix socket in a private temp folder (with --num-shard N > 1
the N ranks form one torch.distributed group through a rendezvous file in that folder, rank r on cuda:r);
with --draft-model-id, one more shard, `draft-shard` (world size 1), serves the draft model of the router's
`--speculative draft` on a socket of its own); wait until each answers the gRPC Health call; start
`rill-router` (which calls Info and Warmup on the shards, then serves HTTP); wait until GET /health answers
200.
Then supervise: if any child exits, stop the others (SIGTERM, SIGKILL after a grace period) and exit
non-zero naming it; SIGINT/SIGTERM to the launcher stop everything and exit 0.
No orphans: on Linux every child gets a parent-death signal (SIGKILL for a shard, SIGTERM for the router),
so a launcher that dies however it dies (SIGKILL, the OOM killer) takes its shards and router with it.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

logger = logging.getLogger("rill.launcher")

# A source checkout: python/rill/launcher.py -> the repository root, where `cargo build` leaves the router.
REPO_ROOT = Path(__file__).resolve().parents[2]
SHARD_START_TIMEOUT_S = 600.0  # model loading on a busy CPU, or a first CUDA init, can take minutes
ROUTER_START_TIMEOUT_S = 600.0  # includes the shards' warmup forward
STOP_GRACE_S = 10.0
POLL_INTERVAL_S = 0.1
# A shard alive but hung (stopped, deadlocked) answers no Health call: after this many missed in a row, one
# every interval, the launcher kills it, and supervision treats it as a dead shard.
SHARD_HEALTH_INTERVAL_S = 2.0
SHARD_MISSED_HEALTH_LIMIT = 5
# How long a shard's OpenMP threads spin at the end of a parallel region before they sleep (libgomp counts
# about 100,000 spins a millisecond): long enough to span the gaps between the kernels of a forward, which
# otherwise each pay a futex wake, short enough that a thread left waiting after a step soon hands its core
# to the router. Used where the environment sets neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY.
SHARD_SPIN_COUNT = 10_000
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@dataclass(frozen=True)
class LaunchConfig:
    """The launcher's own flags, resolved (no `auto` left), and the flags it passes through to the router.

    Built once by `parse_args`, then passed explicitly. The router's flags are declared only by
    `rill-router` itself; the launcher acts on none of them."""

    model_id: Path
    draft_model_id: Path | None  # the draft model for --speculative draft; None: no draft shard
    num_shard: int
    device: str
    dtype: str
    kv_block_size: int | None  # None: the shard's default
    kv_cache_dtype: str  # auto (the model's dtype) or int8
    num_threads: int | None  # None: the shard keeps torch's default
    attention_backend: str  # auto (the device's native kernels where they can run), cpu, cuda or torch
    max_loras: int  # LoRA adapter slots per shard (0: LoRA off)
    max_lora_rank: int
    quantize: str | None  # float weights quantized at load (the shard's --quantize); None: as loaded
    quantized_activations: str  # float32, int16 or int8: what quantized weights multiply (the shard's flag)
    otlp_endpoint: str | None  # OpenTelemetry collector for the shards' spans (and the router's)
    api_key: str | None  # handed to the router through its environment, never on a command line
    restart_shards: bool
    router_bin: Path
    log_level: str
    router_args: tuple[str, ...]  # every other flag, in order, for rill-router to parse


# A switch's values, as the router's clap (BoolishValueParser) reads them: one convention for both binaries.
SWITCH_VALUES = {
    **dict.fromkeys(("1", "y", "yes", "t", "true", "on"), True),
    **dict.fromkeys(("0", "n", "no", "f", "false", "off"), False),
}
# Router flags the launcher sets itself (--model-id and --otlp-endpoint are also launcher flags).
LAUNCHER_SET_ROUTER_FLAGS = ("--shard-socket", "--draft-shard-socket")


def parse_switch(value: str) -> bool:
    try:
        return SWITCH_VALUES[value.lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(
            f"expected true or false (or 1/0, yes/no, on/off), got {value!r}"
        ) from None


def build_parser(environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The launcher's own flags. Each one's default comes from RILL_<FLAG> when set (argparse applies
    `type` to it); `--help` adds the router's flags (see `help_text`)."""
    # allow_abbrev=False: an abbreviation must not turn a router flag into a launcher flag.
    parser = argparse.ArgumentParser(
        prog="python -m rill", description=__doc__.split("\n\n")[0], add_help=False, allow_abbrev=False
    )

    def flag(
        name: str,
        value_type: Callable[[str], object],
        default: str | None,
        help_text: str,
        unset: str = "auto",
    ) -> None:
        env_name = "RILL_" + name.upper().replace("-", "_")
        parser.add_argument(
            f"--{name}",
            type=value_type,
            default=environ.get(env_name, default),
            help=f"{help_text} (env {env_name}; default: {default or unset})",
        )

    def switch(name: str, help_text: str) -> None:
        env_name = "RILL_" + name.upper().replace("-", "_")
        parser.add_argument(
            f"--{name}",
            type=parse_switch,
            nargs="?",
            const=True,
            default=environ.get(env_name, "false"),
            metavar="BOOL",
            help=f"{help_text} (env {env_name}; default: false)",
        )

    parser.add_argument(
        "-h", "--help", action="store_true", help="show the launcher's and the router's flags"
    )
    flag(
        "model-id",
        Path,
        None,
        "Hugging Face-layout model folder, or a .gguf file (converted once into the cache); "
        "auto = built-in SmolLM2-135M-Instruct",
    )
    flag(
        "draft-model-id",
        Path,
        None,
        "the draft model of the router's --speculative draft (a smaller model with the same tokenizer; a "
        "folder or a .gguf file), served by one more shard process (world size 1) with the same --device, "
        "--dtype, --kv-block-size, --kv-cache-dtype and --num-threads",
        "off",
    )
    flag("num-shard", int, "1", "tensor-parallel shard processes, one per GPU (rank r on cuda:r)")
    flag("device", str, None, "cpu or cuda; auto = cuda when torch sees a GPU, else cpu")
    flag(
        "dtype",
        str,
        None,
        "float32, bfloat16 or float16; auto = float32 on cpu, bfloat16 on cuda. "
        "On a cpu with one shard and no --dtype, a GGUF model (the default one too) keeps its quantized "
        "weights as the file holds them; a --dtype expands them",
    )
    flag(
        "quantize",
        str,
        None,
        "q8_0 or q4_0: quantize a float (safetensors) model's weights at load, as llama.cpp "
        "would: the decoder layers' projections to this type, the embedding and LM head to q8_0 "
        "(cpu, one shard)",
        "off",
    )
    flag(
        "quantized-activations",
        str,
        "int16",
        "what quantized weights multiply on a cpu: int16 activations quantized per token (finer than "
        "bfloat16, close to float32; about twice float32's speed in decoding), int8 ones (as llama.cpp "
        "does: fastest, less exact) or float32 (exact)",
    )
    flag("kv-block-size", int, None, "tokens per paged KV cache block; auto = the shard's default")
    flag(
        "kv-cache-dtype",
        str,
        "auto",
        "what the KV cache stores: auto = --dtype; int8 = each token's K and V rows quantized per KV head "
        "with a float32 scale, about 2x the blocks of bfloat16 and 3.8x of float32 in the same memory "
        "(the CPU kernels or --attention-backend torch; not cuda's kernels)",
    )
    flag("num-threads", int, None, "torch threads per shard; auto = number of CPUs on cpu")
    flag(
        "attention-backend",
        str,
        "auto",
        "cpu or cuda (Rill's native kernels) or torch (the references); auto = the device's kernels "
        "where they can run",
    )
    flag(
        "max-loras",
        int,
        "0",
        "LoRA adapter slots per shard, the most distinct adapters one batch mixes (memory for them is "
        "set aside before the KV cache); 0 = LoRA off. Adapters come from the router's --lora-adapters "
        "and --enable-lora-loading",
    )
    flag("max-lora-rank", int, "16", "the largest LoRA rank an adapter may have (sizes the slots)")
    flag("otlp-endpoint", str, None, "send the shards' and the router's OpenTelemetry spans here", "off")
    flag(
        "api-key",
        str,
        None,
        "the router's --api-key, handed to it as RILL_API_KEY, off any command line",
        "off",
    )
    switch("restart-shards", "restart the shards when one dies (requests in flight fail) instead of exiting")
    flag("router-bin", Path, None, "rill-router binary; auto = on PATH, else ./target/{release,debug}/")
    flag("log-level", str, "info", "debug, info, warning or error (also RUST_LOG for the router when unset)")
    return parser


def parse_args(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> LaunchConfig:
    """Parses the launcher's flags (falling back to RILL_* variables, then defaults), resolves every
    `auto` value and keeps every other flag for the router, which checks them (`check_router`)."""
    environ = os.environ if environ is None else environ
    parser = build_parser(environ)
    args, router_args = parser.parse_known_args(argv)
    if args.help:
        print(help_text(parser, args.router_bin, environ))
        parser.exit()
    for name in LAUNCHER_SET_ROUTER_FLAGS:
        if any(arg == name or arg.startswith(f"{name}=") for arg in router_args):
            parser.error(f"{name} is set by the launcher")
    if args.num_shard < 1:
        parser.error(f"--num-shard must be >= 1, got {args.num_shard}")
    device = args.device or _default_device()
    if device not in ("cpu", "cuda"):
        parser.error(f"--device must be cpu or cuda, got {device!r}")
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    if args.quantized_activations not in ("float32", "int8", "int16"):
        parser.error(
            f"--quantized-activations must be float32, int8 or int16, got {args.quantized_activations!r}"
        )
    if args.quantize not in (None, "q8_0", "q4_0"):
        parser.error(f"--quantize must be q8_0 or q4_0, got {args.quantize!r}")
    if args.quantize is not None and (device != "cpu" or args.num_shard != 1 or dtype != "float32"):
        parser.error("--quantize needs --device cpu, --num-shard 1 and float32 (no --dtype bfloat16)")
    if dtype not in ("float32", "bfloat16", "float16"):
        parser.error(f"--dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if args.kv_cache_dtype not in ("auto", "int8"):
        parser.error(f"--kv-cache-dtype must be auto or int8, got {args.kv_cache_dtype!r}")
    if args.attention_backend not in ("auto", "cpu", "cuda", "torch"):
        parser.error(f"--attention-backend must be auto, cpu, cuda or torch, got {args.attention_backend!r}")
    if args.attention_backend in ("cpu", "cuda") and device != args.attention_backend:
        parser.error(f"--attention-backend {args.attention_backend} needs --device {args.attention_backend}")
    if args.kv_cache_dtype == "int8" and device == "cuda" and args.attention_backend != "torch":
        parser.error(
            "--kv-cache-dtype int8 needs the CPU kernels or --attention-backend torch (cuda's have none)"
        )
    if args.max_loras < 0 or args.max_lora_rank < 1:
        parser.error(
            f"--max-loras must be >= 0 and --max-lora-rank >= 1, "
            f"got {args.max_loras} and {args.max_lora_rank}"
        )
    if args.log_level.lower() not in ("debug", "info", "warning", "error"):
        parser.error(f"--log-level must be debug, info, warning or error, got {args.log_level!r}")
    # Configured here, before the default model's first conversion logs its progress; a no-op when the
    # caller (a test) has configured logging already.
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    num_threads = args.num_threads
    if num_threads is None and device == "cpu":
        num_threads = _num_cpus()
    try:
        router_bin = args.router_bin or find_router_bin(environ)
        # A GGUF file is served as it is (its quantized weights kept quantized) on a CPU with one shard,
        # unless --dtype asks for its weights expanded to floats.
        quantized = args.dtype is None and device == "cpu" and args.num_shard == 1
        model_id = _gguf_model(args.model_id, quantized) if args.model_id else _default_model(quantized)
        draft_model_id = _gguf_model(args.draft_model_id, quantized) if args.draft_model_id else None
    except RuntimeError as error:
        parser.error(str(error))
    for name, path in (("--model-id", model_id), ("--draft-model-id", draft_model_id)):
        if path is not None and not path.is_dir():
            parser.error(
                f"{name} {path} is not a folder (expected a Hugging Face-layout folder or a .gguf file)"
            )
    return LaunchConfig(
        model_id=model_id,
        draft_model_id=draft_model_id,
        num_shard=args.num_shard,
        device=device,
        dtype=dtype,
        kv_block_size=args.kv_block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        num_threads=num_threads,
        attention_backend=args.attention_backend,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        quantize=args.quantize,
        quantized_activations=args.quantized_activations,
        otlp_endpoint=args.otlp_endpoint or None,
        api_key=args.api_key or None,
        restart_shards=args.restart_shards,
        router_bin=router_bin,
        log_level=args.log_level.lower(),
        router_args=tuple(router_args),
    )


def help_text(parser: argparse.ArgumentParser, router_bin: Path | None, environ: Mapping[str, str]) -> str:
    """The launcher's flags, then the router's as `rill-router --help` prints them."""
    try:
        router_bin = router_bin or find_router_bin(environ)
        router_help = subprocess.run(
            [str(router_bin), "--help"], capture_output=True, text=True, check=True, env=environ
        ).stdout
    except (RuntimeError, OSError, subprocess.CalledProcessError) as error:
        router_help = f"(cannot show them: {error})\n"
    return (
        f"{parser.format_help()}\n"
        "Every other flag goes to rill-router unchanged and is checked by it before any shard starts; "
        f"the launcher sets {', '.join(LAUNCHER_SET_ROUTER_FLAGS)}, --model-id and --otlp-endpoint itself. "
        f"A switch is turned off with --switch=false.\n\nrill-router --help:\n\n{router_help}"
    )


def _default_device() -> str:
    import torch  # imported only when --device is left to auto

    return "cuda" if torch.cuda.is_available() else "cpu"


def _num_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _gguf_model(model_id: Path, quantized: bool) -> Path:
    """A .gguf file's converted folder (rill.convert; `quantized`: served as it is); any other path as
    given."""
    if model_id.suffix.lower() != ".gguf":
        return model_id
    from rill.convert import ensure_gguf_model

    return ensure_gguf_model(model_id, quantized=quantized)


def _default_model(quantized: bool) -> Path:
    from rill.convert import ensure_default_model

    return ensure_default_model(quantized=quantized)


def find_router_bin(environ: Mapping[str, str]) -> Path:
    """`rill-router` on PATH or next to this Python (pip installs it there), else a cargo build
    (in $CARGO_TARGET_DIR when set, else ./target), release before debug."""
    candidates = [
        shutil.which("rill-router", path=environ.get("PATH")),
        shutil.which("rill-router", path=str(Path(sys.executable).parent)),
    ]
    for found in candidates:
        if found:
            return Path(found)
    target_dir = Path(environ.get("CARGO_TARGET_DIR") or REPO_ROOT / "target")
    for profile in ("release", "debug"):
        path = target_dir / profile / "rill-router"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise RuntimeError(
        "rill-router not found on PATH nor in ./target/release or ./target/debug: build it with "
        "`cargo build --release` (or `pip install .`), or pass --router-bin PATH"
    )


def shard_command(
    config: LaunchConfig, socket_path: Path, rank: int, dist_init_method: str | None = None
) -> list[str]:
    command = [
        sys.executable, "-m", "rill.shard.server",
        "--model-id", str(config.model_id),
        "--socket", str(socket_path),
        "--device", config.device,
        "--dtype", config.dtype,
        "--rank", str(rank),
        "--world-size", str(config.num_shard),
        "--attention-backend", config.attention_backend,
        *(["--quantize", config.quantize] if config.quantize else []),
        *(["--quantized-activations", config.quantized_activations] if config.quantized_activations != "int16"
          else []),
    ]  # fmt: skip
    if config.kv_block_size is not None:
        command += ["--kv-block-size", str(config.kv_block_size)]
    if config.kv_cache_dtype != "auto":
        command += ["--kv-cache-dtype", config.kv_cache_dtype]
    if config.num_threads is not None:
        command += ["--num-threads", str(config.num_threads)]
    if config.max_loras > 0:
        command += ["--max-loras", str(config.max_loras), "--max-lora-rank", str(config.max_lora_rank)]
    if dist_init_method is not None:
        command += ["--dist-init-method", dist_init_method]
    if config.otlp_endpoint:
        command += ["--otlp-endpoint", config.otlp_endpoint]
    return command


def shard_socket_paths(config: LaunchConfig, socket_dir: Path) -> list[Path]:
    return [socket_dir / f"shard-{rank}.sock" for rank in range(config.num_shard)]


def draft_socket_path(config: LaunchConfig, socket_dir: Path) -> Path | None:
    """The draft model's shard socket, with --draft-model-id."""
    return socket_dir / "draft-shard.sock" if config.draft_model_id is not None else None


def draft_shard_command(config: LaunchConfig, socket_path: Path) -> list[str]:
    """The draft model's shard: one rank of its own, with the target's device, dtype, block size, KV cache
    dtype and threads (no LoRA slots: adapters belong to the target)."""
    assert config.draft_model_id is not None
    draft = dataclasses.replace(config, model_id=config.draft_model_id, num_shard=1, max_loras=0)
    return shard_command(draft, socket_path, 0)


@dataclass(frozen=True)
class RouterLaunch:
    """How to start the router, and what its dry run (`--check-args`) said about its resolved flags."""

    command: list[str]
    env: dict[str, str]
    base_url: str  # where the launcher waits for /health
    shutdown_timeout_s: float  # how long the router drains on SIGTERM


class RouterFlagsError(RuntimeError):
    """rill-router refused the flags; the message is its own."""


def router_command(
    config: LaunchConfig, socket_paths: Sequence[Path], draft_socket: Path | None = None
) -> list[str]:
    command = [str(config.router_bin), "--model-id", str(config.model_id)]
    for socket_path in socket_paths:
        command += ["--shard-socket", str(socket_path)]
    if draft_socket is not None:
        command += ["--draft-shard-socket", str(draft_socket)]
    if config.otlp_endpoint:
        command += ["--otlp-endpoint", config.otlp_endpoint]
    return command + list(config.router_args)


def router_env(config: LaunchConfig, environ: Mapping[str, str]) -> dict[str, str]:
    env = {"RUST_LOG": config.log_level, **environ}
    if config.api_key:
        env["RILL_API_KEY"] = config.api_key
    return env


def check_router(
    config: LaunchConfig,
    socket_paths: Sequence[Path],
    environ: Mapping[str, str],
    draft_socket: Path | None = None,
) -> RouterLaunch:
    """Runs the router's command with `--check-args` (it parses and checks every flag and RILL_* variable,
    then exits) before any shard starts, so a typo fails at once with the router's own message; learns the
    address and drain time the router resolved. Raises `RouterFlagsError`."""
    command, env = router_command(config, socket_paths, draft_socket), router_env(config, environ)
    try:
        result = subprocess.run(
            [*command, "--check-args"], capture_output=True, text=True, env=env, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise RouterFlagsError(f"cannot run {config.router_bin}: {error}") from error
    if result.returncode != 0:
        raise RouterFlagsError(result.stderr.strip() or f"rill-router exited with code {result.returncode}")
    try:
        resolved = json.loads(result.stdout)
        host, port = resolved["addr"].rsplit(":", 1)
        shutdown_timeout_s = float(resolved["shutdown_timeout_s"])
    except (ValueError, KeyError, AttributeError) as error:
        raise RouterFlagsError(f"{config.router_bin} --check-args printed {result.stdout!r}") from error
    connect_host = {"0.0.0.0": "127.0.0.1", "[::]": "[::1]"}.get(host, host)  # a wildcard: connect locally
    return RouterLaunch(command, env, f"http://{connect_host}:{port}", shutdown_timeout_s)


class ChildExited(RuntimeError):
    def __init__(self, name: str, returncode: int) -> None:
        self.name, self.returncode = name, returncode
        reason = f" (killed by {signal.Signals(-returncode).name})" if returncode < 0 else ""
        super().__init__(f"{name} exited with code {returncode}{reason}")


class ShutdownRequested(Exception):
    pass


class Supervisor:
    """The launcher's children by name. Each runs in its own session, so a terminal's Ctrl-C reaches
    only the launcher, which then stops the children in order (router first, then shards)."""

    def __init__(self) -> None:
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.stop_requested = threading.Event()

    def start(
        self,
        name: str,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        death_signal: signal.Signals = signal.SIGKILL,
    ) -> None:
        """Starts a child that receives `death_signal` when the launcher dies (see `die_with_parent`)."""
        logger.info("starting %s: %s", name, " ".join(command))
        process = subprocess.Popen(
            command, env=env, start_new_session=True, preexec_fn=die_with_parent(death_signal)
        )
        self.children[name] = process
        logger.info("%s has pid %d", name, process.pid)

    def check(self) -> None:
        """Raises `ShutdownRequested` after a signal, or `ChildExited` for the first child that exited."""
        if self.stop_requested.is_set():
            raise ShutdownRequested
        for name, process in self.children.items():
            returncode = process.poll()
            if returncode is not None:
                raise ChildExited(name, returncode)

    def wait_until(self, is_ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        """Polls `is_ready` until true, failing fast if a child exits or a signal arrives."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            if is_ready():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} was not ready after {timeout_s:.0f} s")
            time.sleep(POLL_INTERVAL_S)

    def supervise(self, watch: Callable[[], None] = lambda: None) -> None:
        """Blocks until a child exits (raises `ChildExited`) or a signal arrives (`ShutdownRequested`);
        calls `watch` every SHARD_HEALTH_INTERVAL_S meanwhile."""
        next_watch_at = time.monotonic() + SHARD_HEALTH_INTERVAL_S
        while True:
            self.check()
            if time.monotonic() >= next_watch_at:
                watch()
                next_watch_at = time.monotonic() + SHARD_HEALTH_INTERVAL_S
            self.stop_requested.wait(POLL_INTERVAL_S)

    def kill(self, name: str) -> None:
        """SIGKILL to a child's process group (a child alive but hung); `check` then reports its exit."""
        _signal_group(self.children[name], signal.SIGKILL)

    def stop_group(self, names: Sequence[str]) -> None:
        """Stops these children (SIGTERM, then SIGKILL after the grace period) and forgets them."""
        for name in names:
            process = self.children.pop(name)
            if process.poll() is None:
                _signal_group(process, signal.SIGTERM)
                try:
                    process.wait(STOP_GRACE_S)
                except subprocess.TimeoutExpired:
                    _signal_group(process, signal.SIGKILL)
                    process.wait()
            _signal_group(process, signal.SIGKILL)  # grandchildren left in its group

    def stop_all(self, router_grace_s: float = STOP_GRACE_S) -> None:
        """Stops the router first and waits for it (it drains requests in flight for up to its
        --shutdown-timeout, which needs the shards alive), then the shards: SIGTERM to each child's
        process group, SIGKILL what is left after its grace period."""
        alive = [(name, child) for name, child in reversed(self.children.items()) if child.poll() is None]
        router = [(name, child) for name, child in alive if name == "router"]
        shards = [(name, child) for name, child in alive if name != "router"]
        for group, grace_s in ((router, router_grace_s), (shards, STOP_GRACE_S)):
            for name, process in group:
                logger.info("stopping %s (pid %d)", name, process.pid)
                _signal_group(process, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for name, process in group:
                try:
                    process.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop within %.0f s; killing it", name, grace_s)
                    _signal_group(process, signal.SIGKILL)
                    process.wait()
        for process in self.children.values():
            _signal_group(process, signal.SIGKILL)  # grandchildren left in a dead child's group


PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent(sig: signal.Signals) -> Callable[[], None]:
    """A `preexec_fn` that makes the child receive `sig` when the launcher dies, however it dies.

    Linux's parent-death signal is tied to the *thread* that forked: every child is started from the
    launcher's main thread, which lives as long as the launcher. A launcher that died between the fork and
    the prctl call is caught by comparing the parent pid afterwards. Elsewhere this does nothing."""
    launcher_pid = os.getpid()
    # Looked up before the fork: the child calls only the function, never the dynamic loader.
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None

    def set_death_signal() -> None:
        if prctl is None:
            return
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != launcher_pid:
            os.kill(os.getpid(), sig)

    return set_death_signal


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)  # start_new_session made the child its group's leader
    except (ProcessLookupError, PermissionError):
        pass  # the whole group is gone already


def shard_is_healthy(socket_path: Path) -> bool:
    import grpc

    from rill.shard.pb.shard.v1 import shard_pb2, shard_pb2_grpc

    if not socket_path.exists():
        return False
    with grpc.insecure_channel(f"unix://{socket_path}") as channel:
        try:
            shard_pb2_grpc.ShardStub(channel).Health(shard_pb2.HealthRequest(), timeout=2.0)
        except grpc.RpcError:
            return False
    return True


def router_is_healthy(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2.0) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def shard_environment(env: Mapping[str, str]) -> dict[str, str]:
    """The shards' environment: `env`, with libgomp's spin count set to SHARD_SPIN_COUNT unless `env` already
    chooses how OpenMP threads wait."""
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return dict(env)
    return {**env, "GOMP_SPINCOUNT": str(SHARD_SPIN_COUNT)}


def serve(config: LaunchConfig, socket_dir: Path, router: RouterLaunch, supervisor: Supervisor) -> None:
    """Starts every component and supervises them until one exits or a signal arrives. The draft shard is
    not restarted with --restart-shards: its exit stops Rill like the router's."""
    socket_paths = shard_socket_paths(config, socket_dir)
    draft_socket = draft_socket_path(config, socket_dir)
    shard_env = shard_environment(os.environ)
    # The ranks rendezvous through a file in the private folder: no port to pick, nothing to race for.
    dist_init_method = f"file://{socket_dir}/dist-init" if config.num_shard > 1 else None

    def start_shards() -> None:
        (socket_dir / "dist-init").unlink(missing_ok=True)  # a stale rendezvous file hangs a restart
        for rank, socket_path in enumerate(socket_paths):
            command = shard_command(config, socket_path, rank, dist_init_method)
            supervisor.start(f"shard-{rank}", command, shard_env)
        for rank, socket_path in enumerate(socket_paths):
            is_ready = functools.partial(shard_is_healthy, socket_path)
            supervisor.wait_until(is_ready, f"shard-{rank}", SHARD_START_TIMEOUT_S)
            logger.info("shard-%d is healthy", rank)

    watched = {f"shard-{rank}": socket_path for rank, socket_path in enumerate(socket_paths)}
    if draft_socket is not None:
        # Loads while the target's shards do.
        supervisor.start("draft-shard", draft_shard_command(config, draft_socket), shard_env)
    start_shards()
    if draft_socket is not None:
        supervisor.wait_until(
            functools.partial(shard_is_healthy, draft_socket), "draft-shard", SHARD_START_TIMEOUT_S
        )
        logger.info("draft-shard is healthy")
        watched["draft-shard"] = draft_socket

    # SIGTERM: an orphaned router fails its requests with an error (its shards die too) and exits.
    supervisor.start("router", router.command, router.env, signal.SIGTERM)
    is_ready = functools.partial(router_is_healthy, router.base_url)
    supervisor.wait_until(is_ready, "router", ROUTER_START_TIMEOUT_S)
    logger.info("Rill is serving %s at %s", config.model_id, router.base_url)
    missed_health_checks = dict.fromkeys(watched, 0)

    def kill_hung_shards() -> None:
        for name, socket_path in watched.items():
            is_healthy = shard_is_healthy(socket_path)
            missed_health_checks[name] = 0 if is_healthy else missed_health_checks[name] + 1
            if missed_health_checks[name] >= SHARD_MISSED_HEALTH_LIMIT:
                logger.error(
                    "%s missed %d health checks in a row: hung; killing it",
                    name,
                    SHARD_MISSED_HEALTH_LIMIT,
                )
                supervisor.kill(name)
                missed_health_checks[name] = 0

    while True:
        try:
            supervisor.supervise(kill_hung_shards)
        except ChildExited as error:
            if not (config.restart_shards and error.name.startswith("shard-")):
                raise
            # A tensor-parallel group cannot lose a rank: every shard restarts. The router fails the
            # requests in flight, waits for the shards, warms them up again and carries on.
            logger.error("%s; restarting the shards (--restart-shards)", error)
            supervisor.stop_group([name for name in supervisor.children if name.startswith("shard-")])
            start_shards()


def main(argv: Sequence[str] | None = None) -> int:
    # The launcher forks its children after its gRPC health checks (and again on --restart-shards), and each
    # child execs at once. grpcio's fork support restarts its poller in the forked child and can abort it
    # before the exec (grpc/grpc#43055, seen here as a router SIGABRT); the children need none of it.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    config = parse_args(argv)
    supervisor = Supervisor()

    def request_stop(signum: int, frame: FrameType | None) -> None:
        logger.info("received %s; stopping", signal.Signals(signum).name)
        supervisor.stop_requested.set()

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    with tempfile.TemporaryDirectory(prefix="rill-") as socket_dir:  # mode 0700: private sockets
        socket_paths = shard_socket_paths(config, Path(socket_dir))
        draft_socket = draft_socket_path(config, Path(socket_dir))
        try:
            router = check_router(config, socket_paths, os.environ, draft_socket)
        except RouterFlagsError as error:
            print(
                f"{error}\n\n(rill-router refused these flags; python -m rill --help lists them)",
                file=sys.stderr,
            )
            return 2
        # On a signal the router drains requests in flight (--shutdown-timeout); after a crash it need not.
        router_grace_s = STOP_GRACE_S
        try:
            serve(config, Path(socket_dir), router, supervisor)
        except ShutdownRequested:
            router_grace_s = router.shutdown_timeout_s + STOP_GRACE_S
        except (ChildExited, TimeoutError) as error:
            logger.error("%s; stopping Rill", error)
            return 1
        finally:
            supervisor.stop_all(router_grace_s)
    logger.info("Rill stopped")
    return 0
