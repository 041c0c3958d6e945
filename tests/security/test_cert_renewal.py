"""A renewed certificate is taken without a restart (aiworks.security.cert_watch), on real servers and channels.

Each test issues its own CA and certificates, then issues the leaves again
from the same CA, as ``aiworks certs`` run a second time (or cert-manager's
renewal) does, and checks what a client sees over real handshakes: the
server's certificate serial, the client certificate the server was shown,
and that calls and streams opened before the renewal go on.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from aiworks.core.rpc import add_port, client_channel
from aiworks.security.cert_watch import CertificateWatch
from aiworks.security.certs import write_certificates
from aiworks.security.tls import TLSFiles, client_ssl_context, uvicorn_ssl_options

HOSTS = ["localhost", "127.0.0.1"]
RELOAD_S = 0.2
TLS_EXPIRY = "aiworks_tls_certificate_expiry_timestamp_seconds"


def files(folder: Path, reload_s: float = RELOAD_S) -> TLSFiles:
    return TLSFiles(folder / "tls.crt", folder / "tls.key", folder / "ca.crt", reload_s)


def serial_of(pem_or_path: bytes | Path) -> int:
    data = pem_or_path.read_bytes() if isinstance(pem_or_path, Path) else pem_or_path
    return x509.load_pem_x509_certificate(data).serial_number


def served_serial(port: int, client: TLSFiles, alpn: str) -> int:
    """The serial of the certificate a server presents to a new connection (a real TLS handshake)."""
    ctx = client_ssl_context(client)
    ctx.check_hostname = False
    ctx.set_alpn_protocols([alpn])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
        return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


async def eventually(probe, want, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        got = await asyncio.to_thread(probe)
        if got == want or time.monotonic() > deadline:
            return got
        await asyncio.sleep(0.05)


class _ClientCertRecorder(health.aio.HealthServicer):
    """The health servicer, remembering the serial of each caller's client certificate."""

    def __init__(self):
        super().__init__()
        self.client_serials: list[int] = []

    async def Check(self, request, context):
        self.client_serials.append(serial_of(context.auth_context()["x509_pem_cert"][0]))
        return await super().Check(request, context)


@pytest.fixture
def pki(tmp_path) -> Path:
    write_certificates(tmp_path, HOSTS, ("gateway", "scheduler"))
    return tmp_path


async def test_grpc_server_and_channel_take_renewed_certificates_and_open_streams_go_on(pki):
    server = grpc.aio.server()
    servicer = _ClientCertRecorder()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = add_port(server, "127.0.0.1:0", files(pki / "scheduler"))
    await server.start()
    gateway = files(pki / "gateway")
    channel = client_channel(f"127.0.0.1:{port}", 1 << 20, gateway, server_name="scheduler")
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        assert (await stub.Check(health_pb2.HealthCheckRequest())).status == health_pb2.HealthCheckResponse.SERVING
        watch = stub.Watch(health_pb2.HealthCheckRequest())  # a stream opened before the renewal
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.SERVING
        old_server, old_client = serial_of(pki / "scheduler" / "tls.crt"), serial_of(pki / "gateway" / "tls.crt")
        assert await asyncio.to_thread(served_serial, port, gateway, "h2") == old_server
        assert servicer.client_serials == [old_client]

        write_certificates(pki, HOSTS, ("gateway", "scheduler"))  # the same CA issues both leaves again
        new_server, new_client = serial_of(pki / "scheduler" / "tls.crt"), serial_of(pki / "gateway" / "tls.crt")
        assert new_server != old_server and new_client != old_client

        # New connections to the server get the new certificate, with no restart.
        assert await eventually(lambda: served_serial(port, gateway, "h2"), new_server) == new_server
        # The channel's next call dials with the client's new certificate.
        deadline = time.monotonic() + 10
        while servicer.client_serials[-1] != new_client and time.monotonic() < deadline:
            await stub.Check(health_pb2.HealthCheckRequest())
            await asyncio.sleep(0.05)
        assert servicer.client_serials[-1] == new_client
        # The stream opened on the old connection still delivers.
        await servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        assert (await watch.read()).status == health_pb2.HealthCheckResponse.NOT_SERVING
        expiry = x509.load_pem_x509_certificate((pki / "gateway" / "tls.crt").read_bytes()).not_valid_after_utc
        assert REGISTRY.get_sample_value(TLS_EXPIRY, {"common_name": "gateway"}) == expiry.timestamp()
        watch.cancel()
    finally:
        await channel.close()
        await server.stop(grace=None)


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


async def test_https_server_takes_a_renewed_certificate_at_the_next_handshake(pki):
    import uvicorn

    from aiworks.supervisor.supervisor import free_port

    port = free_port()
    config = uvicorn.Config(_app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
                            **uvicorn_ssl_options(files(pki), require_client_cert=True))  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    try:
        for _ in range(200):
            if server.started:
                break
            await asyncio.sleep(0.02)
        gateway = files(pki / "gateway")
        old = serial_of(pki / "tls.crt")
        assert await asyncio.to_thread(served_serial, port, gateway, "http/1.1") == old
        write_certificates(pki, HOSTS, ("gateway",))
        new = serial_of(pki / "tls.crt")
        assert await eventually(lambda: served_serial(port, gateway, "http/1.1"), new) == new

        def get() -> bytes:
            with urllib.request.urlopen(f"https://localhost:{port}/", context=client_ssl_context(gateway),
                                        timeout=5) as reply:  # fmt: skip
                return reply.read()

        assert await asyncio.to_thread(get) == b"hello"  # verified against the CA, with a client certificate
    finally:
        server.should_exit = True
        await task


def test_a_half_written_set_is_skipped_until_it_is_whole(tmp_path, caplog):
    write_certificates(tmp_path, HOSTS, ("scheduler",))
    folder = tmp_path / "scheduler"
    watch = CertificateWatch(files(folder, reload_s=0))  # no thread: the test checks by hand
    first = watch.material.serial
    other = tmp_path / "next"
    write_certificates(other, HOSTS, ("scheduler",), ca_dir=tmp_path)
    (folder / "tls.key").write_bytes((other / "scheduler" / "tls.key").read_bytes())  # the key lands first
    with caplog.at_level(logging.ERROR):
        assert watch.check() is False
    assert "does not match certificate" in caplog.text and f"serial {first:x}" in caplog.text
    assert (watch.generation, watch.material.serial) == (0, first)
    (folder / "tls.crt").write_bytes((other / "scheduler" / "tls.crt").read_bytes())  # then its certificate
    assert watch.check() is True
    assert (watch.generation, watch.material.serial) == (1, serial_of(folder / "tls.crt"))
    assert watch.check() is False  # nothing changed since
    (folder / "tls.crt").write_bytes(b"not a certificate")
    assert watch.check() is False and watch.material.serial == serial_of(other / "scheduler" / "tls.crt")
