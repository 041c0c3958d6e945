"""A runtime replica registers and heartbeats through the scheduler's client: when the scheduler restarts and
forgets it, the replica registers again on its own, and the gateway serves again."""

from __future__ import annotations

import time

import numpy as np
import pytest
import tritonclient.http as httpclient
from e2e_support import start_suite

from aiworks.scheduler.client import BlockingSchedulerClient


@pytest.fixture(scope="module")
def small_suite(model_repository, tmp_path_factory):
    s = start_suite(model_repository, tmp_path_factory.mktemp("logs"), replicas=1, cache=False)
    yield s
    s.supervisor.stop()


def _live(supervisor) -> list[str]:
    tls, caller = supervisor.client_tls_for("admin"), supervisor.client_caller("admin")
    with BlockingSchedulerClient(supervisor.scheduler_address, tls, caller, timeout_s=2) as scheduler:
        return [r.replica_id for r in scheduler.status().replicas if r.live and r.models]


def _iris_ok(url: str) -> bool:
    client = httpclient.InferenceServerClient(url)
    try:
        x = httpclient.InferInput("input", [1, 4], "FP32")
        x.set_data_from_numpy(np.array([[5.1, 3.5, 1.4, 0.2]], dtype=np.float32))
        return client.infer("iris", [x]).as_numpy("label") is not None
    finally:
        client.close()


def test_the_runtime_registers_again_after_the_scheduler_restarts(small_suite):
    supervisor = small_suite.supervisor
    assert _live(supervisor) == ["runtime-0"]
    before = supervisor.child("scheduler").process.pid
    supervisor.restart("scheduler")
    assert supervisor.child("scheduler").process.pid != before
    deadline, live = time.monotonic() + 30, []
    while time.monotonic() < deadline and live != ["runtime-0"]:
        time.sleep(0.2)
        try:
            live = _live(supervisor)
        except Exception:  # the new scheduler is still starting
            live = []
    assert live == ["runtime-0"], "the runtime did not register with the restarted scheduler"
    deadline = time.monotonic() + 15
    while True:  # the gateway watches the new scheduler's routing table, then routes again
        try:
            assert _iris_ok(small_suite.http_url)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
