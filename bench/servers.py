"""Start a server process, wait until it is healthy, stop it: written once for the benchmark suites
(`bench.harness`, `bench.peers`) and the tests (`tests/e2e`, `tests/test_launcher.py`, `tests/shard`).

- `start(command, port, log_path)` runs a server from the repository root, its output into `log_path`, and
  returns once `GET /health` answers 200; `serving(...)` does the same as a context manager that stops it.
- `wait_until(is_ready, process, ...)` is that wait for any other sign of life (a port that accepts, a unix
  socket that exists). It fails with `RuntimeError`, naming the server and quoting the end of its log, as
  soon as the process exits, or when the time is up.
- `stop(process)`: SIGTERM, then SIGKILL after a grace period.

Standard library only, so a test imports it without the load generator's dependencies.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LOG_TAIL_CHARS = 5000  # of a server's log, quoted when it fails to start


@dataclass
class Server:
    """A server process that answered `GET /health`, and its address."""

    url: str
    process: subprocess.Popen[bytes]
    log_path: Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def rill_command(port: int, *flags: str) -> list[str]:
    """`python -m rill` (the launcher, as a user starts it) on `port`, with `flags`."""
    return [sys.executable, "-m", "rill", "--port", str(port), *flags]


def spawn(
    command: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Starts `command` from the repository root, its stdout and stderr into `log_path`."""
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)


def log_tail(log_path: Path) -> str:
    text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    return text[-LOG_TAIL_CHARS:]


def is_healthy(url: str) -> bool:
    """`GET {url}/health` answers 200 within a second."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:  # refused, reset, timed out, or an HTTP error status
        return False


def accepts_connections(port: int) -> bool:
    """Something listens on 127.0.0.1:`port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def wait_until(
    is_ready: Callable[[], bool],
    process: subprocess.Popen[Any],
    what: str,
    log_path: Path,
    timeout_s: float,
    poll_s: float = 0.5,
) -> None:
    """Polls `is_ready` every `poll_s` until it holds. Raises `RuntimeError` naming `what`, with the end of
    `log_path`, when `process` exits first or after `timeout_s`; the process is left as it is (the caller
    stops it)."""
    deadline = time.monotonic() + timeout_s
    while not is_ready():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}; {log_path}:\n{log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s; {log_path}:\n{log_tail(log_path)}")
        time.sleep(poll_s)


def stop(process: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """SIGTERM, and SIGKILL when it has not exited `grace_s` later; returns once it has exited."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start(
    command: Sequence[str],
    port: int,
    log_path: Path,
    *,
    what: str = "server",
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    host: str = "127.0.0.1",
) -> Server:
    """Runs `command`, a server on `host`:`port` (see `spawn`), until `GET /health` answers 200. If it exits
    first or is not healthy within `timeout_s`, it is stopped and `RuntimeError` raised (see `wait_until`)."""
    process = spawn(command, log_path, env)
    url = f"http://{host}:{port}"
    try:
        wait_until(lambda: is_healthy(url), process, what, log_path, timeout_s)
    except BaseException:
        stop(process)
        raise
    return Server(url, process, log_path)


@contextmanager
def serving(
    command: Sequence[str], port: int, log_path: Path, *, what: str, timeout_s: float, grace_s: float = 60.0
) -> Iterator[Server]:
    """`start`, yield the server, and `stop` it on exit (SIGKILL after `grace_s`)."""
    server = start(command, port, log_path, what=what, timeout_s=timeout_s)
    try:
        yield server
    finally:
        stop(server.process, grace_s)
