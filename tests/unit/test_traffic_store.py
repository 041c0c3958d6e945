"""Traffic policies that outlive the scheduler: the state file, restore and seed (Redis: tests/integration)."""

from __future__ import annotations

import asyncio
import json

import pytest
from routing_support import FakeReplica, make, spec

from aiworks.core.errors import Unavailable
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.server import seed_policies
from aiworks.scheduler.settings import SchedulerSettings
from aiworks.scheduler.traffic_state import ShadowPolicy, TrafficPolicy
from aiworks.scheduler.traffic_store import FileTrafficStore, policy_from_json, policy_to_json

CANARY = TrafficPolicy("m", {"1": 90, "2": 10}, ShadowPolicy("2", 0.5, "argmax", 0.0))


def test_a_policy_round_trips_through_json():
    assert policy_from_json(json.loads(json.dumps(policy_to_json(CANARY)))) == CANARY


async def test_the_state_file_keeps_policies_and_drops_cleared_ones(tmp_path):
    path = tmp_path / "state" / "traffic.json"
    store = FileTrafficStore(path)
    assert await store.load() == {}
    await store.save(CANARY)
    await store.save(TrafficPolicy("other", {"3": 1}))
    await store.save(TrafficPolicy("other"))  # an empty policy clears the model's
    assert await FileTrafficStore(path).load() == {"m": CANARY}
    assert [p.name for p in path.parent.iterdir()] == ["traffic.json"]  # no temporary file left behind


async def test_a_broken_state_file_starts_empty_and_an_unwritable_one_refuses(tmp_path):
    path = tmp_path / "traffic.json"
    path.write_text("{not json")
    store = FileTrafficStore(path)
    assert await store.load() == {}
    path.unlink()
    path.mkdir()  # cannot be replaced by a file
    with pytest.raises(Unavailable, match="cannot store the traffic policy"):
        await store.save(CANARY)


async def test_scheduler_restores_stored_policies_and_reconciles_the_seed(tmp_path):
    path = tmp_path / "traffic.json"

    async def start(seed: dict) -> Scheduler:
        registry = ReplicaRegistry(lambda a: FakeReplica(a))
        registry.register("r", "r", "cpu", {}, [spec("1"), spec("2")])
        scheduler = Scheduler(SchedulerSettings(), registry, store=FileTrafficStore(path))
        await scheduler.restore_traffic(seed_policies(seed))
        return scheduler

    first = await start({"m": {"1": 90, "2": 10}, "quiet": {"1": 0}})
    assert first.get_traffic("m").weights == {"1": 90, "2": 10}  # seeded, and stored
    assert first.get_traffic("quiet").empty  # all-zero seed weights: no policy
    await first.store_traffic(TrafficPolicy("m", {"1": 0, "2": 1}))  # the operator rolls forward
    again = await start({"m": {"1": 90, "2": 10}})  # restarted, same chart values
    assert again.get_traffic("m").weights == {"1": 0, "2": 1}  # the stored policy wins over the same seed
    changed = await start({"m": {"1": 80, "2": 20}})  # helm upgrade with a new canary weight
    assert changed.get_traffic("m").weights == {"1": 80, "2": 20}
    assert (await FileTrafficStore(path).load())["m"].weights == {"1": 80, "2": 20}


async def test_a_stored_policy_steers_the_gateways_table():
    suite = make({"a": FakeReplica("a")}, [spec("1"), spec("2")])
    changed = suite.scheduler.apply_stored({"m": TrafficPolicy("m", {"1": 0, "2": 1})})
    suite.sync()
    assert changed == 1
    assert {suite.dispatcher.resolve("m", "").version for _ in range(5)} == {"2"}
    assert suite.scheduler.apply_stored({}) == 1  # cleared elsewhere: cleared here
    suite.sync()
    assert suite.dispatcher.resolve("m", "").version == "2"  # the latest, with no policy


async def test_a_fresh_scheduler_holds_the_first_table_until_the_runtimes_registered_or_the_grace_ends():
    now = [100.0]
    registry = ReplicaRegistry(lambda a: FakeReplica(a), clock=lambda: now[0])
    settings = SchedulerSettings(startup_grace_s=5.0, heartbeat_interval_s=1.0)
    scheduler = Scheduler(settings, registry, clock=lambda: now[0])
    waiting = asyncio.ensure_future(scheduler.warmed_up(poll_s=0.001))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # no replica yet, within the grace
    registry.register("r", "r", "cpu", {}, [spec("1")])
    await asyncio.sleep(0.01)
    assert not waiting.done()  # one runtime back, but the others may be a heartbeat behind it
    now[0] += 2.0
    registry.register("s", "s", "cpu", {}, [spec("2")])
    await asyncio.sleep(0.01)
    assert not waiting.done()
    now[0] += 1.0  # two heartbeats and a reconnect backoff since start: every running runtime had its turn
    await asyncio.wait_for(waiting, 1)
    assert {r.replica_id for r in registry.live()} == {"r", "s"}
    empty = Scheduler(SchedulerSettings(startup_grace_s=2.0), ReplicaRegistry(lambda a: FakeReplica(a)),
                      clock=lambda: now[0])  # fmt: skip
    waiting = asyncio.ensure_future(empty.warmed_up(poll_s=0.001))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    now[0] += 2.5  # the grace is over: an empty cluster gets its (empty) table
    await asyncio.wait_for(waiting, 1)
