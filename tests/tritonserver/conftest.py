"""Fixtures for the triton backend: a real tritonserver (from nvidia-pytriton) on the CPU.

A Triton Python-backend model that runs ONNX Runtime (testdata/onnx_python_model.py)
stands in for a GPU model; its configs ask for KIND_GPU and the runtime turns
that into KIND_CPU with ``triton_instance_kind``, as on any CPU-only Triton.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from triton_support import write_repository

from aiworks.runtime.tritonserver import TritonDistribution, TritonServer, TritonServerError


@pytest.fixture(scope="session")
def triton_distribution() -> TritonDistribution:
    try:
        return TritonDistribution.find()
    except TritonServerError as exc:
        pytest.skip(f"no tritonserver here: {exc}")


@pytest.fixture(scope="session")
def suite_repository(tmp_path_factory) -> Path:
    return write_repository(tmp_path_factory.mktemp("suite-repo"))


@pytest.fixture(scope="session")
def triton_server(triton_distribution, tmp_path_factory):
    """A tritonserver the tests start themselves (the ``triton_url`` mode)."""
    work = tmp_path_factory.mktemp("triton")
    server = TritonServer(triton_distribution, work / "models", work)
    server.start(timeout_s=60)
    yield server
    server.stop()
    assert server.exit_code is not None
