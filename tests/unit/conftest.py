"""Unit tests run without a network: any attempt to connect fails loudly."""

from __future__ import annotations

import socket

import pytest


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    def refuse(self, address, *args, **kwargs):
        raise RuntimeError(f"unit tests must not open network connections (tried {address!r})")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
