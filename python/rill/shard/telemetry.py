"""Optional OpenTelemetry tracing for a shard (`--otlp-endpoint URL`).

Each Prefill/Decode call gets a `forward` span, a child of the router's `step` span whose context arrives as
W3C `traceparent` gRPC metadata; spans go out over OTLP/HTTP (protobuf) to `URL/v1/traces` as service
`rill-shard`, with the rank as `rill.rank`. The OpenTelemetry packages (the `tracing` extra) are imported
only here, and this module only with --otlp-endpoint, so serving without tracing never needs them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

SERVICE_NAME = "rill-shard"


class ForwardTracer:
    """Records one span per forward call; `shutdown` exports what is still buffered."""

    def __init__(self, endpoint: str, rank: int, world_size: int) -> None:
        resource = Resource.create(
            {"service.name": SERVICE_NAME, "rill.rank": rank, "rill.world_size": world_size}
        )
        self.provider = TracerProvider(resource=resource)
        exporter = OTLPSpanExporter(endpoint=f"{endpoint.rstrip('/')}/v1/traces")
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("rill.shard")
        self.propagator = TraceContextTextMapPropagator()
        self.rank = rank

    @contextmanager
    def forward_span(self, method: str, metadata: Sequence[tuple[str, str | bytes]] | None) -> Iterator[Span]:
        """A `forward` span for one `method` call (Prefill or Decode), a child of the caller's
        `traceparent` when the metadata carries one (else a root)."""
        carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
        parent = self.propagator.extract(carrier)
        attributes = {"rpc.method": method, "rill.rank": self.rank}
        with self.tracer.start_as_current_span(
            "forward", context=parent, kind=SpanKind.SERVER, attributes=attributes
        ) as span:
            yield span

    def shutdown(self) -> None:
        self.provider.shutdown()
