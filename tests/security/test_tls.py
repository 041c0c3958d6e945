"""Mutual TLS with real grpc.aio servers, and HTTPS through a real uvicorn server.

The server is the standard ``grpc.health.v1`` service behind
:func:`server_credentials`; every refused client must fail in the handshake,
before any RPC reaches the servicer.
"""

from __future__ import annotations

import asyncio
import ssl
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from aiworks.core.errors import InvalidArgument
from aiworks.core.rpc import add_port, client_channel, create_server, set_serving, tls_options
from aiworks.security.tls import (
    TLSFiles,
    certificate_names,
    channel_credentials,
    client_ssl_context,
    http_ssl_context,
    peer_identity,
    secure_channel,
    server_credentials,
    tls_files,
    uvicorn_ssl_options,
)

HEALTH = "/grpc.health.v1.Health/Check"


class _PeerRecorder(health.aio.HealthServicer):
    """The health servicer, remembering who called (the client certificate's common name)."""

    def __init__(self):
        super().__init__()
        self.peers: list[str | None] = []

    async def Check(self, request, context):
        self.peers.append(peer_identity(context))
        return await super().Check(request, context)


@pytest.fixture
async def mtls_server(pki):
    server = grpc.aio.server()
    servicer = _PeerRecorder()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    await servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    port = server.add_secure_port("localhost:0", server_credentials(TLSFiles.from_dir(pki / "scheduler")))
    await server.start()
    yield f"localhost:{port}", servicer
    await server.stop(grace=None)


async def _check(channel: grpc.aio.Channel) -> int:
    async with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def test_client_with_a_ca_signed_certificate_is_served(mtls_server, pki):
    address, servicer = mtls_server
    status = await _check(secure_channel(address, TLSFiles.from_dir(pki / "gateway")))
    assert status == health_pb2.HealthCheckResponse.SERVING
    assert servicer.peers == ["gateway"]


async def test_client_reaching_the_server_by_ip_uses_the_certificate_name(pki):
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials(TLSFiles.from_dir(pki / "scheduler")))
    await server.start()
    try:
        channel = secure_channel(f"127.0.0.1:{port}", TLSFiles.from_dir(pki / "gateway"), server_name="scheduler")
        assert await _check(channel) == health_pb2.HealthCheckResponse.SERVING
    finally:
        await server.stop(grace=None)


