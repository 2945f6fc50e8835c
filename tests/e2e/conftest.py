"""Fixtures that start Rill the way a user does: `python -m rill` with real shards, router and model."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from bench import servers
from bench.servers import free_port, rill_command


class Server(servers.Server):
    """A running launcher and the address of its router."""

    def info(self) -> dict:
        return requests.get(f"{self.url}/info", timeout=10).json()

    def wait_idle(self, timeout_s: float = 30.0) -> dict:
        """Waits until no request is waiting or running; returns /info then."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.info()
            kv = info["kv"]
            if kv["waiting_requests"] == 0 and kv["running_requests"] == 0:
                return info
            if time.monotonic() > deadline:
                raise AssertionError(f"server still busy after {timeout_s}s: {kv}")
            time.sleep(0.1)


def start_server(
    model_path: Path,
    tmp_dir: Path,
    *extra_args: str,
    timeout_s: float = 300.0,
    host: str = "127.0.0.1",
    port: int | None = None,
) -> Server:
    """`python -m rill` with `model_path` on the CPU with one thread, listening on `host`:`port` (a free port
    when None), once GET /health answers 200."""
    port = free_port() if port is None else port
    if "RILL_ROUTER_BIN" in os.environ:
        extra_args = (*extra_args, "--router-bin", os.environ["RILL_ROUTER_BIN"])
    flags = ["--model-id", str(model_path), "--device", "cpu", "--num-threads", "1", "--hostname", host]
    flags += extra_args
    log_path = tmp_dir / f"launcher-{host}-{port}.log"
    started = servers.start(
        rill_command(port, *flags), port, log_path, what="launcher", timeout_s=timeout_s, host=host
    )
    return Server(started.url, started.process, started.log_path)


def start_servers(
    model_path: Path,
    tmp_dir: Path,
    *extra_args: str,
    hosts: Sequence[str] = ("127.0.0.1", "127.0.0.1"),
    port: int | None = None,
) -> list[Server]:
    """One `start_server` per host, all at once (their models load in parallel), on `port` (a free one each
    when None)."""
    with ThreadPoolExecutor(len(hosts)) as pool:
        args = (model_path, tmp_dir, *extra_args)
        futures = [pool.submit(start_server, *args, host=host, port=port) for host in hosts]
        return [future.result() for future in futures]


def stop_server(server: Server) -> None:
    servers.stop(server.process, grace_s=30)


def kill_instance(server: Server) -> None:
    """A crash: SIGKILL to the launcher and to the process group of each of its children (shards, router;
    the launcher starts each in its own session), so nothing gets to shut down cleanly."""
    pid = server.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    server.process.kill()
    for child in children:
        try:
            os.killpg(int(child), signal.SIGKILL)
        except ProcessLookupError:
            pass
    server.process.wait(timeout=30)


@pytest.fixture(scope="session")
def default_model() -> Path:
    from rill.convert import ensure_default_model

    return ensure_default_model()


def make_tiny_model(default_model: Path, path: Path) -> Path:
    """A tiny random Llama (4 query heads, 2 KV heads) with the default model's tokenizer: the real
    launcher, router and shard at a fraction of the default model's cost."""
    from tests.shard.conftest import save_tiny_model

    # Positions for the longest generations the tests ask for (the router caps requests at them).
    save_tiny_model(path, vocab_size=49152, bos_token_id=1, eos_token_id=2, max_position_embeddings=8192)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model / name, path / name)
    return path


@pytest.fixture(scope="session")
def tiny_model(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(default_model, tmp_path_factory.mktemp("tiny-model"))


# The session server's flags: a small batch-token budget, so long prompts are prefilled in chunks.
SERVER_FLAGS = ("--max-batch-tokens", "256", "--max-batch-total-tokens", "40000", "--max-batch-size", "32")


@pytest.fixture(scope="session")
def server(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default model behind `SERVER_FLAGS`."""
    tmp_dir = tmp_path_factory.mktemp("server")
    srv = start_server(default_model, tmp_dir, *SERVER_FLAGS)
    yield srv
    stop_server(srv)
    assert srv.process.returncode == 0, srv.log_path.read_text()[-3000:]
