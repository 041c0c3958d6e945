"""The control loop round by round, against a fake platform, fake metrics and a fake clock."""

from __future__ import annotations

import asyncio

import pytest
from monitor_support import FakeClock, FakeCollector, FakePlatform, make_settings, runtime_target

from aiworks.core.errors import Unavailable
from aiworks.monitor import events as ev
from aiworks.monitor.controller import Controller
from aiworks.monitor.events import EventLog
from aiworks.monitor.platform import EjectResult


class Loop:
    """A controller wired to fakes, with helpers to run rounds."""

    def __init__(self, clock: FakeClock, replicas: int = 2, **settings):
        self.clock = clock
        self.platform = FakePlatform(replicas)
        self.metrics = FakeCollector()
        self.events = EventLog(100, wall_clock=clock)
        self.controller = Controller(make_settings(**settings), self.platform, self.metrics, self.events, clock=clock)
        for i in range(replicas):
            self.metrics.replica(f"runtime-{i}")
        self.metrics.queue_depth(0)
        self.metrics.requests(0.01, 0)

    async def rounds(self, n: int, before_each=None) -> None:
        for _ in range(n):
            if before_each is not None:
                before_each()
            await self.controller.tick()
            self.clock.advance(1.0)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events.since(0)]

    def of_kind(self, kind: str):
        return [e for e in self.events.since(0) if e.kind == kind]

    def counter(self, name: str, **labels) -> float:
        return self.controller.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
def loop(clock) -> Loop:
    return Loop(clock)


# ---- restarts --------------------------------------------------------------------------------------


async def test_a_dead_service_is_restarted_in_the_next_round(loop):
    await loop.rounds(2)
    assert loop.platform.restarts == []
    loop.platform.kill("runtime-1")
    await loop.rounds(1)
    assert loop.platform.restarts == ["runtime-1"]
    [event] = loop.of_kind(ev.RESTART)
    assert event.target == "runtime-1" and event.reason == "dead"
    assert "exited with code -9" in event.message
    assert loop.counter("aiworks_monitor_actions_total", action="restart", reason="dead") == 1
    await loop.rounds(3)
    assert loop.platform.restarts == ["runtime-1"]  # running again: nothing more to do


async def test_the_monitor_itself_and_a_grace_period_are_respected(clock):
    loop = Loop(clock, restart_grace_s=2.0)
    loop.platform.kill("monitor")
    loop.platform.kill("gateway")
    await loop.rounds(2)
    assert loop.platform.restarts == []  # dead for 0 s, then 1 s
    await loop.rounds(1)
    assert loop.platform.restarts == ["gateway"]  # never itself


async def test_a_crash_loop_is_given_up_after_restart_max_within_the_window(loop):
    for _ in range(5):
        loop.platform.kill("runtime-0")
        await loop.rounds(1)
    assert loop.platform.restarts == ["runtime-0"] * 3  # restart_max
    [gave_up] = loop.of_kind(ev.RESTART_GAVE_UP)
    assert gave_up.target == "runtime-0" and gave_up.reason == "crash_loop"
    loop.clock.advance(60)  # the window passes: it is tried again
    await loop.rounds(1)
    assert loop.platform.restarts == ["runtime-0"] * 4


async def test_a_failed_restart_is_an_event_and_is_tried_again(loop):
    loop.platform.kill("runtime-0")
    loop.platform.fail_with = Unavailable("the supervisor at http://127.0.0.1:1 is unreachable")
    await loop.rounds(1)
    [failed] = loop.of_kind(ev.ACTION_FAILED)
    assert failed.target == "runtime-0" and failed.details["action"] == "restart"
    assert failed.details["status"] == "unavailable"
    loop.platform.fail_with = None
    await loop.rounds(1)
    assert loop.platform.restarts == ["runtime-0"]


async def test_restarts_can_be_turned_off(clock):
    loop = Loop(clock, restart=False)
    loop.platform.kill("runtime-0")
    await loop.rounds(3)
    assert loop.platform.restarts == []


# ---- scaling ---------------------------------------------------------------------------------------


async def test_scale_out_after_sustained_queue_depth_not_before(loop):
    await loop.rounds(1)
    loop.metrics.queue_depth(50)  # 25 per replica, threshold 10
    await loop.rounds(5)  # overloaded for 0..4 s
    assert loop.platform.scales == []
    await loop.rounds(1)  # 5 s
    assert loop.platform.scales == [("runtime", 3)]
    [event] = loop.of_kind(ev.SCALE_OUT)
    assert event.target == "runtime" and event.reason == "queue_depth"
    assert event.details["replicas"] == 3 and event.details["previous"] == 2
    assert event.details["queue_per_replica"] == 25.0
    assert loop.counter("aiworks_monitor_actions_total", action="scale_out", reason="queue_depth") == 1