async def _refused(channel: grpc.aio.Channel) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _check(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    return info.value


async def test_plaintext_client_is_refused(mtls_server):
    address, servicer = mtls_server
    await _refused(grpc.aio.insecure_channel(address))
    assert servicer.peers == []


async def test_client_without_a_certificate_is_refused(mtls_server, pki):
    address, servicer = mtls_server
    creds = grpc.ssl_channel_credentials(root_certificates=(pki / "ca.crt").read_bytes())
    await _refused(grpc.aio.secure_channel(address, creds))
    assert servicer.peers == []


async def test_client_with_a_certificate_from_another_ca_is_refused(mtls_server, pki, other_pki):
    address, servicer = mtls_server
    # Trusts the right CA for the server, but presents a certificate the server's CA never signed.
    foreign = grpc.ssl_channel_credentials(
        root_certificates=(pki / "ca.crt").read_bytes(),
        private_key=(other_pki / "gateway" / "tls.key").read_bytes(),
        certificate_chain=(other_pki / "gateway" / "tls.crt").read_bytes(),
    )
    await _refused(grpc.aio.secure_channel(address, foreign))
    assert servicer.peers == []


async def test_client_refuses_a_server_from_another_ca(mtls_server, other_pki):
    address, servicer = mtls_server
    await _refused(grpc.aio.secure_channel(address, channel_credentials(TLSFiles.from_dir(other_pki / "gateway"))))
    assert servicer.peers == []


def test_tls_files_from_settings():
    assert tls_files(None, None, None, env_prefix="AIWORKS_SCHEDULER_") is None
    files = tls_files("/c.crt", "/c.key", "/ca.crt", env_prefix="AIWORKS_SCHEDULER_")
    assert files == TLSFiles(cert=files.cert, key=files.key, ca=files.ca)
    with pytest.raises(InvalidArgument, match="AIWORKS_SCHEDULER_TLS_KEY"):
        tls_files("/c.crt", None, "/ca.crt", env_prefix="AIWORKS_SCHEDULER_")


def test_missing_and_mismatched_files_are_named(tmp_path, pki, other_pki):
    with pytest.raises(InvalidArgument, match=r"certificate file .*nope.crt does not exist"):
        server_credentials(TLSFiles(tmp_path / "nope.crt", pki / "tls.key", pki / "ca.crt"))
    with pytest.raises(InvalidArgument, match="does not match certificate"):
        http_ssl_context(TLSFiles(pki / "tls.crt", other_pki / "tls.key", pki / "ca.crt"))
    assert set(certificate_names(pki / "gateway" / "tls.crt")) == {"localhost", "127.0.0.1", "gateway"}


# ---- HTTPS through uvicorn ---------------------------------------------------------------------


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


@pytest.fixture
async def https_server(pki):
    import uvicorn

    from aiworks.supervisor.supervisor import free_port

    port = free_port()
    config = uvicorn.Config(
        _app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
        **uvicorn_ssl_options(TLSFiles.from_dir(pki), require_client_cert=True),
    )  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    for _ in range(200):
        if server.started:
            break
        await asyncio.sleep(0.02)
    assert server.started
    yield port
    server.should_exit = True
    await task


def _get(port: int, ctx: ssl.SSLContext) -> bytes:
    with urllib.request.urlopen(f"https://localhost:{port}/", context=ctx, timeout=5) as reply:
        return reply.read()


async def test_uvicorn_serves_https_to_a_client_with_a_certificate(https_server, pki):
    ctx = client_ssl_context(TLSFiles.from_dir(pki / "gateway"))
    assert await asyncio.to_thread(_get, https_server, ctx) == b"hello"


async def test_uvicorn_refuses_a_client_without_a_certificate(https_server, pki):
    ctx = client_ssl_context(ca=pki / "ca.crt")
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        await asyncio.to_thread(_get, https_server, ctx)


async def test_https_client_refuses_a_server_from_another_ca(https_server, other_pki):
    ctx = client_ssl_context(TLSFiles.from_dir(other_pki / "gateway"))
    with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
        await asyncio.to_thread(_get, https_server, ctx)


# ---- the suite's one place for ports and channels (aiworks.core.rpc) and the services' settings ---------


async def test_rpc_port_and_channel_speak_mutual_tls_by_service_name(pki):
    server, health_servicer = create_server(1 << 20)
    port = add_port(server, "127.0.0.1:0", TLSFiles.from_dir(pki / "scheduler"))
    await server.start()
    await set_serving(health_servicer, True)
    try:
        # Dialled by IP: verified against the service's name, which the certificate carries.
        channel = client_channel(
            f"127.0.0.1:{port}", 1 << 20, TLSFiles.from_dir(pki / "gateway"), server_name="scheduler"
        )
        assert await _check(channel) == health_pb2.HealthCheckResponse.SERVING
        await _refused(client_channel(f"127.0.0.1:{port}", 1 << 20))  # plaintext
        # The name override names the peer: a certificate issued to another service does not pass as this one.
        wrong = client_channel(f"127.0.0.1:{port}", 1 << 20, TLSFiles.from_dir(pki / "gateway"), server_name="cache")
        await _refused(wrong)
    finally:
        await server.stop(grace=None)


async def test_a_replica_dialled_by_a_name_of_its_own_verifies_as_its_service(pki):
    # runtime-1:8020 under compose, a pod IP on Kubernetes: the certificate names the service, not the replica.
    server, health_servicer = create_server(1 << 20)
    port = add_port(server, "localhost:0", TLSFiles.from_dir(pki / "scheduler"))
    await server.start()
    await set_serving(health_servicer, True)
    try:
        gateway = TLSFiles.from_dir(pki / "gateway")
        assert tls_options(f"localhost:{port}", "scheduler") == [("grpc.ssl_target_name_override", "scheduler")]
        channel = client_channel(f"localhost:{port}", 1 << 20, gateway, server_name="scheduler")
        assert await _check(channel) == health_pb2.HealthCheckResponse.SERVING
        assert (
            await _check(client_channel(f"localhost:{port}", 1 << 20, gateway))
            == health_pb2.HealthCheckResponse.SERVING
        )
    finally:
        await server.stop(grace=None)


def test_service_settings_name_the_missing_tls_variable(monkeypatch, pki):
    from pydantic import ValidationError

    from aiworks.scheduler.settings import SchedulerSettings

    for key in ("CERT", "KEY", "CA"):
        monkeypatch.delenv(f"AIWORKS_SCHEDULER_TLS_{key}", raising=False)
    assert SchedulerSettings().tls_files() is None
    with pytest.raises(ValidationError, match="AIWORKS_SCHEDULER_TLS_KEY"):
        SchedulerSettings(tls_cert=pki / "scheduler" / "tls.crt")
    no_ca = SchedulerSettings(tls_cert=pki / "scheduler" / "tls.crt", tls_key=pki / "scheduler" / "tls.key")
    with pytest.raises(InvalidArgument, match="AIWORKS_SCHEDULER_TLS_CA"):
        no_ca.tls_files()
    assert no_ca.tls_files(mutual=False).ca is None  # the gateway's public ports: TLS without client certificates
    monkeypatch.setenv("AIWORKS_SCHEDULER_TLS_CERT", str(pki / "scheduler" / "tls.crt"))
    monkeypatch.setenv("AIWORKS_SCHEDULER_TLS_KEY", str(pki / "scheduler" / "tls.key"))
    monkeypatch.setenv("AIWORKS_SCHEDULER_TLS_CA", str(pki / "scheduler" / "ca.crt"))
    assert SchedulerSettings().tls_files() == TLSFiles.from_dir(pki / "scheduler")


def test_tools_find_their_certificate_folder(tmp_path, pki):
    from aiworks.security.tls import tool_tls

    assert tool_tls(environ={}) is None
    assert tool_tls(environ={"AIWORKS_TLS_DIR": str(pki / "gateway")}) == TLSFiles.from_dir(pki / "gateway")
    with pytest.raises(InvalidArgument, match="has no tls.crt, tls.key, ca.crt"):
        tool_tls(tmp_path)
