"""Issue 15, findings 2, 7 and 9, against the suite as real processes (token mode, ``aiworks up``'s default).

- No internal service answers a caller without credentials: a runtime's
  ``InferStream``, the scheduler's ``WatchRouting`` (which lists the replicas)
  and ``CacheService.Put`` are refused as UNAUTHENTICATED, while the suite
  keeps serving its clients through the gateway.
- A known caller gets only its own methods: a runtime may not change traffic or
  load models, a gateway may not register replicas (PERMISSION_DENIED).
- The supervisor's control API and the monitor's POST routes refuse what a web page
  can send (text/plain, no token), strangers (401) and absurd replica counts (400).
- A service bound beyond loopback without mutual TLS, the mesh or ``insecure`` does not start.
- A Redis password reaches no child's command line and no log file.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
from e2e_support import bearer, internal_channel, start_suite, tool_env

from aiworks.pb.cache.v1 import cache_pb2, cache_pb2_grpc
from aiworks.pb.runtime.v1 import runtime_pb2, runtime_pb2_grpc
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
from aiworks.pb.scheduler.v1 import scheduler_pb2_grpc
from aiworks.supervisor.supervisor import free_port

IRIS = np.array([[5.1, 3.5, 1.4, 0.2]], dtype=np.float32)


def infer_frame() -> runtime_pb2.InferRequestFrame:
    """One request as a gateway sends it to a runtime replica (its version resolved)."""
    tensor = runtime_pb2.Tensor(name="input", datatype="FP32", shape=[1, 4], raw=IRIS.tobytes())
    return runtime_pb2.InferRequestFrame(items=[runtime_pb2.InferRequest(stream_id=1, id="e2e", model="iris",
                                                                         version="1", inputs=[tensor])])  # fmt: skip


@pytest.fixture(scope="module")
def suite(model_repository, tmp_path_factory):
    """Scheduler, one runtime, cache, gateway and the monitor (which drives the control API)."""
    s = start_suite(model_repository, tmp_path_factory.mktemp("auth") / "logs", replicas=1, monitor=True)
    yield s
    s.supervisor.stop()


def runtime_address(suite) -> str:
    with internal_channel(suite.supervisor, suite.supervisor.scheduler_address, "scheduler") as ch:
        [replica] = scheduler_pb2_grpc.SchedulerServiceStub(ch).Status(pb.StatusRequest(), timeout=5).replicas
    return replica.address


def refused(call, *args) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=10)
    return info.value


def refused_stream(call, message) -> grpc.RpcError:
    """A bidirectional stream opened with one ``message``: the error it ends with."""
    with pytest.raises(grpc.RpcError) as info:
        for _ in call(iter([message]), timeout=10):
            pass
    return info.value


def serves(suite) -> bool:
    body = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": IRIS[0].tolist()}]}
    reply = requests.post(f"{suite.base}/v2/models/iris/infer", json=body, timeout=10)
    return reply.status_code == 200 and reply.json()["outputs"][0]["data"] == [0]


# ---- finding 2: strangers and wrong callers -----------------------------------------------------


def test_without_credentials_the_request_stream_the_routing_table_and_cache_put_are_refused(suite):
    sup = suite.supervisor
    with grpc.insecure_channel(runtime_address(suite)) as ch:
        err = refused_stream(runtime_pb2_grpc.RuntimeServiceStub(ch).InferStream, infer_frame())
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED and "no caller credentials" in err.details()
    with grpc.insecure_channel(sup.scheduler_address) as ch:
        err = refused_stream(scheduler_pb2_grpc.SchedulerServiceStub(ch).WatchRouting, pb.RoutingReport())
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    put = cache_pb2.PutRequest(model="iris", key=b"k" * 32, value=b"planted answer", epoch=0)
    with grpc.insecure_channel(sup.cache_address) as ch:
        err = refused(cache_pb2_grpc.CacheServiceStub(ch).Put, put)
    assert err.code() == grpc.StatusCode.UNAUTHENTICATED
    # The gateway's own identity is served (so the refusals were about credentials), and clients still are.
    with internal_channel(sup, runtime_address(suite), "runtime", caller="gateway") as ch:
        [frame] = list(runtime_pb2_grpc.RuntimeServiceStub(ch).InferStream(iter([infer_frame()]), timeout=10))
    [reply] = frame.items
    assert not reply.error_code and reply.outputs
    assert serves(suite)
    assert "refused /aiworks.runtime.v1.RuntimeService/InferStream" in (sup.config.log_dir / "runtime-0.log").read_text()


def test_known_callers_get_only_their_own_methods(suite):
    sup = suite.supervisor
    ref = pb.ModelRef(name="iris")
    policy = pb.SetTrafficPolicyRequest(policy=pb.TrafficPolicy(model="iris", weights={"1": 100}))
    scheduler = [
        ("runtime", "LoadModel", ref),
        ("runtime", "UnloadModel", ref),
        ("runtime", "SetTrafficPolicy", policy),
        ("gateway", "SetTrafficPolicy", policy),
        ("gateway", "RegisterReplica", pb.ReplicaInfo(replica_id="rogue", address="127.0.0.1:1")),
        ("gateway", "EjectReplica", pb.EjectReplicaRequest(replica_id="runtime-0")),
    ]
    for caller, method, request in scheduler:
        with internal_channel(sup, sup.scheduler_address, "scheduler", caller=caller) as ch:
            err = refused(getattr(scheduler_pb2_grpc.SchedulerServiceStub(ch), method), request)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (caller, method, err)
        assert f"caller '{caller}' may not call /aiworks.scheduler.v1.SchedulerService/{method}" in err.details()
    put = cache_pb2.PutRequest(model="iris", key=b"k" * 32, value=b"planted", epoch=0)
    for caller, method, request in [("admin", "Put", put), ("runtime", "Invalidate", cache_pb2.InvalidateRequest())]:
        with internal_channel(sup, sup.cache_address, "cache", caller=caller) as ch:
            err = refused(getattr(cache_pb2_grpc.CacheServiceStub(ch), method), request)
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, (caller, method)
    with internal_channel(sup, runtime_address(suite), "runtime", caller="gateway") as ch:
        err = refused(runtime_pb2_grpc.RuntimeServiceStub(ch).LoadModel, runtime_pb2.LoadModelRequest(name="iris"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    for caller in ("admin", "scheduler"):  # only gateways send requests to replicas
        with internal_channel(sup, runtime_address(suite), "runtime", caller=caller) as ch:
            err = refused_stream(runtime_pb2_grpc.RuntimeServiceStub(ch).InferStream, infer_frame())
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, caller
    with internal_channel(sup, sup.scheduler_address, "scheduler", caller="runtime") as ch:
        err = refused_stream(scheduler_pb2_grpc.SchedulerServiceStub(ch).WatchRouting, pb.RoutingReport())
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    # Nothing changed: still no weights, the replica still registered and serving.
    with internal_channel(sup, sup.scheduler_address, "scheduler") as ch:
        status = scheduler_pb2_grpc.SchedulerServiceStub(ch).Status(pb.StatusRequest(), timeout=5)
    assert not status.traffic and [r.replica_id for r in status.replicas] == ["runtime-0"]
    assert status.caller_auth == "token"
    assert serves(suite)


def test_the_tools_act_as_admin_with_the_token_file(suite, tmp_path):
    sup = suite.supervisor
    command = [sys.executable, "-m", "aiworks", "status", "--scheduler", sup.scheduler_address]
    ok = subprocess.run(command, env=tool_env(sup), capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert "callers checked by: token" in ok.stdout and "runtime-0" in ok.stdout
    stranger = {k: v for k, v in tool_env(sup).items() if k != "AIWORKS_INTERNAL_TOKEN_FILE"}
    out = subprocess.run(command, env=stranger, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert out.returncode != 0 and "no caller credentials" in out.stderr
    assert "AIWORKS_INTERNAL_TOKEN_FILE" in out.stderr  # the hint


def test_a_service_bound_beyond_loopback_without_mtls_does_not_start(suite):
    # The check runs before any port is bound: nothing listens on 0.0.0.0, even for a moment.
    for service, extra in (("scheduler", []), ("cache", [])):
        env = {**os.environ, **suite.supervisor.caller_env(service)}
        out = subprocess.run(
            [sys.executable, "-m", "aiworks", service, "--host", "0.0.0.0", "--port", str(free_port()), *extra],
            env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        prefix = f"AIWORKS_{service.upper()}_"
        assert out.returncode != 0, out.stderr
        assert "refusing to serve plaintext on 0.0.0.0" in out.stderr
        for setting in ("TLS_CERT", "MESH_MTLS", "INSECURE"):
            assert prefix + setting in out.stderr


# ---- finding 7: the control APIs ----------------------------------------------------------------


def post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err)


def test_a_cross_site_post_cannot_stop_the_suite(suite):
    sup = suite.supervisor
    # What any web page may send to 127.0.0.1 without a CORS preflight: a text/plain POST, no credentials.
    status, doc = post(f"{sup.control_url}/v1/stop", b"{}", {"Content-Type": "text/plain"})
    assert status == 401 and not sup.stop_requested
    status, doc = post(f"{sup.control_url}/v1/stop", b"{}", bearer(sup) | {"Content-Type": "text/plain"})
    assert status == 415 and not sup.stop_requested
    status, doc = post(f"{sup.control_url}/v1/runtime/scale", b'{"replicas": 2}', {"Content-Type": "application/json"})
    assert status == 401 and len(sup.runtimes()) == 1
    status, doc = post(f"{sup.control_url}/v1/runtime/scale", b'{"replicas": 100000}', bearer(sup))
    assert status == 400 and "0 to 64" in doc["error"] and len(sup.runtimes()) == 1
    status, doc = post(f"{sup.control_url}/v1/stop", b"", bearer(sup, "monitor"))
    assert status == 403 and not sup.stop_requested  # the monitor restarts and scales; only admins stop
    assert serves(suite)


def test_the_monitor_acts_through_the_control_api_with_its_token(suite):
    # Its discovery is GET /v1/services with the monitor's bearer token: the replica it reports came through it.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{suite.supervisor.monitor_url}/v1/replicas", timeout=5) as resp:
            replicas = json.load(resp)["replicas"]
        if [r["replica"] for r in replicas] == ["runtime-0"]:
            break
        time.sleep(0.2)
    assert [r["replica"] for r in replicas] == ["runtime-0"]
    monitor_log = (suite.supervisor.config.log_dir / "monitor.log").read_text()
    # A status 401, not the digits inside a free port's number (CI's log named 127.0.0.1:23401).
    assert not re.search(r"(?<![\d.:])401\b", monitor_log) and "Traceback" not in monitor_log


def test_the_monitors_rollout_api_needs_an_admin_token_and_json(suite):
    sup = suite.supervisor
    url = f"{sup.monitor_url}/v1/rollouts"
    body = b'{"model": "iris", "canary": "9"}'
    assert post(url, body, {"Content-Type": "text/plain"})[0] == 401
    assert post(url, body, {"Content-Type": "application/json"})[0] == 401
    assert post(url, body, bearer(sup, "monitor"))[0] == 403
    assert post(url, body, bearer(sup) | {"Content-Type": "text/plain"})[0] == 415
    status, doc = post(url, body, bearer(sup))  # reaches the controller: version 9 does not exist
    assert status == 412 and "not ready" in doc["error"]
    with socket.create_connection(("127.0.0.1", sup.config.monitor_port), timeout=5) as s:
        s.sendall(b"POST /v1/rollouts HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n")
        assert s.recv(64).split(b" ")[1] == b"400"  # aiohttp refuses it before any handler runs


# ---- finding 9: secrets stay out of ps and the logs ---------------------------------------------


def redis_answers(port: int, password: str) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(f"AUTH {password}\r\nPING\r\n".encode())
            data = b""
            while b"+PONG" not in data and (chunk := s.recv(64)):
                data += chunk
            return b"+PONG" in data
    except OSError:
        return False


@pytest.fixture
def redis_with_password(tmp_path):
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed; run scripts/ensure-debian-packages.sh")
    password, port = "e2e-" + os.urandom(12).hex(), free_port()
    config = tmp_path / "redis.conf"  # the password in a file, not on redis-server's own command line
    config.write_text(f"port {port}\nbind 127.0.0.1\nsave \"\"\nappendonly no\nrequirepass {password}\n")
    config.chmod(0o600)
    process = subprocess.Popen([binary, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not redis_answers(port, password):
        time.sleep(0.05)
    yield f"redis://:{password}@127.0.0.1:{port}/0", password
    process.terminate()
    process.wait(10)


def test_the_redis_password_reaches_no_command_line_and_no_log(model_repository, tmp_path, redis_with_password, caplog):
    url, password = redis_with_password
    caplog.set_level(logging.INFO)
    suite = start_suite(model_repository, tmp_path / "logs", replicas=1, redis_url=url)
    try:
        sup = suite.supervisor
        with internal_channel(sup, sup.cache_address, "cache") as ch:
            stats = cache_pb2_grpc.CacheServiceStub(ch).Stats(cache_pb2.StatsRequest(), timeout=10)
        assert stats.store == "redis" and stats.store_available  # the password did reach the cache
        assert serves(suite)
        for child in sup.children:
            cmdline = Path(f"/proc/{child.process.pid}/cmdline").read_bytes()
            assert password.encode() not in cmdline, child.name
            assert child.alive, child.name
    finally:
        suite.supervisor.stop()
    logs = list((tmp_path / "logs").iterdir())
    assert {p.name for p in logs} >= {"scheduler.log", "cache.log", "gateway.log", "runtime-0.log"}
    for path in logs:
        assert password not in path.read_text(errors="replace"), path
    assert password not in caplog.text and "redis://***@127.0.0.1" in caplog.text
