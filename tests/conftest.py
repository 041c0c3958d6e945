"""Shared fixtures: the demo model repository, built once per test session, and a private redis-server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory) -> Path:
    """The demo repository (iris, digits v1 and v2), built offline once per session.

    AIWORKS_TEST_MODEL_REPOSITORY points at a prebuilt one to save the build.
    """
    from aiworks.demo.models import build_demo_repository

    prebuilt = os.environ.get("AIWORKS_TEST_MODEL_REPOSITORY")
    if prebuilt:
        return Path(prebuilt)
    target = tmp_path_factory.mktemp("repo") / "model-repository"
    build_demo_repository(target, progress=lambda m: None)
    return target


@pytest.fixture
def redis_url(tmp_path):
    """The URL of a redis-server of this test's own, on a free port, stopped after it (tests/cache/support.py)."""
    from cache.support import RedisServer

    server = RedisServer(tmp_path / "redis")
    server.start()
    yield server.url
    server.stop()
