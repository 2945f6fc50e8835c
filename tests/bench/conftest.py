"""Fixtures: fake servers started per test and stopped after it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.bench.fake_server import FakeBehaviour, FakeServer


@pytest.fixture
def fake_server() -> Iterator[Callable[..., FakeServer]]:
    """`fake_server(**behaviour)` starts a fake server; every one started is stopped after the test."""
    servers: list[FakeServer] = []

    def start(**behaviour: object) -> FakeServer:
        server = FakeServer(FakeBehaviour(**behaviour)).start()  # type: ignore[arg-type]
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()
