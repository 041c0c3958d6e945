"""Rollout tests: the controller on a fake clock, fake numbers and a recording target;
the adapters against real servers on loopback (and a stub Kubernetes API); and the
whole thing end to end against the real suite.

Tests here cannot open network connections, except that a test marked
``loopback`` or ``e2e`` may reach 127.0.0.1.
"""

from __future__ import annotations

import socket

import pytest


def pytest_configure(config):
    config.addinivalue_line("markers", "loopback: the test serves and calls HTTP on 127.0.0.1 only")


@pytest.fixture(autouse=True)
def no_network(request, monkeypatch):
    loopback = any(request.node.get_closest_marker(m) is not None for m in ("loopback", "e2e"))
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex

    def check(address) -> None:
        if not (loopback and isinstance(address, tuple) and address[0] in ("127.0.0.1", "::1", "localhost")):
            raise RuntimeError(f"rollout unit tests must not open network connections (tried {address!r})")

    def connect(self, address, *args, **kwargs):
        check(address)
        return real_connect(self, address, *args, **kwargs)

    def connect_ex(self, address, *args, **kwargs):
        check(address)
        return real_connect_ex(self, address, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket.socket, "connect_ex", connect_ex)
