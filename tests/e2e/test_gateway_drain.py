"""A stopping gateway drains: on SIGTERM it reports not ready but keeps serving for ``drain_s``, then exits.

On Kubernetes a deleted pod's endpoint leaves the Service and the mesh some seconds after
the pod's SIGTERM; a gateway that closed its ports at once refused what was still routed to
it. Here the gateway is a real process of a real suite, signalled as the kubelet signals it,
and called from the outside over new connections, as a load balancer would send them.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from e2e.e2e_support import start_suite

pytestmark = pytest.mark.e2e

DRAIN_S = 5.0  # long enough for the calls below on a loaded machine
IRIS = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}]}


def test_a_stopping_gateway_reports_not_ready_serves_then_exits(model_repository, tmp_path):
    suite = start_suite(model_repository, tmp_path / "logs", cache=False, monitor=False,
                        extra_env={"AIWORKS_GATEWAY_DRAIN_S": str(DRAIN_S)})  # fmt: skip
    base = f"http://{suite.http_url}"
    client = grpcclient.InferenceServerClient(suite.grpc_url)
    try:
        gateway = suite.supervisor.child("gateway")
        assert requests.get(f"{base}/v2/health/ready", timeout=5).status_code == 200
        assert client.is_server_ready()

        signalled = time.monotonic()
        os.kill(gateway.process.pid, signal.SIGTERM)
        deadline = signalled + 2
        while requests.get(f"{base}/v2/health/ready", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "readiness still 200 two seconds after SIGTERM"
            time.sleep(0.05)
        assert not client.is_server_ready()
        # Requests that still arrive, on new connections, are answered over both protocols.
        reply = requests.post(f"{base}/v2/models/iris/infer", json=IRIS, timeout=5)
        assert reply.status_code == 200 and reply.json()["outputs"][0]["data"] == [0], reply.text
        x = grpcclient.InferInput("input", [1, 4], "FP32")
        x.set_data_from_numpy(np.array([[5.1, 3.5, 1.4, 0.2]], np.float32))
        assert client.infer("iris", [x]).as_numpy("label").tolist() == [[0]]
        assert gateway.process.poll() is None  # still running: those were answered before its ports closed

        code = gateway.process.wait(timeout=DRAIN_S + 15)
        took = time.monotonic() - signalled
        assert code == 0 and DRAIN_S - 0.5 <= took < DRAIN_S + 10, (code, took)
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{base}/v2/health/ready", timeout=2)
        log = gateway.log_path.read_text()
        assert f"gateway draining: reporting not ready, still serving, for {DRAIN_S:.1f} s" in log
        assert log.index("gateway draining") < log.index("gateway stopping")
    finally:
        client.close()
        suite.supervisor.stop()
