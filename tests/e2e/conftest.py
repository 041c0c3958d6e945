"""End-to-end fixtures: the whole suite as real local processes on free ports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from aiworks.supervisor.supervisor import SuiteConfig, Supervisor


def pytest_collection_modifyitems(items):
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@dataclass
class Suite:
    supervisor: Supervisor
    http_url: str  # host:port, as tritonclient.http wants it
    grpc_url: str
    model_repository: Path

    @property
    def base(self) -> str:
        return f"http://{self.http_url}"


def start_suite(model_repository: Path, log_dir: Path, **overrides) -> Suite:
    config = SuiteConfig.on_free_ports(
        model_repository=model_repository,
        log_dir=log_dir,
        **overrides,
    )
    supervisor = Supervisor(config)
    try:
        supervisor.start()
    except Exception:
        supervisor.stop()
        raise
    return Suite(supervisor, f"127.0.0.1:{config.http_port}", f"127.0.0.1:{config.grpc_port}", model_repository)


@pytest.fixture(scope="session")
def suite(model_repository, tmp_path_factory):
    """Scheduler, two runtime replicas and a gateway, shared by the e2e tests."""
    s = start_suite(model_repository, tmp_path_factory.mktemp("logs"))
    yield s
    s.supervisor.stop()
    for child in s.supervisor.children:
        assert child.process.returncode is not None


@pytest.fixture
def http_client(suite):
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(suite.http_url)
    yield client
    client.close()


@pytest.fixture
def grpc_client(suite):
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(suite.grpc_url)
    yield client
    client.close()
