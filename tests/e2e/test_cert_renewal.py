"""Renewing the certificates of a running ``aiworks up --tls`` suite, with no restart (docs/security.md,
"Renewing certificates").

``aiworks certs`` run again over the suite's certificate folder issues every leaf anew from the same CA, as
cert-manager's renewal does in a cluster. Each process checks its files (every 0.3 s here; 10 s by default):
new connections to every port get the new certificate, the suite keeps serving over HTTPS and gRPC-TLS, the
gateway's ``/metrics`` shows the new expiry, and no child is restarted.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from cryptography import x509
from e2e_support import start_suite
from prometheus_client.parser import text_string_to_metric_families

from aiworks.core.rpc import blocking_channel
from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from aiworks.security.tls import TLSFiles, client_ssl_context

pytestmark = pytest.mark.slow

IRIS = [5.1, 3.5, 1.4, 0.2]
EXPIRY = "aiworks_tls_certificate_expiry_timestamp_seconds"
SERVICES = "gateway,scheduler,runtime,cache,monitor,supervisor,admin"


@pytest.fixture(scope="module")
def suite(model_repository, tmp_path_factory):
    s = start_suite(model_repository, tmp_path_factory.mktemp("renewal") / "logs", replicas=1, tls=True,
                    tls_reload_s=0.3)  # fmt: skip
    yield s
    s.supervisor.stop()


def _served(address: str, admin: TLSFiles, alpn: str) -> tuple[int, float]:
    """Serial and expiry (POSIX s) of the certificate a port presents to a new connection."""
    host, port = address.rsplit(":", 1)
    ctx = client_ssl_context(admin)
    ctx.check_hostname = False
    ctx.set_alpn_protocols([alpn])
    with socket.create_connection((host, int(port)), timeout=5) as raw, ctx.wrap_socket(raw) as tls:
        cert = x509.load_der_x509_certificate(tls.getpeercert(binary_form=True))
    return cert.serial_number, cert.not_valid_after_utc.timestamp()


def _serial(path) -> int:
    return x509.load_pem_x509_certificate(path.read_bytes()).serial_number


def _serves(suite, ca) -> None:
    body = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": IRIS}]}
    reply = requests.post(f"https://{suite.http_url}/v2/models/iris/infer", json=body, timeout=10, verify=str(ca))
    assert reply.status_code == 200 and reply.json()["outputs"][0]["data"] == [0], reply.text
    client = grpcclient.InferenceServerClient(suite.grpc_url, ssl=True, root_certificates=str(ca))
    try:
        x = grpcclient.InferInput("input", [1, 4], "FP32")
        x.set_data_from_numpy(np.array([IRIS], np.float32))
        assert client.infer("iris", [x]).as_numpy("label").tolist() == [[0]]
    finally:
        client.close()


def _runtime_address(sup, admin: TLSFiles) -> str:
    with blocking_channel(sup.scheduler_address, admin, server_name="scheduler") as ch:
        reply = scheduler_pb2_grpc.SchedulerServiceStub(ch).Status(scheduler_pb2.StatusRequest(), timeout=5)
    return reply.replicas[0].address


def test_renewed_certificates_are_taken_by_every_port_without_a_restart(suite):
    sup = suite.supervisor
    certs, ca = sup.tls_dir, sup.tls_dir / "ca.crt"
    admin = TLSFiles.from_dir(certs / "admin")
    ports = {
        "gateway": [(suite.http_url, "http/1.1"), (suite.grpc_url, "h2")],
        "scheduler": [(sup.scheduler_address, "h2")],
        "runtime": [(_runtime_address(sup, admin), "h2")],
    }
    for service, addresses in ports.items():
        for address, alpn in addresses:
            assert _served(address, admin, alpn)[0] == _serial(certs / service / "tls.crt"), (service, address)
    _serves(suite, ca)
    pids = {c.name: c.process.pid for c in sup.children}

    subprocess.run([sys.executable, "-m", "aiworks.cli", "certs", "--out-dir", str(certs), "--services", SERVICES],
                   check=True, capture_output=True, timeout=60)  # fmt: skip

    for service, addresses in ports.items():
        want = _serial(certs / service / "tls.crt")
        for address, alpn in addresses:
            deadline = time.monotonic() + 15
            while (got := _served(address, admin, alpn))[0] != want and time.monotonic() < deadline:
                time.sleep(0.1)
            assert got[0] == want, f"{service} at {address} still presents serial {got[0]:x}"
    expiry = _served(suite.http_url, admin, "http/1.1")[1]
    gateway = next(c for c in sup.children if c.name.startswith("gateway"))
    metrics = requests.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=5).text
    [gauge] = [f for f in text_string_to_metric_families(metrics) if f.name == EXPIRY]
    assert [(s.labels, s.value) for s in gauge.samples] == [({"common_name": "gateway"}, expiry)]
    assert "TLS files changed: now certificate serial" in gateway.log_path.read_text()
    _serves(suite, ca)
    assert {c.name: c.process.pid for c in sup.children} == pids  # nothing restarted
