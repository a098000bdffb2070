"""Shared fixtures of the integration tests: one real nats-server (JetStream) for the whole session.

`nats_server` starts it once on a free loopback port with its store in a temp folder and stops it by
PID at the end; `experiment_name` gives each test its own experiment, so bus objects never collide.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from kuberl.runtime.bus.server import NatsServer, start_nats_server


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A real nats-server with JetStream, shared by the session (use `.url`)."""
    server = start_nats_server(store_dir=str(tmp_path_factory.mktemp("jetstream")))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def experiment_name(request: pytest.FixtureRequest) -> str:
    """A unique, valid experiment name for this test (DNS-1123 label)."""
    stem = "".join(c if c.isalnum() else "-" for c in request.node.name.lower())[:30].strip("-") or "t"
    return f"{stem}-{uuid.uuid4().hex[:8]}"

from conftest_engines import vllm_instruct_server, vllm_server  # noqa: E402,F401  (the session vLLM CPU server fixtures)
