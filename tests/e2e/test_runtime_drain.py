"""A stopping runtime replica drains: what it holds finishes, nothing new goes to it, then it exits.

On Kubernetes a rolling update or a scale-in sends SIGTERM to a runtime pod while
gateways still hold streams on it. Here a real suite with two runtime replicas serves
Triton's ``repeat_int32`` (a decoupled model whose responses come ``DELAY`` ms apart).
A client streams a long request over tritonclient's gRPC stream; the replica serving
it is signalled as the kubelet signals it. The stream must end whole, requests sent
meanwhile must be answered (by the other replica), and the signalled replica must exit
as soon as its stream is done, well before its drain limit.

A stateful sequence (Triton's implicit-state ``accumulator``) pinned to the signalled
replica goes on there while it drains, keeping its state, and ends there; a sequence
started meanwhile goes to the other replica.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import time

import pytest
import requests
import tritonclient.grpc as grpcclient
from e2e_support import repeat_inputs, start_suite, tool_env
from prometheus_client.parser import text_string_to_metric_families

from aiworks.demo.qa_streaming import build_qa_streaming_models
from aiworks.scheduler.sequence_routing import rendezvous_weight

pytestmark = pytest.mark.e2e

RESPONSES, DELAY_MS = 70, 100  # a 7-second stream: longer than the 5 s grace of a stop without a drain
DRAIN_S = 30  # the limit; the replica should leave long before it


def gauge(metrics_port: int, name: str, **labels) -> float:
    text = requests.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return sum(s.value for s in family.samples if labels.items() <= s.labels.items())
    raise AssertionError(f"{name} is not exported")


def inflight(metrics_port: int) -> float:
    return gauge(metrics_port, "aiworks_runtime_inflight_requests")


def stateless(value: int) -> dict:
    tensors = {"INPUT": value, "START": 0, "ACC": 100}
    return {"inputs": [{"name": k, "shape": [1, 1], "datatype": "INT32", "data": [v]} for k, v in tensors.items()]}


def pinned_to(replica: str, others: list[str], after: int = 0) -> int:
    """A sequence id every gateway sends to ``replica`` (the rendezvous order gateways route sequences by)."""
    return next(
        s for s in range(after + 1, after + 1000)
        if all(rendezvous_weight(replica, s) > rendezvous_weight(o, s) for o in others)
    )  # fmt: skip


def accumulate(base: str, sequence: int, value: int, **flags) -> int:
    body = {"inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "INT32", "data": [value]}],
            "parameters": {"sequence_id": sequence, **flags}}  # fmt: skip
    reply = requests.post(f"{base}/v2/models/accumulator/infer", json=body, timeout=10)
    assert reply.status_code == 200, reply.text
    return reply.json()["outputs"][0]["data"][0]


def test_a_stopping_runtime_finishes_its_stream_takes_nothing_new_and_exits(tmp_path):
    repo = tmp_path / "repo"
    build_qa_streaming_models(repo)
    suite = start_suite(repo, tmp_path / "logs", cache=False, monitor=False,
                        extra_env={"AIWORKS_RUNTIME_DRAIN_S": str(DRAIN_S)})  # fmt: skip
    base = f"http://{suite.http_url}"
    client = grpcclient.InferenceServerClient(suite.grpc_url)
    got: queue.Queue = queue.Queue()
    try:
        runtimes = suite.supervisor.runtimes()
        assert len(runtimes) == 2
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        client.async_stream_infer("repeat_int32", repeat_inputs(grpcclient, list(range(RESPONSES)), DELAY_MS),
                                  request_id="long")  # fmt: skip
        first, error = got.get(timeout=30)
        assert error is None and int(first.as_numpy("OUT")[0]) == 0
        holding = [c for c in runtimes if inflight(c.metrics_port) >= 1]
        assert len(holding) == 1, [(c.name, inflight(c.metrics_port)) for c in runtimes]
        stopping = holding[0]
        other = next(c for c in runtimes if c is not stopping)
        twin = pinned_to(stopping.name, [other.name])
        assert accumulate(base, twin, 5, sequence_start=True) == 5

        signalled = time.monotonic()
        os.kill(stopping.process.pid, signal.SIGTERM)
        assert accumulate(base, twin, 3) == 8  # the sequence on it goes on there, with its state
        assert gauge(stopping.metrics_port, "aiworks_runtime_sequences", model="accumulator", state="active") == 1
        # Requests sent while it drains are answered, over HTTP and on the same gRPC stream, by the other replica.
        for i in range(20):
            reply = requests.post(f"{base}/v2/models/accumulator_stateless/infer", json=stateless(i), timeout=10)
            assert reply.status_code == 200 and reply.json()["outputs"][0]["data"] == [100 + i], reply.text
        client.async_stream_infer("repeat_int32", repeat_inputs(grpcclient, [7, 8], 5), request_id="during")
        # The operator's view: `aiworks status` says which replica is stopping, and the stream is still running.
        status = subprocess.run([sys.executable, "-m", "aiworks", "status", "--scheduler-address",
                                 suite.supervisor.scheduler_address, "-o", "json"], capture_output=True, text=True,
                                timeout=60, env=tool_env(suite.supervisor))  # fmt: skip
        assert status.returncode == 0, status.stderr
        states = {r["replica_id"]: (r["live"], r.get("stopping", False)) for r in json.loads(status.stdout)["replicas"]}
        assert states[stopping.name] == (False, True) and states[other.name] == (True, False), states
        table = subprocess.run([sys.executable, "-m", "aiworks", "status", "--scheduler-address",
                                suite.supervisor.scheduler_address], capture_output=True, text=True, timeout=60,
                               env=tool_env(suite.supervisor)).stdout  # fmt: skip
        assert any(line.split()[:1] == [stopping.name] and " stopping " in line for line in table.splitlines()), table
        assert stopping.process.poll() is None, "the replica exited while its stream was still running"
        # A sequence started now (the gateway has had the new table for a while) goes to the other replica.
        late = pinned_to(stopping.name, [other.name], after=twin)  # it would have gone to the stopping replica
        assert accumulate(base, late, 40, sequence_start=True) == 40

        answers = {"long": [0], "during": []}
        while len(answers["long"]) < RESPONSES or len(answers["during"]) < 2:
            result, error = got.get(timeout=30)
            assert error is None, error
            answers[result.get_response().id].append(int(result.as_numpy("OUT")[0]))
        assert answers["long"] == list(range(RESPONSES))  # whole and in order: not cut by the stop
        assert answers["during"] == [7, 8]
        assert accumulate(base, twin, 4, sequence_end=True) == 12  # still there, 6 s into the drain

        code = stopping.process.wait(timeout=DRAIN_S)
        took = time.monotonic() - signalled
        # It left when its stream was done (about 6.9 s after the signal), not at the drain limit.
        assert code == 0 and took < RESPONSES * DELAY_MS / 1000 + 8, (code, took)
        assert other.process.poll() is None
        assert accumulate(base, late, 2, sequence_end=True) == 42  # it was started on the other replica
        reply = requests.post(f"{base}/v2/models/accumulator_stateless/infer", json=stateless(1), timeout=10)
        assert reply.status_code == 200, reply.text

        log = stopping.log_path.read_text()
        # The stream, and the twin's next request when it reached the replica before the signal's handler ran.
        assert re.search(r"draining: [12] request\(s\) in flight, 1 sequence\(s\) held", log), log[-2000:]
        assert " drained in " in log, log[-2000:]
        assert log.index("draining") < log.index(" stopping")
        scheduler_log = suite.supervisor.child("scheduler").log_path.read_text()
        assert "is stopping: no new work goes to it" in scheduler_log
    finally:
        client.stop_stream()
        client.close()
        suite.supervisor.stop()
