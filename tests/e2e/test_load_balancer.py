"""Two Rill instances behind nginx, configured by deploy/nginx/nginx.conf: token streams pass through the
proxy as they are produced, and when one instance dies, requests through nginx keep succeeding.

Needs `nginx` on PATH (.ci/run installs it); skipped otherwise. Each instance is the default model on the
CPU with one thread and a small KV pool, so two fit on a small machine next to other tests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from bench.servers import ROOT, accepts_connections, free_port, wait_until
from tests.e2e.conftest import Server, kill_instance, start_servers, stop_server

NGINX = shutil.which("nginx")
pytestmark = pytest.mark.skipif(
    NGINX is None, reason="nginx is not on PATH (apt-get install -y nginx; .ci/run installs it)"
)
NGINX_CONF = ROOT / "deploy" / "nginx" / "nginx.conf"
INSTANCE_ARGS = (
    "--max-batch-total-tokens", "1024",
    "--max-batch-tokens", "128",
    "--max-batch-size", "4",
    "--max-concurrent-requests", "8",
)  # fmt: skip


@dataclass
class Cluster:
    instances: list[Server]
    url: str  # nginx
    access_log: Path


def render_nginx_conf(upstream_ports: list[int], listen_port: int, tmp_dir: Path) -> str:
    """The production config with loopback addresses, and its files in `tmp_dir` (the rest unchanged)."""
    text = NGINX_CONF.read_text()
    for index, port in enumerate(upstream_ports, start=1):
        text, count = re.subn(rf"\bserver rill-{index}:8080\b", f"server 127.0.0.1:{port}", text)
        assert count == 1, f"no `server rill-{index}:8080` line in {NGINX_CONF}"
    text, count = re.subn(r"\blisten 8080;", f"listen 127.0.0.1:{listen_port};", text)
    assert count == 1, f"no `listen 8080;` line in {NGINX_CONF}"
    text = text.replace("worker_processes auto;", "worker_processes 1;")
    text = text.replace("/var/log/nginx/access.log", str(tmp_dir / "access.log"))
    temp_paths = "".join(
        f"    {kind}_temp_path {tmp_dir / kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    text = text.replace("http {\n", "http {\n" + temp_paths, 1)
    if os.geteuid() == 0:  # the master runs as root: keep the workers able to use the temp folder
        text = "user root;\n" + text
    return text


@pytest.fixture(scope="module")
def cluster(default_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp_dir = tmp_path_factory.mktemp("load_balancer")
    instances = start_servers(default_model, tmp_dir, *INSTANCE_ARGS)
    nginx_process = None
    try:
        port = free_port()
        conf = tmp_dir / "nginx.conf"
        upstream_ports = [int(server.url.rsplit(":", 1)[1]) for server in instances]
        conf.write_text(render_nginx_conf(upstream_ports, port, tmp_dir))
        error_log = tmp_dir / "error.log"
        command = [NGINX, "-p", str(tmp_dir), "-e", str(error_log), "-c", str(conf)]
        check = subprocess.run([*command, "-t"], capture_output=True, text=True)
        assert check.returncode == 0, f"nginx -t rejects the rendered config:\n{check.stderr}"
        nginx_process = subprocess.Popen([*command, "-g", f"daemon off; pid {tmp_dir / 'nginx.pid'};"])
        wait_until(
            lambda: accepts_connections(port), nginx_process, "nginx", error_log, timeout_s=20, poll_s=0.1
        )
        yield Cluster(instances=instances, url=f"http://127.0.0.1:{port}", access_log=tmp_dir / "access.log")
    finally:
        if nginx_process is not None:
            nginx_process.send_signal(signal.SIGQUIT)  # graceful stop
            try:
                nginx_process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                nginx_process.kill()
                nginx_process.wait()
        for server in instances:
            stop_server(server)


def generate(url: str, prompt: str, max_new_tokens: int = 4) -> requests.Response:
    body = {"inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens}}
    return requests.post(f"{url}/generate", json=body, timeout=120)


def test_stream_arrives_incrementally_through_nginx(cluster: Cluster) -> None:
    body = {"inputs": "Count from one to twenty: one, two,", "parameters": {"max_new_tokens": 16}}
    arrivals: list[tuple[float, bytes]] = []
    with requests.post(f"{cluster.url}/generate_stream", json=body, stream=True, timeout=120) as response:
        assert response.status_code == 200, response.text
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers.get("x-accel-buffering") == "no"
        for chunk in response.raw.stream(amt=65536, decode_content=True):  # each read as the socket gives it
            arrivals.append((time.monotonic(), chunk))
    events = [
        json.loads(line[len("data:") :])
        for line in b"".join(chunk for _, chunk in arrivals).decode().splitlines()
        if line.startswith("data:")
    ]
    assert len(events) == 16
    assert events[-1]["generated_text"] == "".join(event["token"]["text"] for event in events)
    # Through the proxy the events come one by one, not as one body at the end: many separate reads, and
    # the first event long before the last (a token takes tens of milliseconds on one CPU thread).
    data_times = [at for at, chunk in arrivals if b"data:" in chunk]
    assert len(data_times) > 1, f"the stream arrived in {len(arrivals)} read(s): buffered by the proxy?"
    spread = data_times[-1] - data_times[0]
    assert spread > 0.05, f"all events arrived within {spread:.3f}s"


def test_requests_survive_an_instance_crash(cluster: Cluster) -> None:
    # Both instances serve: least_conn spreads sequential requests over them.
    for index in range(4):
        response = generate(cluster.url, f"Request {index}: the sky is")
        assert response.status_code == 200, response.text
    upstreams = set(re.findall(r"upstream=(\S+)", cluster.access_log.read_text()))
    assert {server.url.removeprefix("http://") for server in cluster.instances} <= upstreams, upstreams

    dead, alive = cluster.instances
    kill_instance(dead)
    with pytest.raises(requests.ConnectionError):
        requests.get(f"{dead.url}/health", timeout=5)

    # Every request through nginx still succeeds: the dead one refuses connections, nginx passes the request
    # on to the other (nothing was sent yet) and then leaves the dead one out for fail_timeout.
    for index in range(6):
        response = generate(cluster.url, f"After the crash, request {index}: the sea is")
        assert response.status_code == 200, response.text
        assert response.json()["generated_text"]
    stream_body = {"inputs": "Name three rivers:", "parameters": {"max_new_tokens": 4}}
    with requests.post(
        f"{cluster.url}/generate_stream", json=stream_body, stream=True, timeout=120
    ) as stream:
        assert stream.status_code == 200
        assert sum(line.startswith(b"data:") for line in stream.iter_lines()) == 4
    assert requests.get(f"{alive.url}/health", timeout=5).status_code == 200
