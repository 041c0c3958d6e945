"""The control plane and a gateway's routing: versions, replicas, failover, and the registry's clock."""

import asyncio
import time

import pytest
from routing_support import FakeReplica, make, spec

from aiworks.core.errors import InvalidArgument, NotFound, Unavailable
from aiworks.scheduler.registry import ReplicaRegistry


async def test_both_replicas_serve():
    a, b = FakeReplica("a", delay_s=0.01), FakeReplica("b", delay_s=0.01)
    suite = make({"a": a, "b": b})
    await asyncio.gather(*(suite.infer() for _ in range(10)))
    assert a.batches and b.batches and a.batches + b.batches == 10


async def test_a_failing_replica_is_retried_elsewhere():
    good, bad = FakeReplica("good"), FakeReplica("bad")
    bad.fail_next = 100
    bad.fail_with = Unavailable("connection refused")
    suite = make({"bad": bad, "good": good})
    for _ in range(4):
        answer = await suite.infer()
        assert answer.outputs[0].shape == (1, 2)
    assert good.batches == 4


async def test_errors_from_the_model_are_not_retried():
    replica = FakeReplica("r0")
    replica.fail_next = 1
    replica.fail_with = InvalidArgument("bad batch")
    suite = make({"r0": replica})
    with pytest.raises(InvalidArgument, match="bad batch"):
        await suite.infer()


async def test_unknown_model_version_and_no_replica():
    suite = make({"r0": FakeReplica("r0")})
    with pytest.raises(InvalidArgument, match="Request for unknown model: 'nope' is not found"):
        await suite.infer(model="nope")
    with pytest.raises(NotFound, match="Request for unknown model: 'm' version 9 is not found"):
        await suite.infer("9")
    suite.registry.mark_down(suite.registry.replicas["r0"], "test")
    suite.sync()
    with pytest.raises(Unavailable, match="no live replica"):
        await suite.infer()


async def test_latest_version_is_the_default():
    suite = make({"r0": FakeReplica("r0")}, [spec(version="1"), spec(version="10"), spec(version="2")])
    assert suite.dispatcher.resolve("m", "").version == "10"


async def test_a_version_being_loaded_shows_once_every_replica_has_it():
    a, b = FakeReplica("a"), FakeReplica("b")
    suite = make({"a": a, "b": b})
    suite.scheduler._loading["m"] = {("m", "1")}  # a reload of m is in progress
    suite.registry.set_models(suite.registry.replicas["a"], [spec("1"), spec("2")])
    suite.sync()
    assert suite.dispatcher.resolve("m", "").version == "1"  # replica b has not loaded v2 yet
    del suite.scheduler._loading["m"]
    suite.sync()
    assert suite.dispatcher.resolve("m", "").version == "2"


async def test_heartbeat_expiry_uses_the_clock():
    now = [0.0]
    registry = ReplicaRegistry(lambda a: FakeReplica(a), clock=lambda: now[0])
    registry.register("r0", "x", "cpu", {}, [spec()])
    now[0] = 2.0
    assert registry.expire(3.0) == []
    now[0] = 3.5
    assert registry.expire(3.0) == ["r0"]
    assert registry.heartbeat("r0", []) is False  # the replica must register again


async def test_silence_counts_only_while_the_scheduler_listens():
    now = [0.0]
    registry = ReplicaRegistry(lambda a: FakeReplica(a), clock=lambda: now[0])
    registry.register("r0", "x", "cpu", {}, [spec()])
    now[0] = 5.0  # silent for 5 s, but the scheduler itself ran again only at 4.0
    assert registry.expire(3.0, listening_since=4.0) == []
    now[0] = 7.5
    assert registry.expire(3.0, listening_since=4.0) == ["r0"]  # silent 3.5 s of listening


async def test_a_stalled_scheduler_keeps_its_replicas_then_expires_a_silent_one():
    """A scheduler that did not run for longer than the heartbeat timeout would, on waking, remove every
    replica before reading the heartbeats waiting for it, and gateways would answer "no live replica"."""
    suite = make({"r0": FakeReplica("r0")}, heartbeat_timeout_s=0.6, heartbeat_interval_s=0.25)
    loop = asyncio.create_task(suite.scheduler.expire_loop())
    try:
        await asyncio.sleep(0.2)
        suite.registry.heartbeat("r0", [spec()])
        time.sleep(1.5)  # the scheduler's loop stalls: heartbeats sent meanwhile would wait unread
        await asyncio.sleep(0.05)  # the overdue expiry runs first
        assert "r0" in suite.registry.replicas  # its silence is judged from the wake-up, not its last heartbeat
        deadline = time.monotonic() + 10
        while "r0" in suite.registry.replicas and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert "r0" not in suite.registry.replicas  # silent longer than the timeout while the scheduler listened
    finally:
        loop.cancel()


async def test_a_stopping_replica_is_routed_nothing_new_until_it_registers_again():
    now = [0.0]
    registry = ReplicaRegistry(lambda a: FakeReplica(a), clock=lambda: now[0])
    registry.register("r0", "x", "cpu", {}, [spec()])
    registry.register("r1", "y", "cpu", {}, [spec()])
    generation = registry.generation
    assert registry.heartbeat("r0", [spec()], stopping=True) is True
    assert [r.replica_id for r in registry.live()] == ["r1"] and registry.generation > generation
    assert registry.replicas["r0"].stopping
    assert registry.heartbeat("r0", [spec()], stopping=True) is True  # its next beats change nothing
    assert registry.heartbeat("r0", [spec()]) is True and not registry.replicas["r0"].live  # no "back" from stopping
    now[0] = 10.0
    registry.heartbeat("r1", [spec()])
    assert registry.expire(3.0) == ["r0"]  # its heartbeats ended when it exited
    registry.register("r0", "x", "cpu", {}, [spec()])  # a new process under the same id
    assert registry.replicas["r0"].live and not registry.replicas["r0"].stopping
