"""The monitor acting on a real suite: restart after kill -9, scale out and in under load, eject a failing replica.

Two suites, each started with the monitor and settings that make its
behaviour quick to provoke (listed next to each). Every action is checked
where a user would see it: the supervisor's processes, the scheduler's view
and the monitor's events (HTTP and ``aiworks events``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
from e2e_support import internal_channel, start_suite, tool_env

from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.slow


# ---- helpers -----------------------------------------------------------------------------------------


def events(suite, kind: str | None = None) -> list[dict]:
    url = f"{suite.supervisor.monitor_url}/v1/events?limit=1000" + (f"&kind={kind}" if kind else "")
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)["events"]


def wait_for(check, timeout_s: float, what: str, interval_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(interval_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


def replica(suite, replica_id: str):
    with internal_channel(suite.supervisor, suite.supervisor.scheduler_address, "scheduler") as ch:
        reply = scheduler_pb2_grpc.SchedulerServiceStub(ch).Status(scheduler_pb2.StatusRequest(), timeout=5)
    return next((r for r in reply.replicas if r.replica_id == replica_id), None)


def monitor_view(suite) -> dict:
    with urllib.request.urlopen(f"{suite.supervisor.monitor_url}/v1/replicas", timeout=5) as resp:
        return json.load(resp)


def runtime_names(suite) -> list[str]:
    return [c.name for c in suite.supervisor.runtimes()]


def iris_request(suite) -> requests.Response:
    body = {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}]}
    return requests.post(f"{suite.base}/v2/models/iris/infer", json=body, timeout=10)


def broken_iris_repository(target: Path, demo: Path) -> Path:
    """A repository whose ``iris`` has the demo's config but fails every batch (a Reshape that never fits)."""
    from onnx import TensorProto, helper

    nodes = [
        helper.make_node("Shape", ["input"], ["shape"]),
        helper.make_node("Add", ["shape", "offset"], ["impossible"]),  # [N, 4] -> [N + 3, 11]
        helper.make_node("Reshape", ["input", "impossible"], ["probabilities"]),
        helper.make_node("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0),
    ]
    graph = helper.make_graph(
        nodes, "broken_iris",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("label", TensorProto.INT64, ["N"]),
         helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor("offset", TensorProto.INT64, [2], [3, 7])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (target / "iris" / "1").mkdir(parents=True)
    (target / "iris" / "1" / "model.onnx").write_bytes(model.SerializeToString())
    (target / "iris" / "config.pbtxt").write_text((demo / "iris" / "config.pbtxt").read_text())
    return target


# ---- restart and ejection ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def healing_suite(model_repository, tmp_path_factory):
    """Two runtimes, no autoscaling (so a stopped replica stays stopped), the scheduler's own outlier
    ejection off (so an ejection can only be the monitor's), a 0.5 s control loop, ejection after
    5 errors within 5 s."""
    env = {
        "AIWORKS_MONITOR_AUTOSCALE": "false",
        "AIWORKS_MONITOR_INTERVAL_S": "0.5",
        "AIWORKS_MONITOR_EJECT_WINDOW_S": "5",
        "AIWORKS_MONITOR_EJECT_MIN_ERRORS": "5",
        "AIWORKS_MONITOR_EJECT_DURATION_S": "120",
        "AIWORKS_SCHEDULER_OUTLIER_CONSECUTIVE_ERRORS": "0",
        "AIWORKS_MONITOR_AUDIT_LOG": str(tmp_path_factory.mktemp("healing-audit") / "audit.jsonl"),
        "AIWORKS_SCHEDULER_AUDIT_LOG": str(tmp_path_factory.mktemp("scheduler-audit") / "audit.jsonl"),
    }
    suite = start_suite(
        model_repository, tmp_path_factory.mktemp("healing-logs"),
        replicas=2, monitor=True, cache=False, extra_env=env, prometheus=shutil.which("prometheus") is not None,
    )  # fmt: skip
    yield suite
    suite.supervisor.stop()


async def test_prometheus_gives_the_monitor_what_a_scrape_gives(healing_suite):
    """`aiworks up --prometheus`: the monitor's Prometheus collector reads the same series as its scraper."""
    from aiworks.monitor.collect import PrometheusCollector, Scraper

    sup = healing_suite.supervisor
    if sup.prometheus is None:
        pytest.skip("the prometheus binary is not installed")
    targets = sorted(t for kind, ts in sup.metrics_targets().items() if kind != "monitor" for t in ts)
    scraper, prometheus = Scraper(), PrometheusCollector(sup.prometheus.url)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            queried = await prometheus.collect(targets)
            if set(queried) == set(targets):
                break
            await asyncio.sleep(0.5)
        scraped = await scraper.collect(targets)
    finally:
        await scraper.close()
        await prometheus.close()
    assert set(queried) == set(scraped) == set(targets)

    def series(samples):
        return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "service"))) for s in samples}

    scheduler = sup.metrics_targets()["scheduler"][0]
    assert series(queried[scheduler]) == series(scraped[scheduler])
    for target in targets:  # every series a scrape gives exists in Prometheus (new ones may lag a scrape)
        assert {n for n, _ in series(scraped[target])} <= {n for n, _ in series(queried[target])}, target


