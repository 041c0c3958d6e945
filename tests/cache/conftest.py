"""Fixtures of the cache tests: a private redis-server, tiny models, and the suite with its cache.

The redis-server is our own, on a free port, without persistence; the
system's Redis (if any) is never touched. CI installs the binary with
``scripts/ensure-debian-packages.sh``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .support import RedisServer, build_repository, start_cached_suite


def pytest_collection_modifyitems(items):
    for item in items:
        if "/cache/" in str(item.fspath) and "suite" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def make_redis(tmp_path):
    """Starts throwaway redis-servers for one test; stops them after it."""
    servers = []

    def make() -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}")
        servers.append(server)
        server.start()
        return server

    yield make
    for server in servers:
        if server.process is not None and server.process.poll() is None:
            server.resume()
        server.stop()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def cache_repository(tmp_path_factory) -> Path:
    return build_repository(tmp_path_factory.mktemp("cache-repo") / "models")


@pytest.fixture(scope="module")
def suite(cache_repository, redis_server, tmp_path_factory):
    """Scheduler, one runtime, the cache on our private Redis, and the gateway."""
    s = start_cached_suite(cache_repository, tmp_path_factory.mktemp("logs"), redis_url=redis_server.url)
    yield s
    s.supervisor.stop()