async def test_a_dip_in_the_queue_does_not_end_an_overload_but_a_lasting_drop_does(loop):
    # The queue gauge is a sawtooth under real overload: single low readings are expected.
    depths = iter([50, 50, 0, 50, 50, 0, 50])
    await loop.rounds(7, before_each=lambda: loop.metrics.queue_depth(next(depths)))
    assert loop.platform.scales == [("runtime", 3)]  # 5 s after the first high reading, average 36 per replica


async def test_an_overload_that_ends_restarts_the_sustain_period(loop):
    loop.metrics.queue_depth(30)
    await loop.rounds(3)
    loop.metrics.queue_depth(0)
    await loop.rounds(4)  # the 5 s average falls to 9 per replica, under 10: the overload is over
    loop.metrics.queue_depth(30)
    await loop.rounds(5)
    assert loop.platform.scales == []
    await loop.rounds(1)
    assert loop.platform.scales == [("runtime", 3)]


async def test_mostly_light_load_with_short_bursts_does_not_scale_out(loop):
    depths = iter([30, 0, 0, 0, 0, 0] * 10)  # 30 every 6 s: 2.5 per replica on average
    await loop.rounds(60, before_each=lambda: loop.metrics.queue_depth(next(depths)))
    assert loop.platform.scales == []


async def test_scale_out_on_sustained_p99_latency(loop):
    await loop.rounds(1)
    await loop.rounds(6, before_each=lambda: loop.metrics.requests(2.0, 20))  # p99 about 2 s, threshold 0.5 s
    assert loop.platform.scales == [("runtime", 3)]
    [event] = loop.of_kind(ev.SCALE_OUT)
    assert event.reason == "p99_latency"
    assert 1.0 <= event.details["p99_s"] <= 2.5


async def test_scale_out_cool_down_and_max_replicas(loop):
    loop.metrics.queue_depth(100)
    await loop.rounds(6)
    assert loop.platform.scales == [("runtime", 3)]
    await loop.rounds(19)  # still overloaded, but within the 20 s cool-down
    assert loop.platform.scales == [("runtime", 3)]
    await loop.rounds(30)
    assert loop.platform.scales == [("runtime", 3)]  # max_replicas 3: no further
    assert len(loop.platform.runtime_names()) == 3


async def test_cool_down_counts_from_the_last_scaling(clock):
    loop = Loop(clock, max_replicas=5)
    loop.metrics.queue_depth(100)
    await loop.rounds(6)  # t=5: out to 3
    await loop.rounds(20)  # t=25: cool-down (20 s) over and overloaded since t=6 -> out to 4
    assert loop.platform.scales == [("runtime", 3), ("runtime", 4)]
    times = [e.ts for e in loop.of_kind(ev.SCALE_OUT)]
    assert times[1] - times[0] == 20.0


async def test_scale_in_after_a_quiet_period_down_to_min(clock):
    loop = Loop(clock, replicas=3, min_replicas=2)
    await loop.rounds(30)  # quiet from t=0, 0..29 s
    assert loop.platform.scales == []
    await loop.rounds(1)  # 30 s quiet
    assert loop.platform.scales == [("runtime", 2)]
    [event] = loop.of_kind(ev.SCALE_IN)
    assert event.reason == "quiet" and event.details["replicas"] == 2
    await loop.rounds(120)
    assert loop.platform.scales == [("runtime", 2)]  # min_replicas 2


async def test_load_blocks_scale_in(clock):
    loop = Loop(clock, replicas=3)
    loop.metrics.queue_depth(9)  # 3 per replica: not quiet (1), not overloaded (10)
    await loop.rounds(100)
    assert loop.platform.scales == []


async def test_scale_out_then_back_in_when_the_load_stops(clock):
    loop = Loop(clock, replicas=1, scale_in_sustain_s=10.0, scale_in_cooldown_s=15.0)
    loop.metrics.queue_depth(30)
    await loop.rounds(6)
    assert loop.platform.scales == [("runtime", 2)]
    loop.metrics.queue_depth(0)
    await loop.rounds(14)  # quiet 10 s, but only 14 s since scaling out (cool-down 15)
    assert loop.platform.scales == [("runtime", 2)]
    await loop.rounds(1)
    assert loop.platform.scales == [("runtime", 2), ("runtime", 1)]
    assert loop.kinds().count(ev.SCALE_OUT) == 1 and loop.kinds().count(ev.SCALE_IN) == 1


async def test_no_queue_reading_means_no_scaling(loop):
    loop.metrics.queue_depth(100)
    loop.metrics.down.add(runtime_target(0))  # the replica holding the queue cannot be scraped
    await loop.rounds(20)
    assert loop.platform.scales == []


async def test_autoscaling_can_be_turned_off(clock):
    loop = Loop(clock, autoscale=False)
    loop.metrics.queue_depth(100)
    await loop.rounds(20)
    assert loop.platform.scales == []


# ---- ejection --------------------------------------------------------------------------------------