def test_kill_9_of_a_runtime_is_restarted_within_5_s(healing_suite):
    suite = healing_suite
    child = suite.supervisor.child("runtime-0")
    old_pid = child.process.pid
    old_address = replica(suite, "runtime-0").address  # the restarted one listens on a new port
    os.kill(old_pid, signal.SIGKILL)
    killed = time.monotonic()
    [event] = wait_for(lambda: events(suite, "restart"), 5.0, "a restart event for runtime-0")
    restarted_s = time.monotonic() - killed
    assert child.process.pid != old_pid and child.process.poll() is None
    assert event["target"] == "runtime-0" and event["reason"] == "dead"
    assert "exited with code -9" in event["message"]
    print(f"runtime-0 restarted {restarted_s:.2f} s after kill -9")
    back = wait_for(
        lambda: (r := replica(suite, "runtime-0")) is not None and r.address != old_address and r.live and r,
        30.0, "the restarted runtime-0 live in the scheduler",
    )  # fmt: skip
    assert "iris:1" in back.models
    assert iris_request(suite).status_code == 200
    # What a user runs to see it.
    out = subprocess.run(
        [sys.executable, "-m", "aiworks", "events", "--monitor", suite.supervisor.monitor_url, "--kind", "restart"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "restart" in out.stdout and "runtime-0" in out.stdout and "exited with code -9" in out.stdout


def test_a_replica_that_keeps_failing_is_ejected_through_the_scheduler(healing_suite, model_repository, tmp_path):
    suite = healing_suite
    bad_repo = broken_iris_repository(tmp_path / "broken", model_repository)
    suite.supervisor.start_runtime(
        "runtime-bad", model_repository=bad_repo, models=["iris"], env={"AIWORKS_RUNTIME_WARMUP": "false"}
    )
    wait_for(
        lambda: (r := replica(suite, "runtime-bad")) is not None and r.live and "iris:1" in r.models,
        60.0, "runtime-bad registered",
    )  # fmt: skip
    failed = 0
    started = time.monotonic()
    while not events(suite, "eject") and time.monotonic() - started < 20:
        for _ in range(20):
            failed += iris_request(suite).status_code != 200
    [event] = events(suite, "eject")
    print(f"ejected after {time.monotonic() - started:.1f} s and {failed} failed requests: {event['message']}")
    assert event["target"] == "runtime-bad" and event["reason"] == "errors"
    assert "batches failed" in event["message"] and event["details"]["failed"] >= 5
    assert failed >= 5
    status = replica(suite, "runtime-bad")
    assert status.ejected and status.ejected_for_s > 60
    assert replica(suite, "runtime-0").ejected is False and replica(suite, "runtime-1").ejected is False
    # Out of routing: every request now succeeds on the healthy replicas.
    assert all(iris_request(suite).status_code == 200 for _ in range(50))
    # Scale the pool back to 2: the newest (runtime-bad) is stopped, and the monitor leaves it stopped.
    suite.supervisor.scale_runtimes(2)
    assert "runtime-bad" not in runtime_names(suite)
    time.sleep(1.5)
    assert not [e for e in events(suite, "restart") if e["target"] == "runtime-bad"]


# ---- autoscaling -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scaling_suite(model_repository, tmp_path_factory):
    """One runtime, at most two; overload is 4 queued requests per replica or a p99 of 50 ms for 2 s, quiet is
    3 s, cool-downs 5 s.

    Both triggers are set low on purpose: how many of the spike's 96 callers wait in the scheduler's queue,
    rather than in the batch being run or in the gateway, depends on the machine's speed (a fast CI VM kept
    about 6 queued with one replica), while a lone request takes about 10 ms anywhere."""
    env = {
        "AIWORKS_MONITOR_INTERVAL_S": "0.5",
        "AIWORKS_MONITOR_SCALE_OUT_QUEUE_DEPTH": "4",
        "AIWORKS_MONITOR_SCALE_OUT_P99_S": "0.05",
        "AIWORKS_MONITOR_SCALE_OUT_SUSTAIN_S": "2",
        "AIWORKS_MONITOR_SCALE_OUT_COOLDOWN_S": "5",
        "AIWORKS_MONITOR_SCALE_IN_SUSTAIN_S": "3",
        "AIWORKS_MONITOR_SCALE_IN_COOLDOWN_S": "5",
    }
    suite = start_suite(
        model_repository, tmp_path_factory.mktemp("scaling-logs"),
        replicas=1, max_replicas=2, monitor=True, cache=False, extra_env=env,
    )  # fmt: skip
    yield suite
    suite.supervisor.stop()


async def load(grpc_url: str, clients: int, stop: asyncio.Event) -> dict:
    """``clients`` closed-loop callers of digits version 2 (the heavy demo model) until ``stop``."""
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    counts = {"ok": 0, "errors": 0}
    rng = np.random.default_rng(0)
    async with grpc.aio.insecure_channel(grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)

        async def caller():
            while not stop.is_set():
                req = service_pb2.ModelInferRequest(model_name="digits", model_version="2")
                req.inputs.add(name="input", datatype="FP32", shape=[1, 64])
                req.raw_input_contents.append(rng.random((1, 64), dtype=np.float32).tobytes())
                try:
                    await stub.ModelInfer(req, timeout=30)
                    counts["ok"] += 1
                except grpc.aio.AioRpcError:
                    counts["errors"] += 1

        await asyncio.gather(*(caller() for _ in range(clients)))
    return counts


async def test_a_sustained_spike_scales_out_within_15_s_and_back_in_after(scaling_suite):
    suite = scaling_suite
    assert runtime_names(suite) == ["runtime-0"]
    stop = asyncio.Event()
    spike = asyncio.ensure_future(load(suite.grpc_url, 96, stop))
    started = time.monotonic()
    try:
        while not events(suite, "scale_out") and time.monotonic() - started < 15:
            await asyncio.sleep(0.25)
        scaled_s = time.monotonic() - started
        scaled = events(suite, "scale_out")
        assert scaled, f"no scale-out within 15 s; the monitor saw {monitor_view(suite)}"
        [event] = scaled
        # The new replica joins while the spike lasts.
        while time.monotonic() - started < 45:
            r = replica(suite, "runtime-1")
            if r is not None and r.live and r.models:
                break
            await asyncio.sleep(0.25)
    finally:
        stop.set()
        counts = await spike
    print(f"scaled out {scaled_s:.1f} s into the spike: {event['message']}; load {counts}")
    assert scaled_s <= 15
    assert event["target"] == "runtime" and event["reason"] in ("queue_depth", "p99_latency")
    assert event["details"]["replicas"] == 2 and event["details"]["previous"] == 1
    assert counts["ok"] > 0 and counts["errors"] == 0
    assert runtime_names(suite) == ["runtime-0", "runtime-1"]
    assert replica(suite, "runtime-1").live
    # Load stopped: quiet for 3 s (and 5 s since scaling) -> back to one replica, the newest stopped.
    quiet = time.monotonic()
    [scale_in] = await asyncio.to_thread(wait_for, lambda: events(suite, "scale_in"), 20.0, "a scale-in event")
    print(f"scaled in {time.monotonic() - quiet:.1f} s after the load stopped: {scale_in['message']}")
    assert scale_in["reason"] == "quiet" and scale_in["details"]["replicas"] == 1
    assert runtime_names(suite) == ["runtime-0"]


# ---- rollouts through the running monitor --------------------------------------------------------


def aiworks(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "aiworks", *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_a_rollout_started_with_the_cli_drives_the_schedulers_weights_and_is_audited(healing_suite):
    """The monitor hosts the canary controller: the CLI starts a rollout, the first step's weights are in
    force at the scheduler, abort returns all traffic to stable, and each step is an event and an audit line."""
    suite = healing_suite
    url = suite.supervisor.monitor_url
    env = tool_env(suite.supervisor)  # the CLI acts as admin, with the suite's token file
    started = aiworks("rollout", "--monitor", url, "start", "digits", "--from", "1", "--to", "2",
                      "--steps", "20,100", "--dwell", "60s", "--json", env=env)  # fmt: skip
    assert started.returncode == 0, started.stderr
    weights = subprocess.run(
        [sys.executable, "-m", "aiworks", "traffic", "--scheduler", suite.supervisor.scheduler_address, "get", "digits"],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert weights.returncode == 0, weights.stderr
    assert "1" in weights.stdout and "80" in weights.stdout and "20" in weights.stdout, weights.stdout
    status = aiworks("rollout", "--monitor", url, "status", "digits", "--json", env=env)
    assert status.returncode == 0, status.stderr
    doc = json.loads(status.stdout)
    assert doc["model"] == "digits" and doc["canary"] == "2" and doc["stable"] == "1", doc
    aborted = aiworks("rollout", "--monitor", url, "abort", "digits", env=env)
    assert aborted.returncode == 0, aborted.stderr
    after = subprocess.run(
        [sys.executable, "-m", "aiworks", "traffic", "--scheduler", suite.supervisor.scheduler_address, "get", "digits"],
        capture_output=True, text=True, timeout=30, env=env,
    )  # fmt: skip
    assert "100" in after.stdout, after.stdout
    kinds = {e["kind"] for e in events(suite) if e["target"] == "digits"}
    assert {"rollout_started", "rollout_aborted"} <= kinds, kinds
    audit_file = suite.supervisor.config.extra_env["AIWORKS_MONITOR_AUDIT_LOG"]
    wait_for(lambda: "rollout" in open(audit_file).read(), 5.0, "rollout lines in the audit log")
    verified = aiworks("audit", "verify", audit_file)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    # The scheduler audits every policy change itself, whoever asks (here the monitor, twice: start and abort).
    scheduler_audit = suite.supervisor.config.extra_env["AIWORKS_SCHEDULER_AUDIT_LOG"]

    def policy_lines():
        lines = [json.loads(line) for line in open(scheduler_audit) if line.strip()]
        return [x for x in lines if x["action"] == "traffic_policy" and x["model"] == "digits"] or None

    lines = wait_for(policy_lines, 5.0, "traffic_policy lines in the scheduler's audit log")
    assert len(lines) >= 2 and all(x["kind"] == "admin" and x["status"] == "ok" for x in lines), lines
    assert "1=80" in lines[0]["details"]["weights"] and "2=20" in lines[0]["details"]["weights"], lines[0]
    assert aiworks("audit", "verify", scheduler_audit).returncode == 0
