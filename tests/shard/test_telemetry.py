"""The shard's optional tracing: serving without --otlp-endpoint never imports OpenTelemetry, and with it the
`forward` span continues the trace named by the caller's `traceparent` metadata."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_the_server_imports_no_opentelemetry_without_the_flag() -> None:
    code = (
        "import sys, rill.shard.server\n"
        "config = rill.shard.server.parse_args(['--model-id', '/m', '--socket', '/s'])\n"
        "assert config.otlp_endpoint is None\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('opentelemetry'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_forward_span_is_a_child_of_the_traceparent(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs the tracing extra")
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
    from rill.shard import telemetry

    memory = InMemorySpanExporter()
    endpoints = []

    def exporter(endpoint: str) -> InMemorySpanExporter:
        endpoints.append(endpoint)
        return memory

    monkeypatch.setattr(telemetry, "OTLPSpanExporter", exporter)
    tracer = telemetry.ForwardTracer("http://collector:4318/", rank=1, world_size=2)
    assert endpoints == ["http://collector:4318/v1/traces"]
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    metadata = [("traceparent", f"00-{trace_id}-{parent_id}-01"), ("bin-bin", b"\x00")]
    with tracer.forward_span("Decode", metadata) as span:
        span.set_attribute("rill.sequences", 3)
    with tracer.forward_span("Prefill", None):
        pass
    assert memory.get_finished_spans() == ()  # batched until the export interval or shutdown
    tracer.shutdown()
    child, root = memory.get_finished_spans()
    assert child.name == "forward"
    assert format(child.context.trace_id, "032x") == trace_id
    assert format(child.parent.span_id, "016x") == parent_id
    assert child.attributes["rpc.method"] == "Decode" and child.attributes["rill.rank"] == 1
    assert child.resource.attributes["service.name"] == "rill-shard"
    assert root.parent is None and root.attributes["rpc.method"] == "Prefill"
