"""End-to-end fixtures: the whole suite as real local processes on free ports."""

from __future__ import annotations

import pytest
from e2e_support import start_suite


def pytest_collection_modifyitems(items):
    for item in items:
        if "/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


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
