"""The suite with mutual TLS inside and TLS on the gateway, as real processes.

Clients reach the gateway over HTTPS and gRPC-TLS with tritonclient, trusting
the suite's CA. Every internal port (scheduler, runtime, cache) refuses a
plaintext client, a client without a certificate, and one whose certificate
another CA signed, in the TLS handshake. The tools reach the scheduler with
the ``admin`` certificate, and ``aiworks up --tls`` prints how to call it.
"""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
from grpc_health.v1 import health_pb2, health_pb2_grpc

from aiworks.core.errors import NotFound, Unavailable
from aiworks.core.rpc import blocking_channel, use_process_tls
from aiworks.monitor.platform import SchedulerEjector
from aiworks.pb.cache.v1 import cache_pb2, cache_pb2_grpc
from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from aiworks.security.certs import write_certificates
from aiworks.security.tls import TLSFiles, client_ssl_context
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

pytestmark = pytest.mark.slow

IRIS_ROWS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3]], dtype=np.float32)


@pytest.fixture(scope="module")
def repo(model_repository, tmp_path_factory) -> Path:
    """The demo iris, and a copy of it whose results the cache keeps (so the gateway calls the cache)."""
    repo = tmp_path_factory.mktemp("mtls-repo") / "model-repository"
    shutil.copytree(model_repository / "iris", repo / "iris")
    shutil.copytree(model_repository / "iris", repo / "iris_cached")
    config = (repo / "iris" / "config.pbtxt").read_text().replace('name: "iris"', 'name: "iris_cached"')
    # Clients see cache_hit only when the model opts in (report_cache_hit, docs/cache.md).
    report = 'parameters { key: "report_cache_hit" value: { string_value: "true" } }\n'
    (repo / "iris_cached" / "config.pbtxt").write_text(config + "response_cache { enable: true }\n" + report)
    return repo


@pytest.fixture(scope="module")
def suite(repo, tmp_path_factory):
    """Scheduler, one runtime, cache and gateway with ``tls=True``; certificates next to the logs."""
    logs = tmp_path_factory.mktemp("mtls") / "logs"
    supervisor = Supervisor(SuiteConfig.on_free_ports(model_repository=repo, log_dir=logs, replicas=1, tls=True))
    try:
        supervisor.start()
    except Exception:
        supervisor.stop()
        raise
    yield supervisor
    supervisor.stop()


@pytest.fixture(scope="module")
def foreign_pki(tmp_path_factory) -> Path:
    """Another CA issuing certificates for the same names."""
    out = tmp_path_factory.mktemp("foreign-pki")
    write_certificates(out, ["localhost", "127.0.0.1"], ["admin"])
    return out


def _runtime_address(suite: Supervisor) -> str:
    with blocking_channel(suite.scheduler_address, suite.client_tls, server_name="scheduler") as ch:
        reply = scheduler_pb2_grpc.SchedulerServiceStub(ch).Status(scheduler_pb2.StatusRequest(), timeout=5)
    [replica] = reply.replicas
    return replica.address


def _internal_addresses(suite: Supervisor) -> dict[str, str]:
    return {"scheduler": suite.scheduler_address, "runtime": _runtime_address(suite), "cache": suite.cache_address}


