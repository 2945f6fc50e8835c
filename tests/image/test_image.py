"""The serving image, run with podman as a user runs it: the image `deploy/image/build.sh` builds, one
container under a memory limit on the host's network (a free loopback port through RILL_PORT), serving the
built-in default model on the CPU.

- it becomes ready (GET /ready 200) and answers a chat completion with the default model's real output;
- it sizes its KV and swap pools within the container's memory limit, and its log and /info say so;
- /health and /ready behave as docs/api.md says, while serving and while draining;
- `podman stop` (SIGTERM) lets a request in flight finish with its whole output, and the container exits 0.

The tests share one container (a cold start costs a minute on a small CPU); the drain test stops it, so it
comes last. Needs podman (docs/deployment.md, "Podman"); .ci/run installs it and builds the image first.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import requests

from bench.servers import free_port

IMAGE = "localhost/rill:0.1.0"  # deploy/image/build.sh's default tag
MEMORY_LIMIT_GIB = 3
READY_TIMEOUT_S = 600.0
# The drain may take this long: the stream in flight has IN_FLIGHT_TOKENS to go on a CPU that may be busy.
SHUTDOWN_TIMEOUT_S = 150

pytestmark = pytest.mark.skipif(
    shutil.which("podman") is None,
    reason="podman is not installed: apt-get install podman mmdebstrap runc, then deploy/image/build.sh "
    "(docs/deployment.md, 'Podman')",
)


@dataclass
class Container:
    name: str
    url: str

    def logs(self) -> str:
        """What the container wrote; the launcher, router and shards log to stderr."""
        logs = podman("logs", self.name)
        return logs.stdout + logs.stderr

    def state(self) -> dict:
        return json.loads(podman("inspect", "--format", "{{json .State}}", self.name).stdout)


def podman(*args: str, timeout_s: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout_s, check=True)


@pytest.fixture(scope="module")
def container() -> Iterator[Container]:
    if subprocess.run(["podman", "image", "exists", IMAGE]).returncode != 0:
        pytest.fail(f"no image {IMAGE}: build it with deploy/image/build.sh")
    port = free_port()
    container = Container(name=f"rill-test-{port}", url=f"http://127.0.0.1:{port}")
    started_at = time.monotonic()
    podman(
        "run", "--detach", "--name", container.name, "--network", "host", "--memory", f"{MEMORY_LIMIT_GIB}g",
        "--env", f"RILL_PORT={port}", "--env", "RILL_HOSTNAME=127.0.0.1",
        "--env", f"RILL_SHUTDOWN_TIMEOUT={SHUTDOWN_TIMEOUT_S}", IMAGE,
    )  # fmt: skip
    try:
        while not is_ready(container.url):
            assert container.state()["Running"], f"container exited: {container.logs()[-3000:]}"
            assert time.monotonic() - started_at < READY_TIMEOUT_S, container.logs()[-3000:]
            time.sleep(0.5)
        print(f"container start to /ready: {time.monotonic() - started_at:.1f} s")
        yield container
    finally:
        print(container.logs()[-3000:])
        podman("rm", "--force", "--volumes", container.name)


def is_ready(url: str) -> bool:
    try:
        return requests.get(f"{url}/ready", timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


def test_serves_the_default_model(container: Container) -> None:
    response = requests.post(
        f"{container.url}/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16,
            "temperature": 0,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert "Paris" in body["choices"][0]["message"]["content"], body
    assert 0 < body["usage"]["completion_tokens"] <= 16, body
    info = requests.get(f"{container.url}/info", timeout=10).json()
    assert info["model_device_type"] == "cpu", info


def test_pools_fit_the_memory_limit(container: Container) -> None:
    memory = requests.get(f"{container.url}/info", timeout=10).json()["memory"]
    limit = f"limit {MEMORY_LIMIT_GIB:.2f} GiB"
    # The pools are shares of the room left under the limit, not of the host's MemAvailable (24 GiB and more
    # on a CI machine), so they stay well below the limit.
    assert limit in memory["kv_pool_reason"], memory
    assert limit in memory["swap_pool_reason"], memory
    assert memory["kv_pool_bytes"] + memory["swap_pool_bytes"] < MEMORY_LIMIT_GIB * 2**30 // 2, memory
    kv_pool_lines = [line for line in container.logs().splitlines() if "KV pool:" in line]
    assert kv_pool_lines and limit in kv_pool_lines[-1], kv_pool_lines


def test_health_and_ready_while_serving(container: Container) -> None:
    assert requests.get(f"{container.url}/health", timeout=5).status_code == 200
    ready = requests.get(f"{container.url}/ready", timeout=5)
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}, ready.text


IN_FLIGHT_TOKENS = 500  # long enough to outlast the checks made while it drains


def test_podman_stop_drains_the_request_in_flight(container: Container) -> None:
    """SIGTERM (`podman stop`, through tini to the launcher): the stream in flight gets all its tokens,
    /ready answers 503 while it drains (and /health 200: the router still runs), a new request gets 503, and
    the container exits 0."""
    stream = requests.post(
        f"{container.url}/v1/completions",
        json={
            "prompt": "Once upon a time",
            "max_tokens": IN_FLIGHT_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        stream=True,
        timeout=120,
    )
    assert stream.status_code == 200, stream.text
    events = stream.iter_lines()
    first = next(line for line in events if line.startswith(b"data: "))
    stop_args = ("stop", "--time", str(SHUTDOWN_TIMEOUT_S + 30), container.name)
    stopper = threading.Thread(target=podman, args=stop_args, kwargs={"timeout_s": SHUTDOWN_TIMEOUT_S + 60})
    stopper.start()
    deadline = time.monotonic() + 60
    while (ready := requests.get(f"{container.url}/ready", timeout=5)).status_code == 200:
        assert time.monotonic() < deadline, "still ready a minute after podman stop"
        time.sleep(0.05)
    assert "shutting down" in ready.json()["reason"], ready.text
    assert requests.get(f"{container.url}/health", timeout=5).status_code == 200
    refused = requests.post(f"{container.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                            timeout=10)  # fmt: skip
    assert refused.status_code == 503, refused.text
    chunks = [json.loads(line[len(b"data: ") :]) for line in [first, *events] if line.startswith(b"data: {")]
    stopper.join()
    assert chunks[-1]["usage"]["completion_tokens"] == IN_FLIGHT_TOKENS, chunks[-3:]
    finish_reasons = [choice["finish_reason"] for chunk in chunks for choice in chunk["choices"]]
    assert "length" in finish_reasons, chunks[-3:]
    state = container.state()
    assert not state["Running"] and state["ExitCode"] == 0, (state, container.logs()[-3000:])
