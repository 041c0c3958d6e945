"""The control plane survives a lost scheduler, and keeps its traffic policies (docs/deployment.md).

Real processes: the suite with one scheduler and a state file, and the suite with two schedulers
sharing a private redis-server (on a free port, never 6379). Every runtime registers with both
schedulers; the gateway watches the first and fails over to the second. Load comes from
tritonclient's gRPC client.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter

import grpc
import numpy as np
import pytest
from cache.support import RedisServer
from qos_support import _suite_overrides, start_suite

from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

DIGITS = np.random.default_rng(7).random((1, 64), dtype=np.float32)


def _stub(suite, address: str):
    return suite.supervisor.caller_channel(address, "scheduler")


def set_weights(suite, address: str, weights: dict[str, int], model: str = "digits"):
    with _stub(suite, address) as ch:
        policy = scheduler_pb2.TrafficPolicy(model=model, weights=weights)
        return scheduler_pb2_grpc.SchedulerServiceStub(ch).SetTrafficPolicy(
            scheduler_pb2.SetTrafficPolicyRequest(policy=policy), timeout=5
        )


def get_weights(suite, address: str, model: str = "digits") -> dict[str, int]:
    with _stub(suite, address) as ch:
        reply = scheduler_pb2_grpc.SchedulerServiceStub(ch).GetTrafficPolicy(
            scheduler_pb2.GetTrafficPolicyRequest(model=model), timeout=2
        )
    return dict(reply.weights)


def live_replicas(suite, address: str) -> int:
    try:
        with _stub(suite, address) as ch:
            reply = scheduler_pb2_grpc.SchedulerServiceStub(ch).Status(scheduler_pb2.StatusRequest(), timeout=1)
    except grpc.RpcError:
        return 0
    return sum(1 for r in reply.replicas if r.live and r.models)


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            value = check()
        except grpc.RpcError:
            value = None
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def gateway_sees_ready(grpc_url: str, model: str, versions: tuple[str, ...]) -> bool:
    import tritonclient.grpc as tc

    client = tc.InferenceServerClient(grpc_url)
    try:
        return all(client.is_model_ready(model, v) for v in versions)
    finally:
        client.close()


def kill9(suite, name: str) -> None:
    child = suite.supervisor.child(name)
    os.kill(child.process.pid, signal.SIGKILL)
    child.process.wait(10)


async def digits_versions(grpc_url: str, count: int) -> Counter:
    """``count`` tritonclient inferences of digits naming no version: the versions that answered."""
    import tritonclient.grpc.aio as tc

    client = tc.InferenceServerClient(grpc_url)
    versions: Counter = Counter()
    try:
        for _ in range(count):
            x = tc.InferInput("input", [1, 64], "FP32")
            x.set_data_from_numpy(DIGITS)
            result = await client.infer("digits", [x])
            versions[result.get_response().model_version] += 1
    finally:
        await client.close()
    return versions


async def load_through(grpc_url: str, clients: int, duration_s: float, during=None) -> dict:
    """Closed-loop tritonclient load; every failure and the longest gap between two successes."""
    import tritonclient.grpc.aio as tc
    from tritonclient.utils import InferenceServerException

    client = tc.InferenceServerClient(grpc_url)
    stats = {"ok": 0, "failed": [], "versions": Counter(), "last_ok": time.monotonic(), "gap_s": 0.0}
    stop_at = time.monotonic() + duration_s

    async def caller():
        while time.monotonic() < stop_at:
            x = tc.InferInput("input", [1, 64], "FP32")
            x.set_data_from_numpy(DIGITS)
            try:
                result = await client.infer("digits", [x], client_timeout=30)
            except InferenceServerException as exc:
                stats["failed"].append(str(exc))
                continue
            now = time.monotonic()
            stats["gap_s"] = max(stats["gap_s"], now - stats["last_ok"])
            stats["last_ok"] = now
            stats["ok"] += 1
            stats["versions"][result.get_response().model_version] += 1

    try:
        tasks = [asyncio.create_task(caller()) for _ in range(clients)]
        if during is not None:
            await asyncio.sleep(duration_s / 3)
            await asyncio.get_running_loop().run_in_executor(None, during)
        await asyncio.gather(*tasks)
    finally:
        await client.close()
    return stats


# ---- one scheduler, its policies in the state file ------------------------------------------


@pytest.fixture(scope="module")
def file_suite(model_repository, tmp_path_factory):
    suite = start_suite(model_repository, tmp_path_factory.mktemp("ha-file") / "logs", **_suite_overrides({}))
    yield suite
    suite.supervisor.stop()


async def test_restarted_scheduler_keeps_its_weights_from_the_state_file(file_suite):
    sup = file_suite.supervisor
    set_weights(file_suite, sup.scheduler_address, {"1": 90, "2": 10})
    state_file = sup.config.log_dir.parent / "scheduler-traffic.json"
    stored = json.loads(state_file.read_text())["policies"]["digits"]
    assert stored["weights"] == {"1": 90, "2": 10}
    # The gateway has the policy before the kill (else it keeps a table without it until the restarted scheduler's
    # first one, seconds later: what this test measures is the restart, not that race).
    started = time.monotonic()
    while (await digits_versions(file_suite.grpc_url, 10))["1"] == 0:
        assert time.monotonic() - started < 10, "the gateway never applied the 90/10 policy"

    kill9(file_suite, "scheduler")
    sup.restart("scheduler")
    # Back with the weights it had, before any runtime registered again (read at start).
    assert wait_for(lambda: get_weights(file_suite, sup.scheduler_address), 30, "the scheduler") == {"1": 90, "2": 10}
    wait_for(lambda: live_replicas(file_suite, sup.scheduler_address) >= 2, 15, "the runtimes to register again")
    wait_for(lambda: gateway_sees_ready(file_suite.grpc_url, "digits", ("1", "2")), 15, "the gateway's table")
    # Known defect (docs/scheduler.md), made rarer but not gone: for a moment after the restart the gateway may
    # send every request naming no version to the latest one (seen: up to 41 requests, about 0.1 s). Bounded here,
    # then the split is measured.
    started, window = time.monotonic(), 0
    while (await digits_versions(file_suite.grpc_url, 1))["1"] == 0:
        window += 1
        assert time.monotonic() - started < 5, f"{window} requests went to the latest version after the restart"
    print(f"after the restart, {window} request(s) went to the latest version before the weights applied")
    versions = await digits_versions(file_suite.grpc_url, 200)
    assert sum(versions.values()) == 200
    assert 170 <= versions["1"] <= 190 and 10 <= versions["2"] <= 30, versions


# ---- two schedulers sharing Redis ---------------------------------------------------------------


@pytest.fixture(scope="module")
def ha_suite(model_repository, tmp_path_factory):
    redis = RedisServer(tmp_path_factory.mktemp("ha-redis"))
    redis.start()
    try:
        overrides = _suite_overrides({"AIWORKS_SCHEDULER_TRAFFIC_POLL_S": "0.25"})
        suite = start_suite(model_repository, tmp_path_factory.mktemp("ha-logs") / "logs", schedulers=2,
                            redis_url=redis.url, **overrides)  # fmt: skip
    except Exception:
        redis.stop()
        raise
    suite.redis = redis
    yield suite
    suite.supervisor.stop()
    redis.stop()


def test_every_runtime_registers_with_both_schedulers(ha_suite):
    first, second = ha_suite.supervisor.scheduler_addresses
    assert live_replicas(ha_suite, first) == 2
    assert wait_for(lambda: live_replicas(ha_suite, second) == 2, 10, "the second scheduler's runtimes")


def test_schedulers_agree_on_a_policy_within_a_second(ha_suite):
    first, second = ha_suite.supervisor.scheduler_addresses
    set_weights(ha_suite, first, {"1": 90, "2": 10})
    started = time.monotonic()
    wait_for(lambda: get_weights(ha_suite, second) == {"1": 90, "2": 10}, 2, "the second scheduler to agree")
    took = time.monotonic() - started
    print(f"second scheduler agreed after {took * 1e3:.0f} ms")
    assert took < 1.0


def test_restarted_scheduler_keeps_its_weights_from_redis(ha_suite):
    sup = ha_suite.supervisor
    second = sup.scheduler_addresses[1]
    kill9(ha_suite, "scheduler-1")
    sup.restart("scheduler-1")
    assert wait_for(lambda: get_weights(ha_suite, second), 30, "the restarted scheduler") == {"1": 90, "2": 10}
    wait_for(lambda: live_replicas(ha_suite, second) == 2, 15, "the runtimes to register again")


async def test_kill_the_watched_scheduler_under_load_loses_nothing(ha_suite):
    sup = ha_suite.supervisor
    first, second = sup.scheduler_addresses
    stats = await load_through(ha_suite.grpc_url, clients=8, duration_s=9, during=lambda: kill9(ha_suite, "scheduler"))
    print(f"{stats['ok']} answered, {len(stats['failed'])} failed, longest gap {stats['gap_s'] * 1e3:.0f} ms, "
          f"versions {dict(stats['versions'])}")  # fmt: skip
    assert stats["failed"] == [], stats["failed"][:5]
    assert stats["ok"] > 100
    assert stats["gap_s"] < 5.0
    share = stats["versions"]["2"] / stats["ok"]  # the 90/10 weights held through the failover
    assert 0.05 <= share <= 0.15, stats["versions"]
    # The gateway watches the survivor now: a change made there reaches it (routing follows).
    set_weights(ha_suite, second, {"1": 0, "2": 1})
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if (await digits_versions(ha_suite.grpc_url, 5)) == Counter({"2": 5}):
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("the gateway did not pick up the survivor's weights within 5 s")
    print(f"weights from the surviving scheduler steered after {5 - (deadline - time.monotonic()):.1f} s")
    # The killed one comes back with the policies in Redis and its runtimes.
    sup.restart("scheduler")
    assert wait_for(lambda: get_weights(ha_suite, first), 30, "the restarted first scheduler") == {"1": 0, "2": 1}