def _health(channel: grpc.Channel) -> int:
    with channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def _refused(channel: grpc.Channel) -> None:
    with pytest.raises(grpc.RpcError) as info:
        _health(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value


def _name_override(service: str) -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", service)]


# ---- `aiworks up --tls` (first: it runs before the module's suite starts) -------------------------------


def test_up_tls_starts_with_certificates_and_prints_how_to_call_it(repo, tmp_path):
    http_port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "aiworks", "up", "--tls",
            "--http-port", str(http_port), "--grpc-port", str(free_port()),
            "--scheduler-port", "0", "--runtime-base-port", "0", "--replicas", "1",
            "--monitor-port", "0", "--control-port", "0", "--metrics-base-port", "0",
            "--model-repository", str(repo), "--log-dir", str(tmp_path / ".aiworks" / "logs"),
        ],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
    )  # fmt: skip
    certs = tmp_path / ".aiworks" / "certs"
    try:
        deadline, ready = time.monotonic() + 120, False
        while time.monotonic() < deadline and not ready and proc.poll() is None:
            try:
                url = f"https://127.0.0.1:{http_port}/v2/health/ready"
                ready = requests.get(url, verify=certs / "ca.crt", timeout=1).status_code == 200
            except (requests.ConnectionError, OSError):
                time.sleep(0.3)
        assert ready, "the suite never became ready over HTTPS"
        with pytest.raises(requests.ConnectionError):  # plaintext HTTP on the TLS port
            requests.get(f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out
    assert f"HTTP (KServe v2): https://127.0.0.1:{http_port}/v2" in out
    assert "curl --cacert .aiworks/certs/ca.crt https://127.0.0.1:" in out
    assert 'ssl=True, root_certificates=".aiworks/certs/ca.crt"' in out
    assert "aiworks status --tls-dir .aiworks/certs/admin --scheduler-address 127.0.0.1:" in out
    for svc in ("gateway", "scheduler", "runtime", "cache", "monitor", "supervisor", "admin"):
        assert (certs / svc / "tls.crt").is_file() and (certs / svc / "tls.key").stat().st_mode & 0o077 == 0
    monitor_log = (tmp_path / ".aiworks" / "logs" / "monitor.log").read_text()
    assert "Traceback" not in monitor_log


# ---- the gateway over TLS --------------------------------------------------------------------------------


def test_inference_over_https_and_grpc_tls_with_tritonclient(suite):
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    ca = str(suite.tls_dir / "ca.crt")
    http_url = suite.http_url.removeprefix("https://")
    http = httpclient.InferenceServerClient(http_url, ssl=True, ssl_options={"ca_certs": ca})
    try:
        assert http.is_server_ready()
        inp = httpclient.InferInput("input", list(IRIS_ROWS.shape), "FP32")
        inp.set_data_from_numpy(IRIS_ROWS, binary_data=True)
        via_http = http.infer("iris", [inp]).as_numpy("probabilities")
    finally:
        http.close()
    rpc = grpcclient.InferenceServerClient(f"127.0.0.1:{suite.config.grpc_port}", ssl=True, root_certificates=ca)
    try:
        assert rpc.is_server_ready()
        inp = grpcclient.InferInput("input", list(IRIS_ROWS.shape), "FP32")
        inp.set_data_from_numpy(IRIS_ROWS)
        result = rpc.infer("iris", [inp])
        via_grpc, labels = result.as_numpy("probabilities"), result.as_numpy("label")
    finally:
        rpc.close()
    assert via_http.shape == (2, 3)
    np.testing.assert_array_equal(via_http, via_grpc)
    assert labels.ravel().tolist() == [0, 2]  # setosa, virginica (Triton answers [N, 1]: dims [1] reshaped to [])


def test_gateway_reaches_the_cache_over_mutual_tls(suite):
    body = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": IRIS_ROWS[0].tolist()}]}
    ca = suite.tls_dir / "ca.crt"
    hits = []
    deadline = time.monotonic() + 10
    while True not in hits and time.monotonic() < deadline:  # the store runs in the background
        reply = requests.post(f"{suite.http_url}/v2/models/iris_cached/infer", json=body, verify=ca, timeout=10)
        assert reply.status_code == 200, reply.text
        hits.append(reply.json()["parameters"]["cache_hit"])
        time.sleep(0.05)
    assert hits[0] is False and hits[-1] is True  # stored, then found: over the gateway's TLS channel to the cache


def test_gateway_refuses_plaintext_and_clients_that_distrust_its_ca(suite, foreign_pki):
    with pytest.raises(requests.ConnectionError):
        requests.get(suite.http_url.replace("https://", "http://") + "/v2/health/ready", timeout=2)
    wrong_ca = client_ssl_context(ca=foreign_pki / "ca.crt")
    with pytest.raises(OSError, match="CERTIFICATE_VERIFY_FAILED"):
        urllib.request.urlopen(f"{suite.http_url}/v2/health/ready", context=wrong_ca, timeout=5)
    _refused(grpc.insecure_channel(f"127.0.0.1:{suite.config.grpc_port}"))


# ---- internal ports: mutual TLS -------------------------------------------------------------------------


def test_internal_services_serve_a_client_with_a_certificate_of_the_suite(suite):
    admin = TLSFiles.from_dir(suite.tls_dir / "admin")
    for service, address in _internal_addresses(suite).items():
        assert _health(blocking_channel(address, admin, server_name=service)) == health_pb2.HealthCheckResponse.SERVING


def test_plaintext_clients_are_refused_by_scheduler_runtime_and_cache(suite):
    for address in _internal_addresses(suite).values():
        _refused(grpc.insecure_channel(address))


def test_clients_without_a_certificate_are_refused(suite):
    ca = (suite.tls_dir / "ca.crt").read_bytes()
    for service, address in _internal_addresses(suite).items():
        creds = grpc.ssl_channel_credentials(root_certificates=ca)  # trusts the server, shows nothing
        _refused(grpc.secure_channel(address, creds, options=_name_override(service)))


def test_clients_with_a_certificate_from_another_ca_are_refused(suite, foreign_pki):
    for service, address in _internal_addresses(suite).items():
        creds = grpc.ssl_channel_credentials(
            root_certificates=(suite.tls_dir / "ca.crt").read_bytes(),  # the right CA for the server ...
            private_key=(foreign_pki / "admin" / "tls.key").read_bytes(),  # ... but a foreign client certificate
            certificate_chain=(foreign_pki / "admin" / "tls.crt").read_bytes(),
        )
        _refused(grpc.secure_channel(address, creds, options=_name_override(service)))


async def test_monitor_reaches_the_scheduler_over_mutual_tls(suite):
    # As `aiworks monitor` runs it: its settings' files recorded as the process's, the ejector built without them.
    use_process_tls(TLSFiles.from_dir(suite.tls_dir / "monitor"))
    try:
        ejector = SchedulerEjector(suite.scheduler_address)
    finally:
        use_process_tls(None)
    try:
        with pytest.raises(NotFound, match="unknown replica 'no-such-replica'"):  # answered: TLS worked
            await ejector.eject("no-such-replica", 1.0, "test")
    finally:
        await ejector.close()
    plain = SchedulerEjector(suite.scheduler_address, timeout_s=2.0)
    try:
        with pytest.raises(Unavailable):
            await plain.eject("no-such-replica", 1.0, "test")
    finally:
        await plain.close()


# ---- internal ports: who may call what (the certificate's name) -----------------------------------------


def _as(suite: Supervisor, name: str, address: str, service: str) -> grpc.Channel:
    return blocking_channel(address, TLSFiles.from_dir(suite.tls_dir / name), server_name=service)


def test_a_certificate_of_the_suite_calls_only_its_own_methods(suite):
    ref = scheduler_pb2.ModelRef(name="iris")
    policy = scheduler_pb2.SetTrafficPolicyRequest(policy=scheduler_pb2.TrafficPolicy(model="iris", weights={"1": 1}))
    for name, method, request in [
        ("runtime", "SetTrafficPolicy", policy),
        ("runtime", "LoadModel", ref),
        ("runtime", "UnloadModel", ref),
        ("gateway", "RegisterReplica", scheduler_pb2.ReplicaInfo(replica_id="rogue", address="127.0.0.1:1")),
    ]:
        with _as(suite, name, suite.scheduler_address, "scheduler") as ch:
            with pytest.raises(grpc.RpcError) as info:
                getattr(scheduler_pb2_grpc.SchedulerServiceStub(ch), method)(request, timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, (name, method)
        assert f"caller '{name}' may not call" in info.value.details()
    with _as(suite, "admin", suite.scheduler_address, "scheduler") as ch:  # only gateways watch the routing table
        with pytest.raises(grpc.RpcError) as info:
            for _ in scheduler_pb2_grpc.SchedulerServiceStub(ch).WatchRouting(iter([scheduler_pb2.RoutingReport()]), timeout=5):
                pass
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    put = cache_pb2.PutRequest(model="iris_cached", key=b"k" * 32, value=b"planted", epoch=0)
    with _as(suite, "admin", suite.cache_address, "cache") as ch:
        with pytest.raises(grpc.RpcError) as info:
            cache_pb2_grpc.CacheServiceStub(ch).Put(put, timeout=5)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with _as(suite, "monitor", suite.scheduler_address, "scheduler") as ch:  # the monitor may steer traffic
        stub = scheduler_pb2_grpc.SchedulerServiceStub(ch)
        assert stub.GetTrafficPolicy(scheduler_pb2.GetTrafficPolicyRequest(model="iris"), timeout=5).model == "iris"
        assert stub.Status(scheduler_pb2.StatusRequest(), timeout=5).caller_auth == "mutual TLS, token"


# ---- the tools ------------------------------------------------------------------------------------------


def _aiworks(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != "AIWORKS_TLS_DIR"}
    return subprocess.run(
        [sys.executable, "-m", "aiworks", *args],
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_and_traffic_use_the_admin_certificate(suite):
    admin = str(suite.tls_dir / "admin")
    status = _aiworks("status", "--scheduler", suite.scheduler_address, env={"AIWORKS_TLS_DIR": admin})
    assert status.returncode == 0, status.stderr
    assert "runtime-0" in status.stdout and "iris:1" in status.stdout
    traffic = _aiworks("traffic", "--scheduler", suite.scheduler_address, "--tls-dir", admin, "get", "iris")
    assert traffic.returncode == 0, traffic.stderr
    assert traffic.stdout.startswith("iris: ")
    refused = _aiworks("status", "--scheduler", suite.scheduler_address)
    assert refused.returncode != 0 and "set AIWORKS_TLS_DIR" in refused.stderr


def test_aiworks_probe_passes_the_handshake_with_the_services_own_certificate(suite):
    """What the container healthchecks run (docker-compose.yml, the images): the service's environment, no more."""
    ports = {service: address.rsplit(":", 1)[1] for service, address in _internal_addresses(suite).items()}
    ports["gateway"] = str(suite.config.http_port)
    for service, port in ports.items():
        prefix = f"AIWORKS_{service.upper()}_"
        env = {**suite.caller_env(service), f"{prefix}{'HTTP_' if service == 'gateway' else ''}PORT": port}
        env[f"{prefix}SCHEDULER_ADDRESS"] = suite.scheduler_address  # required by the runtime's and gateway's settings
        probe = _aiworks("probe", service, env=env)
        assert probe.returncode == 0, (service, probe.stderr)
        assert probe.stdout.strip() == f"{service}: {'200' if service == 'gateway' else 'SERVING'}"
    plain = _aiworks("probe", "scheduler", env={"AIWORKS_SCHEDULER_PORT": ports["scheduler"]})
    assert plain.returncode == 1 and "scheduler is not serving: UNAVAILABLE" in plain.stderr


def test_https_health_check_uses_the_ca_and_client_certificate(suite):
    ctx: ssl.SSLContext = client_ssl_context(TLSFiles.from_dir(suite.tls_dir / "admin"))
    with urllib.request.urlopen(f"{suite.http_url}/v2/health/ready", context=ctx, timeout=5) as resp:
        assert resp.status == 200