async def test_a_replica_that_keeps_failing_is_ejected_through_the_platform(loop):
    await loop.rounds(1)

    def traffic():
        loop.metrics.executions(0, ok=10)
        loop.metrics.executions(1, ok=1, failed=2)

    await loop.rounds(2, before_each=traffic)  # 4 failed of 6: under eject_min_errors
    assert loop.platform.ejects == []
    await loop.rounds(1, before_each=traffic)  # 6 failed of 9
    [(replica, duration_s, reason)] = loop.platform.ejects
    assert replica == "runtime-1" and duration_s == 30.0
    assert "6 of 9 batches failed" in reason
    [event] = loop.of_kind(ev.EJECT)
    assert event.target == "runtime-1" and event.reason == "errors"
    assert "ejected runtime-1 for 30 s" in event.message
    assert loop.counter("aiworks_monitor_actions_total", action="eject", reason="errors") == 1
    # Asked once: not again while the scheduler's gauge catches up or the replica is out.
    await loop.rounds(3, before_each=traffic)
    loop.metrics.replica("runtime-1", ejected=True)
    await loop.rounds(10, before_each=traffic)
    assert len(loop.platform.ejects) == 1


async def test_a_healthy_error_share_is_not_ejected(loop):
    await loop.rounds(1)
    await loop.rounds(20, before_each=lambda: loop.metrics.executions(1, ok=20, failed=1))
    assert loop.platform.ejects == []


async def test_a_refused_ejection_is_an_event(loop):
    loop.platform.eject_result = EjectResult(False, 0.0, "would exceed the maximum ejection percentage")
    await loop.rounds(1)
    await loop.rounds(3, before_each=lambda: loop.metrics.executions(0, failed=3))
    [refused] = loop.of_kind(ev.EJECT_REFUSED)
    assert refused.target == "runtime-0" and "maximum ejection percentage" in refused.message
    assert loop.of_kind(ev.EJECT) == []


# ---- health, anomalies and reports -----------------------------------------------------------------


async def test_health_scores_rank_replicas_and_reach_the_metrics(clock):
    loop = Loop(clock, replicas=3)
    await loop.rounds(1)

    def traffic():
        loop.metrics.executions(0, ok=10)
        loop.metrics.executions(1, ok=6, failed=4)

    await loop.rounds(2, before_each=traffic)
    loop.metrics.replica("runtime-2", up=False)
    await loop.rounds(1, before_each=traffic)
    health = loop.controller.health
    assert health["runtime-0"].score == 100.0
    assert 0 < health["runtime-1"].score < health["runtime-0"].score
    assert health["runtime-2"].score == 0.0
    registry = loop.controller.metrics.registry
    assert registry.get_sample_value("aiworks_monitor_replica_health_score", {"replica": "runtime-2"}) == 0.0
    assert registry.get_sample_value("aiworks_monitor_runtime_replicas", {"state": "desired"}) == 3
    report = loop.controller.report()
    assert [r["replica"] for r in report["replicas"]] == ["runtime-0", "runtime-1", "runtime-2"]
    assert report["pools"][0]["queue_depth"] == 0


async def test_a_latency_spike_is_reported_once_as_an_anomaly_event(loop):
    await loop.rounds(1)
    await loop.rounds(15, before_each=lambda: loop.metrics.compute(0, 0.010, 10))
    assert loop.of_kind(ev.ANOMALY) == []
    await loop.rounds(3, before_each=lambda: loop.metrics.compute(0, 0.080, 10))
    [event] = loop.of_kind(ev.ANOMALY)
    assert event.target == "runtime-0" and event.reason == "latency_spike"
    assert event.details["ratio"] >= 3
    assert loop.counter("aiworks_monitor_anomalies_total", kind="latency_spike", replica="runtime-0") == 1
    assert loop.controller.report()["replicas"][0]["anomalies"] == ["latency_spike"]


async def test_a_dead_target_is_skipped_not_fatal(loop):
    loop.metrics.down.add("127.0.0.1:9100")
    obs = await loop.controller.tick()
    assert obs is not None and obs.replicas["runtime-0"].rss_bytes is None
    assert sorted(loop.metrics.asked[0]) == sorted(
        ["127.0.0.1:9001", "127.0.0.1:9002", "127.0.0.1:9100", "127.0.0.1:9101"]
    )


async def test_discovery_failure_skips_the_round(loop):
    async def broken():
        raise Unavailable("supervisor unreachable")

    loop.platform.inventory = broken
    assert await loop.controller.tick() is None
    assert loop.events.since(0) == []


async def test_the_loop_runs_rounds_until_stopped_and_survives_a_broken_round(clock):
    loop = Loop(clock, interval_s=0.01)
    rounds = []
    real_inventory = loop.platform.inventory

    async def inventory():
        rounds.append(len(rounds))
        if len(rounds) == 2:
            raise RuntimeError("a bug in one round")
        return await real_inventory()

    loop.platform.inventory = inventory
    stop = asyncio.Event()
    task = asyncio.ensure_future(loop.controller.run(stop))
    while len(rounds) < 5:
        await asyncio.sleep(0.01)
    stop.set()
    await asyncio.wait_for(task, 5)
    assert loop.controller.last is not None  # rounds after the broken one went on
