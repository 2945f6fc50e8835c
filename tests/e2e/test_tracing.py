"""End to end: with --otlp-endpoint the router and the shard send OpenTelemetry spans that form one trace.

A stand-in OTLP/HTTP collector (an http.server accepting protobuf `POST /v1/traces`) runs in the test; Rill
(a tiny random Llama with the default model's tokenizer) starts with --otlp-endpoint pointing at it. After a
request, stopping Rill must flush every span: the router's `request` (carrying the x-request-id) with its
`queue` child, `step` spans linked to that request, and the shard's `forward` spans, children of those
steps in the same traces (the W3C traceparent went over gRPC).
"""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from .conftest import start_server, stop_server

trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="needs opentelemetry-proto (the dev extra)",
)
pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs the tracing extra")

REQUEST_ID = "trace-e2e-7f3a"
CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict
    links: list[tuple[str, str, dict]]  # (trace id, span id, attributes)


def _value(any_value) -> object:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


class Collector:
    """Accepts OTLP/HTTP protobuf exports and keeps every span it receives."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                collector.add(request)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, request) -> None:
        received = []
        for resource_spans in request.resource_spans:
            service = _attributes(resource_spans.resource.attributes).get("service.name", "")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    links = [
                        (link.trace_id.hex(), link.span_id.hex(), _attributes(link.attributes))
                        for link in span.links
                    ]
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes=_attributes(span.attributes),
                            links=links,
                        )
                    )
        with self.lock:
            self.spans.extend(received)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def collector() -> Iterator[Collector]:
    collector = Collector()
    yield collector
    collector.close()


def test_router_and_shard_spans_form_one_trace(
    tiny_model: Path, tmp_path: Path, collector: Collector
) -> None:
    server = start_server(tiny_model, tmp_path, "--otlp-endpoint", collector.url, "--max-batch-size", "8")
    try:
        response = requests.post(
            f"{server.url}/generate",
            json={"inputs": "The river said", "parameters": {"max_new_tokens": 4}},
            headers={"x-request-id": REQUEST_ID},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert response.headers["x-request-id"] == REQUEST_ID
        # A client's W3C traceparent: the router's request span continues the client's trace.
        traced = requests.post(
            f"{server.url}/generate",
            json={"inputs": "A distant star", "parameters": {"max_new_tokens": 2}},
            headers={"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"},
            timeout=120,
        )
        assert traced.status_code == 200, traced.text
    finally:
        stop_server(server)  # the spans still buffered are flushed on shutdown
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]

    spans = collector.spans
    router = [s for s in spans if s.service == "rill-router"]
    shard = [s for s in spans if s.service == "rill-shard"]
    assert router and shard, f"spans by service: {sorted({s.service for s in spans})}"

    [request] = [s for s in router if s.name == "request" and s.attributes.get("request_id") == REQUEST_ID]
    assert request.attributes["http.route"] == "/generate"
    assert request.attributes["http.request.method"] == "POST"
    assert request.attributes["http.response.status_code"] == 200

    [queue] = [s for s in router if s.name == "queue" and s.parent_span_id == request.span_id]
    assert queue.trace_id == request.trace_id

    # Steps are shared by requests: each one links to the request spans it served.
    request_ref = (request.trace_id, request.span_id)
    steps = [s for s in router if s.name == "step" and request_ref in {ln[:2] for ln in s.links}]
    assert len(steps) >= 4, f"{len(steps)} steps for 4 tokens"  # one prefill, then a decode per token
    assert {s.attributes["kind"] for s in steps} == {"prefill", "decode"}
    assert all(s.attributes["tokens"] >= 1 and s.attributes["sequences"] >= 1 for s in steps)
    prefill = next(s for s in steps if s.attributes["kind"] == "prefill")
    link = next(ln for ln in prefill.links if ln[1] == request.span_id)
    assert link[2]["scheduled_tokens"] >= 2  # the prompt's tokens

    # Across processes: every such step has the shard's forward span as its child, in the step's trace.
    for step in steps:
        children = [s for s in shard if s.name == "forward" and s.parent_span_id == step.span_id]
        assert len(children) == 1, f"step {step.span_id}: {len(children)} forward spans"
        [forward] = children
        assert forward.trace_id == step.trace_id
        expected_method = "Decode" if step.attributes["kind"] == "decode" else "Prefill"
        assert forward.attributes["rpc.method"] == expected_method
        assert forward.attributes["rill.rank"] == 0
        assert forward.attributes["rill.sequences"] == step.attributes["sequences"]

    [continued] = [s for s in router if s.name == "request" and s.trace_id == CLIENT_TRACE_ID]
    assert continued.parent_span_id == CLIENT_SPAN_ID
