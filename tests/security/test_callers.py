"""Who may call the internal services: tokens, the mesh's identities, mutual TLS, and the one interceptor.

The gRPC checks run against real grpc.aio servers on 127.0.0.1 serving the
scheduler's real method table (:data:`aiworks.scheduler.servicer.CALLERS_BY_METHOD`)
through :func:`aiworks.core.rpc.create_server`; the clients are the suite's own
channels (:func:`aiworks.core.rpc.client_channel`), so the metadata travels as
the services send it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiworks.core.errors import InvalidArgument, PermissionDenied, Unauthenticated
from aiworks.core.logging import redact_url
from aiworks.core.rpc import add_port, client_channel, create_server, set_serving
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
from aiworks.pb.scheduler.v1 import scheduler_pb2_grpc
from aiworks.scheduler.servicer import CALLERS_BY_METHOD
from aiworks.scheduler.settings import SchedulerSettings
from aiworks.security.callers import (
    CALLER_HEADER,
    TOKEN_HEADER,
    XFCC_HEADER,
    CallerAuth,
    CallerCheck,
    ClientCaller,
    caller_token,
    ensure_secret_file,
    is_loopback,
    mesh_caller,
    method_table,
    read_secrets,
    server_auth,
)
from aiworks.security.certs import write_certificates
from aiworks.security.mesh_identity import parse_xfcc
from aiworks.security.tls import TLSFiles

SECRET = b"0123456789abcdef0123456789abcdef"
SERVICE = pb.DESCRIPTOR.services_by_name["SchedulerService"]
SPIFFE = "spiffe://cluster.local/ns/aiworks/sa/"


class Scheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    """Answers what the checks let through, and counts the messages of its one stream."""

    def __init__(self):
        self.stream_messages = 0

    async def Status(self, request, context):
        return pb.StatusResponse(caller_auth="ok")

    async def SetTrafficPolicy(self, request, context):
        return request.policy

    async def RegisterReplica(self, request, context):
        return pb.RegisterReplicaResponse()

    async def WatchRouting(self, request_iterator, context):
        async for _report in request_iterator:
            self.stream_messages += 1
            await context.write(pb.RoutingTable(generation=self.stream_messages))


async def serve(auth: CallerAuth, tls: TLSFiles | None = None):
    server, health = create_server(1 << 20, CallerCheck(auth, method_table(SERVICE, CALLERS_BY_METHOD)))
    servicer = Scheduler()
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    port = add_port(server, "127.0.0.1:0", tls)
    await server.start()
    await set_serving(health, True)
    return server, f"127.0.0.1:{port}", servicer


async def code_of(call) -> grpc.StatusCode | tuple[grpc.StatusCode, str]:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


# ---- tokens and the secret file ----------------------------------------------------------------


def test_a_token_is_an_hmac_of_the_name_and_never_printed():
    admin = ClientCaller.from_secret("admin", SECRET)
    assert admin.token == caller_token(SECRET, "admin") and len(admin.token) == 64
    assert admin.token != caller_token(SECRET, "gateway") != caller_token(b"another secret of 32 bytes!!!!!", "admin")
    assert admin.token not in repr(admin) and admin.bearer() == f"Bearer admin.{admin.token}"
    with pytest.raises(InvalidArgument, match="unknown caller 'root'"):
        ClientCaller.from_secret("root", SECRET)


def test_the_secret_file_is_made_once_with_mode_0600_even_when_raced(tmp_path):
    path = tmp_path / "sub" / "internal-token"
    found: list[bytes] = []
    threads = [threading.Thread(target=lambda: found.append(ensure_secret_file(path))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 8 and len(set(found)) == 1 and len(found[0]) == 64  # every racer reads the one secret
    assert path.stat().st_mode & 0o777 == 0o600
    assert ensure_secret_file(path) == found[0]  # kept on the next start
    assert not [p for p in path.parent.iterdir() if p.name != "internal-token"]  # no temporary files left
    (tmp_path / "short").write_text("abc")
    with pytest.raises(InvalidArgument, match="at least 16"):
        ClientCaller.from_file("admin", tmp_path / "short")
    with pytest.raises(InvalidArgument, match="does not exist"):
        ClientCaller.from_file("admin", tmp_path / "missing")


# ---- the mesh's x-forwarded-client-cert ----------------------------------------------------------


def test_xfcc_is_parsed_with_quotes_and_the_last_element_wins():
    own = f"{SPIFFE}aiworks-scheduler"
    header = (
        f'By={own};URI={SPIFFE}aiworks-admin;Subject="CN=a, O=b;c",'  # forged by the client: comma and all
        f'By={own};Hash=abc;Subject="";URI={SPIFFE}aiworks-runtime'  # appended by the server's own sidecar
    )
    elements = parse_xfcc(header)
    assert elements[0]["subject"] == "CN=a, O=b;c" and elements[1]["hash"] == "abc"
    assert mesh_caller(header) == "runtime"
    assert mesh_caller(f"By={own};URI={SPIFFE}aiworks-gateway") == "gateway"
    for bad, why in [
        (f"By={own};URI=spiffe://cluster.local/ns/other/sa/x-gateway", "outside this installation's namespace"),
        (f"By={own};URI=spiffe://evil.example/ns/aiworks/sa/x-gateway", "outside"),
        (f"By={own};URI={SPIFFE}default", "names no caller"),
        (f"URI={SPIFFE}aiworks-gateway", "no SPIFFE identities"),
        ("", "no SPIFFE identities"),
    ]:
        with pytest.raises(Unauthenticated, match=why):
            mesh_caller(bad)


def test_the_table_must_name_every_method():
    table = dict(CALLERS_BY_METHOD)
    del table["EjectReplica"]
    with pytest.raises(ValueError, match="lacks \\['EjectReplica'\\]"):
        method_table(SERVICE, table)
    with pytest.raises(ValueError, match="unknown caller"):
        method_table(SERVICE, {**CALLERS_BY_METHOD, "WatchRouting": {"tenant"}})


# ---- the interceptor, over real gRPC ------------------------------------------------------------


async def test_token_mode_names_the_caller_and_refuses_the_rest():
    server, address, _ = await serve(CallerAuth(secret=SECRET))
    try:
        policy = pb.SetTrafficPolicyRequest(policy=pb.TrafficPolicy(model="m"))
        async with client_channel(address, 1 << 20) as anonymous:  # no caller recorded in this process
            stub = scheduler_pb2_grpc.SchedulerServiceStub(anonymous)
            code, details = await code_of(stub.Status(pb.StatusRequest(), timeout=5))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "no caller credentials" in details
            health = await health_pb2_grpc.HealthStub(anonymous).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes stay open
            forged = ((CALLER_HEADER, "monitor"), (TOKEN_HEADER, "f" * 64))
            code, details = await code_of(stub.SetTrafficPolicy(policy, metadata=forged, timeout=5))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "'monitor' does not verify" in details
            assert "f" * 64 not in details
            stranger = ((CALLER_HEADER, "tenant"), (TOKEN_HEADER, "x"))
            code, details = await code_of(stub.Status(pb.StatusRequest(), metadata=stranger, timeout=5))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "none of gateway" in details and "tenant" not in details
        runtime = ClientCaller.from_secret("runtime", SECRET)
        async with client_channel(address, 1 << 20, caller=runtime) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            code, details = await code_of(stub.SetTrafficPolicy(policy, timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            assert "caller 'runtime' may not call /aiworks.scheduler.v1.SchedulerService/SetTrafficPolicy" in details
            assert "admin or monitor" in details and runtime.token not in details
            assert (await stub.Status(pb.StatusRequest(), timeout=5)).caller_auth == "ok"
            await stub.RegisterReplica(pb.ReplicaInfo(replica_id="r"), timeout=5)
        async with client_channel(address, 1 << 20, caller=ClientCaller.from_secret("monitor", SECRET)) as channel:
            reply = await scheduler_pb2_grpc.SchedulerServiceStub(channel).SetTrafficPolicy(policy, timeout=5)
            assert reply.model == "m"
    finally:
        await server.stop(None)


async def test_a_stream_is_checked_once_and_its_messages_flow():
    server, address, servicer = await serve(CallerAuth(secret=SECRET))
    try:
        async with client_channel(address, 1 << 20, caller=ClientCaller.from_secret("gateway", SECRET)) as channel:
            call = scheduler_pb2_grpc.SchedulerServiceStub(channel).WatchRouting(timeout=10)
            for i in range(50):
                await call.write(pb.RoutingReport(gateway_id=str(i)))
                assert (await call.read()).generation == i + 1
            await call.done_writing()
        assert servicer.stream_messages == 50
        async with client_channel(address, 1 << 20, caller=ClientCaller.from_secret("admin", SECRET)) as channel:
            call = scheduler_pb2_grpc.SchedulerServiceStub(channel).WatchRouting(timeout=10)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call.read()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED  # only gateways route by the table
    finally:
        await server.stop(None)


async def test_mesh_mode_reads_the_sidecars_header():
    server, address, _ = await serve(CallerAuth(mesh=True))
    own = f"By={SPIFFE}aiworks-scheduler;Hash=0;Subject=\"\";URI={SPIFFE}"
    policy = pb.SetTrafficPolicyRequest(policy=pb.TrafficPolicy(model="m"))
    try:
        async with client_channel(address, 1 << 20) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            as_monitor = ((XFCC_HEADER, own + "aiworks-monitor"),)
            assert (await stub.SetTrafficPolicy(policy, metadata=as_monitor, timeout=5)).model == "m"
            as_runtime = ((XFCC_HEADER, own + "aiworks-runtime"),)
            code, _ = await code_of(stub.SetTrafficPolicy(policy, metadata=as_runtime, timeout=5))
            assert code == grpc.StatusCode.PERMISSION_DENIED
            code, _ = await code_of(stub.Status(pb.StatusRequest(), timeout=5))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            token = ClientCaller.from_secret("monitor", SECRET).metadata()  # no token file here: not accepted
            code, details = await code_of(stub.SetTrafficPolicy(policy, metadata=token, timeout=5))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "not accepted" in details
    finally:
        await server.stop(None)


async def test_mutual_tls_takes_the_certificates_name(tmp_path):
    write_certificates(tmp_path, ["localhost", "127.0.0.1"], ["scheduler", "runtime", "monitor"])
    server, address, _ = await serve(CallerAuth(mtls=True), TLSFiles.from_dir(tmp_path / "scheduler"))
    policy = pb.SetTrafficPolicyRequest(policy=pb.TrafficPolicy(model="m"))
    try:
        for name, want in (("runtime", grpc.StatusCode.PERMISSION_DENIED), ("monitor", grpc.StatusCode.OK)):
            files = TLSFiles.from_dir(tmp_path / name)
            async with client_channel(address, 1 << 20, files, server_name="scheduler") as channel:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                # A token naming another caller changes nothing: the certificate says who calls.
                monitor_token = ClientCaller.from_secret("monitor", SECRET).metadata()
                code, details = await code_of(stub.SetTrafficPolicy(policy, metadata=monitor_token, timeout=5))
                assert code == want, details
    finally:
        await server.stop(None)


async def test_insecure_lets_everyone_through():
    server, address, _ = await serve(CallerAuth(insecure=True))
    try:
        async with client_channel(address, 1 << 20) as channel:
            policy = pb.SetTrafficPolicyRequest(policy=pb.TrafficPolicy(model="m"))
            assert (await scheduler_pb2_grpc.SchedulerServiceStub(channel).SetTrafficPolicy(policy, timeout=5)).model
    finally:
        await server.stop(None)


async def test_refusals_are_logged_once_per_interval(caplog):
    server, address, _ = await serve(CallerAuth(secret=SECRET))
    try:
        with caplog.at_level(logging.WARNING, logger="aiworks.security.callers"):
            async with client_channel(address, 1 << 20) as channel:
                stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
                await asyncio.gather(*(code_of(stub.Status(pb.StatusRequest(), timeout=5)) for _ in range(20)))
        assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    finally:
        await server.stop(None)


# ---- start-up: where a service may bind, with what ---------------------------------------------


def test_beyond_loopback_only_mutual_tls_the_mesh_or_insecure(tmp_path, caplog, monkeypatch):
    for name in [k for k in os.environ if k.startswith("AIWORKS_SCHEDULER_")]:
        monkeypatch.delenv(name)
    token = tmp_path / "internal-token"
    ensure_secret_file(token)
    assert server_auth(SchedulerSettings(internal_token_file=token), "scheduler", "127.0.0.1").describe == "token"
    with pytest.raises(SystemExit) as refused:
        server_auth(SchedulerSettings(internal_token_file=token), "scheduler", "0.0.0.0")
    message = str(refused.value)
    assert "refusing to serve plaintext on 0.0.0.0" in message
    for setting in ("AIWORKS_SCHEDULER_TLS_CERT", "AIWORKS_SCHEDULER_MESH_MTLS", "AIWORKS_SCHEDULER_INSECURE"):
        assert setting in message
    with pytest.raises(SystemExit, match="no way to tell its callers apart.*INTERNAL_TOKEN_FILE"):
        server_auth(SchedulerSettings(), "scheduler", "127.0.0.1")
    assert server_auth(SchedulerSettings(mesh_mtls=True), "scheduler", "0.0.0.0").mesh
    with caplog.at_level(logging.WARNING, logger="aiworks.security.callers"):
        assert server_auth(SchedulerSettings(insecure=True), "scheduler", "0.0.0.0").insecure
    assert "INSECURE" in caplog.text and "0.0.0.0" in caplog.text
    with pytest.raises(SystemExit, match="does not exist"):
        server_auth(SchedulerSettings(internal_token_file=tmp_path / "nope"), "scheduler", "127.0.0.1")


def test_loopback_is_recognised():
    assert all(map(is_loopback, ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "::", "", "10.0.0.1", "scheduler", "localhost.example"]))


def test_identify_bearer_for_the_http_apis():
    auth = CallerAuth(secret=SECRET)
    monitor = ClientCaller.from_secret("monitor", SECRET)
    assert auth.identify_bearer(monitor.bearer()) == "monitor"
    for header, why in [
        (None, "credentials required"),
        (f"Basic {monitor.token}", "only 'Authorization: Bearer"),
        ("Bearer monitor", "does not verify"),
        (f"Bearer admin.{monitor.token}", "'admin' does not verify"),
        (f"Bearer {monitor.token}", "the caller named is none of"),  # a bare secret is not echoed either
    ]:
        with pytest.raises(Unauthenticated, match=why) as err:
            auth.identify_bearer(header)
        assert monitor.token not in err.value.message
    with pytest.raises(PermissionDenied):
        from aiworks.security.callers import check_allowed

        check_allowed("runtime", frozenset({"admin"}), "POST /v1/stop")


def test_urls_lose_their_credentials_in_logs():
    assert redact_url("redis://:s3cret@redis:6379/0") == "redis://***@redis:6379/0"
    assert redact_url("rediss://user:p@ss@host/1") == "rediss://***@host/1"
    assert redact_url("cache at redis://u:pw@h and http://x/y@z") == "cache at redis://***@h and http://x/y@z"
    assert redact_url("redis://127.0.0.1:6379") == "redis://127.0.0.1:6379" and redact_url(None) == ""


# ---- rotating the internal token ---------------------------------------------------------------


async def test_the_token_file_rotates_in_place_for_servers_and_clients(tmp_path, caplog):
    """The three rotation steps against a real server and channel, nothing rebuilt: after stage the server
    accepts both secrets' tokens while the client still presents the old; after promote the client's open
    channel presents the new one at its next call; after retire the old token is refused. The gauge follows,
    and no secret reaches the log."""
    from aiworks.core.metrics import INTERNAL_TOKEN_KEYS
    from aiworks.security.keyring import INTERNAL_TOKEN_FILE, KeyFileWatch, rotate_file

    path = tmp_path / "internal-token"
    ensure_secret_file(path)
    auth, caller = CallerAuth(secret=read_secrets(path)), ClientCaller.from_file("runtime", path)
    old_token = caller.token
    watch = KeyFileWatch(path, [auth, caller], INTERNAL_TOKEN_FILE)
    server, address, _ = await serve(auth)

    def held() -> dict[str, str]:
        return {s.labels["key_id"]: s.labels["role"] for m in INTERNAL_TOKEN_KEYS.collect() for s in m.samples}

    try:
        async with client_channel(address, 1 << 20, caller=caller) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            old_only = ((CALLER_HEADER, "runtime"), (TOKEN_HEADER, old_token))
            assert (await stub.Status(pb.StatusRequest(), timeout=5)).caller_auth == "ok"
            with caplog.at_level(logging.INFO, logger="aiworks.security.keyring"):
                staged = rotate_file(path, "stage", INTERNAL_TOKEN_FILE)
                assert watch.check() and caller.token == old_token  # the client still presents the old one
                assert held() == {auth.key_ids[0]: "current", auth.key_ids[1]: "previous"}
                new_token = caller_token(staged[1], "runtime")
                assert (await stub.Status(pb.StatusRequest(), timeout=5)).caller_auth == "ok"
                fresh = ((CALLER_HEADER, "runtime"), (TOKEN_HEADER, new_token))
                async with client_channel(address, 1 << 20) as bare:  # the staged secret's token is accepted
                    bare_stub = scheduler_pb2_grpc.SchedulerServiceStub(bare)
                    assert (await bare_stub.Status(pb.StatusRequest(), metadata=fresh, timeout=5)).caller_auth == "ok"
                    rotate_file(path, "promote", INTERNAL_TOKEN_FILE)
                    assert watch.check() and caller.token == new_token
                    assert (await stub.Status(pb.StatusRequest(), timeout=5)).caller_auth == "ok"  # the same channel
                    assert caller.bearer() == f"Bearer runtime.{new_token}"
                    rotate_file(path, "retire", INTERNAL_TOKEN_FILE)
                    assert watch.check() and len(auth.key_ids) == 1
                    code, details = await code_of(bare_stub.Status(pb.StatusRequest(), metadata=old_only, timeout=5))
                    assert code == grpc.StatusCode.UNAUTHENTICATED and "does not verify" in details
                    assert (await stub.Status(pb.StatusRequest(), timeout=5)).caller_auth == "ok"
            assert held() == {auth.key_ids[0]: "current"}
            assert "internal token file" in caplog.text and "changed" in caplog.text
            for secret in staged:
                assert secret.decode() not in caplog.text
            assert old_token not in caplog.text and new_token not in caplog.text
    finally:
        await server.stop(None)


async def test_a_token_of_a_secret_not_read_yet_makes_the_server_read_the_file(tmp_path):
    """`at-once` on one machine: a client that read the rotated file before the server presents a token the
    server does not hold yet; the server reads the file at once (at most once a second) and accepts it. A token
    of no secret in the file is still refused."""
    from aiworks.security.keyring import INTERNAL_TOKEN_FILE, KeyFileWatch, rotate_file

    path = tmp_path / "internal-token"
    ensure_secret_file(path)
    auth = CallerAuth(secret=read_secrets(path))
    KeyFileWatch(path, [auth], INTERNAL_TOKEN_FILE)  # periodic reads off: only the refresh reads it
    ring = rotate_file(path, "at-once", INTERNAL_TOKEN_FILE)
    assert auth.identify([(CALLER_HEADER, "gateway"), (TOKEN_HEADER, caller_token(ring[0], "gateway"))], None) == "gateway"
    assert len(auth.key_ids) == 2
    with pytest.raises(Unauthenticated, match="does not verify"):
        auth.identify([(CALLER_HEADER, "gateway"), (TOKEN_HEADER, caller_token(b"x" * 32, "gateway"))], None)


def test_the_certs_command_rotates_the_internal_token_file(tmp_path):
    import stat
    import subprocess
    import sys

    path = tmp_path / "internal-token"
    ensure_secret_file(path)
    first = read_secrets(path)

    def certs(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "aiworks", "certs", *args], capture_output=True, text=True,
                              timeout=60)  # fmt: skip

    staged = certs("--internal-token", str(path), "--rotate-internal-token", "stage")
    assert staged.returncode == 0, staged.stderr
    assert "stage: 2 secrets" in staged.stdout and "--rotate-internal-token promote" in staged.stdout
    assert read_secrets(path)[0] == first[0] and len(read_secrets(path)) == 2
    assert certs("--internal-token", str(path), "--rotate-internal-token", "promote").returncode == 0
    promoted = read_secrets(path)
    assert promoted[1] == first[0]
    retired = certs("--internal-token", str(path), "--rotate-internal-token", "retire")
    assert retired.returncode == 0 and read_secrets(path) == promoted[:1]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for secret in promoted:
        assert secret.decode() not in staged.stdout + retired.stdout
    refused = certs("--rotate-internal-token", "stage")
    assert refused.returncode != 0 and "--rotate-internal-token needs --internal-token FILE" in refused.stderr
