"""Fixtures of the tenancy tests: a private redis-server, tenants files, JWT keys, and tiny model specs.

The redis-server is our own, on a free port, without persistence (as in
``tests/cache``); the system's Redis is never touched. It can be killed and
started again on the same port, as a crashed and restarted Redis would be.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

# The cache tests' private redis-server (start, kill, start again on the same port).
from cache.support import RedisServer

from aiworks.core.model_config import ModelSpec, TensorSpec


@pytest.fixture
def redis_server(tmp_path):
    """A fresh private redis-server for one test (limits tests kill and restart it)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server
    server.stop()


# ---- configs -----------------------------------------------------------------------------------------


@pytest.fixture
def write_yaml(tmp_path):
    def write(name: str, document) -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    return write


# ---- model specs -------------------------------------------------------------------------------------


@pytest.fixture
def scale_spec() -> ModelSpec:
    """x: FP32[-1, 4] -> y: FP32[-1, 4]; rejects NaN/Inf."""
    return ModelSpec(
        name="scale",
        version="1",
        max_batch_size=8,
        inputs=(TensorSpec("x", "FP32", (4,)),),
        outputs=(TensorSpec("y", "FP32", (4,)),),
        parameters={"reject_nonfinite": "true"},
    )


@pytest.fixture
def echo_spec() -> ModelSpec:
    """text: BYTES[-1, 1] -> echo: BYTES[-1, 1]; masks e-mail addresses and phone numbers."""
    return ModelSpec(
        name="echo",
        version="1",
        max_batch_size=8,
        inputs=(TensorSpec("text", "BYTES", (1,)),),
        outputs=(TensorSpec("echo", "BYTES", (1,)),),
        parameters={"mask_patterns": "email,phone,id_card"},
    )
