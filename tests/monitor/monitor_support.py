"""Fakes for the monitor's unit tests: clock, platform and metrics.

The fake platform behaves like the supervisor would (a restart makes a dead
service run again, scaling adds or removes runtime services) and records
every call, so tests assert on what the control loop asked for. The fake
collector hands out samples the way a scrape would: counters that only grow,
gauges, and cumulative histogram buckets.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from aiworks.core.errors import AIWorksError
from aiworks.core.metrics import LATENCY_BUCKETS_S
from aiworks.monitor import collect as c
from aiworks.monitor.collect import Sample
from aiworks.monitor.discovery import DEAD, LOCAL_POOL, RUNNING, Inventory, Pool, Service
from aiworks.monitor.platform import EjectResult, Platform
from aiworks.monitor.settings import MonitorSettings

SCHEDULER = "127.0.0.1:9001"
GATEWAY = "127.0.0.1:9002"


def runtime_target(i: int) -> str:
    return f"127.0.0.1:{9100 + i}"


def make_settings(**overrides) -> MonitorSettings:
    """Settings with round numbers the tests reason about (1 s rounds)."""
    values = dict(
        scheduler_address="127.0.0.1:1",
        interval_s=1.0,
        min_replicas=1,
        max_replicas=3,
        scale_out_queue_depth=10.0,
        scale_out_p99_s=0.5,
        scale_out_sustain_s=5.0,
        scale_out_cooldown_s=20.0,
        scale_in_queue_depth=1.0,
        scale_in_sustain_s=30.0,
        scale_in_cooldown_s=30.0,
        eject_window_s=10.0,
        eject_min_errors=5,
        eject_error_ratio=0.5,
        eject_duration_s=30.0,
        restart_max=3,
        restart_window_s=60.0,
    )
    values.update(overrides)
    return MonitorSettings(**values)


class FakeClock:
    """Monotonic seconds that move only when told."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakePlatform(Platform):
    """A local suite in memory: scheduler, gateway and runtime-0..n-1."""

    name = "fake"

    def __init__(self, replicas: int = 2):
        self.services: dict[str, Service] = {
            "scheduler": Service("scheduler", "scheduler", RUNNING, SCHEDULER),
            "gateway": Service("gateway", "gateway", RUNNING, GATEWAY),
            "monitor": Service("monitor", "monitor", RUNNING, None),
        }
        for i in range(replicas):
            self._add_runtime(i)
        self.restarts: list[str] = []
        self.scales: list[tuple[str, int]] = []
        self.ejects: list[tuple[str, float, str]] = []
        self.eject_result = EjectResult(True, 30.0, "ejected")
        self.fail_with: AIWorksError | None = None

    def _add_runtime(self, i: int) -> None:
        name = f"runtime-{i}"
        self.services[name] = Service(name, "runtime", RUNNING, runtime_target(i), name, LOCAL_POOL)

    def runtime_names(self) -> list[str]:
        return [n for n, s in self.services.items() if s.kind == "runtime"]

    def kill(self, name: str) -> None:
        svc = self.services[name]
        self.services[name] = Service(svc.name, svc.kind, DEAD, svc.metrics_address, svc.replica_id, svc.pool,
                                      "exited with code -9")  # fmt: skip

    async def inventory(self) -> Inventory:
        desired = len(self.runtime_names())
        return Inventory(tuple(self.services.values()), (Pool(LOCAL_POOL, desired),))

    def _maybe_fail(self) -> None:
        if self.fail_with is not None:
            raise self.fail_with

    async def restart(self, service: Service) -> str:
        self._maybe_fail()
        self.restarts.append(service.name)
        self.services[service.name] = Service(
            service.name, service.kind, RUNNING, service.metrics_address, service.replica_id, service.pool
        )
        return f"restarted {service.name}"

    async def scale(self, pool: str, replicas: int) -> None:
        self._maybe_fail()
        self.scales.append((pool, replicas))
        names = self.runtime_names()
        for i in range(len(names), replicas):
            self._add_runtime(i)
        for name in names[replicas:]:
            del self.services[name]

    async def eject(self, replica_id: str, duration_s: float, reason: str) -> EjectResult:
        self._maybe_fail()
        self.ejects.append((replica_id, duration_s, reason))
        return self.eject_result


def _labels_key(labels: dict[str, str]) -> tuple:
    return tuple(sorted(labels.items()))


class FakeCollector:
    """Samples per target, changed by the test between rounds."""

    def __init__(self) -> None:
        self.series: dict[str, dict[tuple, float]] = {}
        self.down: set[str] = set()
        self.asked: list[list[str]] = []

    def set(self, target: str, name: str, value: float, **labels: str) -> None:
        self.series.setdefault(target, {})[(name, _labels_key(labels))] = value

    def inc(self, target: str, name: str, by: float = 1.0, **labels: str) -> None:
        key = (name, _labels_key(labels))
        series = self.series.setdefault(target, {})
        series[key] = series.get(key, 0.0) + by

    # ---- the suite's metrics, in its own names ----

    def queue_depth(self, depth: float, model: str = "digits", replica: int = 0) -> None:
        """``depth`` requests queued on runtime ``replica`` (the queues live in the runtimes)."""
        self.set(runtime_target(replica), c.QUEUE_DEPTH, depth, model=model, version="2", priority="standard")

    def replica(self, replica: str, up: bool = True, ejected: bool = False, inflight: float = 0.0) -> None:
        self.set(SCHEDULER, c.REPLICA_UP, 1.0 if up else 0.0, replica=replica, device="cpu")
        self.set(SCHEDULER, c.REPLICA_EJECTED, 1.0 if ejected else 0.0, replica=replica)
        self.set(SCHEDULER, c.REPLICA_INFLIGHT, inflight, replica=replica)

    def executions(self, i: int, ok: float = 0.0, failed: float = 0.0, model: str = "iris") -> None:
        if ok:
            self.inc(runtime_target(i), c.RUNTIME_EXECUTIONS, ok, model=model, version="1", status="ok")
        if failed:
            self.inc(runtime_target(i), c.RUNTIME_EXECUTIONS, failed, model=model, version="1", status="internal")

    def compute(self, i: int, seconds_per_batch: float, batches: float, model: str = "iris") -> None:
        t = runtime_target(i)
        self.inc(t, c.RUNTIME_COMPUTE_SUM, seconds_per_batch * batches, model=model, version="1")
        self.inc(t, c.RUNTIME_COMPUTE_COUNT, batches, model=model, version="1")

    def rss(self, i: int, rss_bytes: float) -> None:
        self.set(runtime_target(i), c.PROCESS_RSS, rss_bytes)

    def requests(self, latency_s: float, count: int, model: str = "digits") -> None:
        """``count`` gateway requests that took ``latency_s`` each (cumulative buckets, as exposed)."""
        for le in (*LATENCY_BUCKETS_S, math.inf):
            if latency_s <= le:
                le_text = "+Inf" if math.isinf(le) else repr(le)
                self.inc(GATEWAY, c.GATEWAY_DURATION_BUCKET, count, model=model, version="2", tenant="",
                         protocol="grpc", le=le_text)  # fmt: skip

    async def collect(self, targets: Sequence[str]) -> dict[str, list[Sample]]:
        self.asked.append(list(targets))
        return {
            t: [Sample(name, dict(labels), value) for (name, labels), value in self.series.get(t, {}).items()]
            for t in targets
            if t not in self.down
        }

    async def close(self) -> None:
        pass
