"""Monitor tests: a fake clock, a fake platform and fake metrics drive the real control loop.

Unit tests here cannot open network connections; a test marked ``loopback``
may reach 127.0.0.1 only (the HTTP API and the control API, served in the
test itself).
"""

from __future__ import annotations

import socket

import pytest
from monitor_support import FakeClock, FakeCollector, FakePlatform, make_settings  # noqa: F401


def pytest_configure(config):
    config.addinivalue_line("markers", "loopback: the test serves and calls HTTP on 127.0.0.1 only")


@pytest.fixture(autouse=True)
def no_network(request, monkeypatch):
    loopback = request.node.get_closest_marker("loopback") is not None
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def allowed(address) -> bool:
        return loopback and isinstance(address, tuple) and address[0] in ("127.0.0.1", "::1", "localhost")

    def connect(self, address, *args, **kwargs):
        if not allowed(address):
            raise RuntimeError(f"monitor unit tests must not open network connections (tried {address!r})")
        return real_connect(self, address, *args, **kwargs)

    def connect_ex(self, address, *args, **kwargs):
        if not allowed(address):
            raise RuntimeError(f"monitor unit tests must not open network connections (tried {address!r})")
        return real_connect_ex(self, address, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()
