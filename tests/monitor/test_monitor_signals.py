"""From exposition text or a Prometheus answer to per-replica and per-pool signals."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from aiworks.core.metrics import LATENCY_BUCKETS_S
from aiworks.monitor import collect as c
from aiworks.monitor.collect import PrometheusCollector, Sample, group_by_instance, parse_exposition
from aiworks.monitor.discovery import LOCAL_POOL, RUNNING, Inventory, Pool, Service
from aiworks.monitor.signals import Observer, histogram_quantile


def runtime_exposition(ok: int, failed: int, invalid: int = 0, rss: float = 1e8) -> str:
    """What a runtime's /metrics looks like, made by prometheus_client with the catalogue's names."""
    registry = CollectorRegistry()
    executions = Counter("aiworks_runtime_executions", "", ["model", "version", "status"], registry=registry)
    compute = Histogram(
        "aiworks_runtime_compute_duration_seconds", "", ["model", "version"], buckets=LATENCY_BUCKETS_S,
        registry=registry,
    )  # fmt: skip
    Gauge("process_resident_memory_bytes", "", registry=registry).set(rss)
    Gauge("aiworks_runtime_inflight_batches", "", ["replica"], registry=registry).labels("runtime-0").set(2)
    Counter("unrelated_total", "", registry=registry).inc()
    executions.labels("iris", "1", "ok").inc(ok)
    executions.labels("iris", "1", "internal").inc(failed)
    executions.labels("iris", "1", "invalid_argument").inc(invalid)
    for _ in range(ok):
        compute.labels("iris", "1").observe(0.004)
    return generate_latest(registry).decode()


def test_parse_exposition_keeps_only_what_the_monitor_reads():
    samples = parse_exposition(runtime_exposition(ok=3, failed=1))
    names = {s.name for s in samples}
    assert names <= set(c.READ)
    assert c.RUNTIME_EXECUTIONS in names and c.PROCESS_RSS in names and "unrelated_total" not in names
    ok = next(s for s in samples if s.name == c.RUNTIME_EXECUTIONS and s.labels["status"] == "ok")
    assert ok.value == 3.0 and ok.labels["model"] == "iris"


@pytest.mark.parametrize(
    ("buckets", "q", "expected"),
    [
        ([(0.1, 0), (0.5, 100), (math.inf, 100)], 0.99, 0.1 + 0.4 * 0.99),
        ([(0.1, 50), (0.5, 100), (math.inf, 100)], 0.5, 0.1),
        ([(0.1, 0), (1.0, 0), (math.inf, 10)], 0.99, 1.0),  # in +Inf: the largest finite bound
        ([(0.1, 0), (math.inf, 0)], 0.99, None),  # no observations
        ([], 0.99, None),
    ],
)
def test_histogram_quantile(buckets, q, expected):
    got = histogram_quantile(q, buckets)
    assert got == (pytest.approx(expected) if expected is not None else None)


def inventory() -> Inventory:
    return Inventory(
        (
            Service("scheduler", "scheduler", RUNNING, "s:1"),
            Service("gateway", "gateway", RUNNING, "g:1"),
            Service("runtime-0", "runtime", RUNNING, "r0:1", "runtime-0", LOCAL_POOL),
        ),
        (Pool(LOCAL_POOL, 1),),
    )


def test_observer_turns_counters_into_per_round_changes_and_survives_a_restart():
    obs = Observer()
    first = obs.observe(0.0, inventory(), {"r0:1": parse_exposition(runtime_exposition(ok=100, failed=5))})
    r = first.replicas["runtime-0"]
    assert (r.ok, r.failed) == (0.0, 0.0)  # the first read of a target: its past is not this round's
    assert r.rss_bytes == 1e8 and r.inflight == 2
    second = obs.observe(1.0, inventory(), {"r0:1": parse_exposition(runtime_exposition(ok=110, failed=8, invalid=4))})
    r = second.replicas["runtime-0"]
    assert (r.ok, r.failed) == (10.0, 3.0)  # invalid_argument is the request's fault, not the replica's
    assert r.latency_s == pytest.approx(0.004)
    restarted = obs.observe(2.0, inventory(), {"r0:1": parse_exposition(runtime_exposition(ok=2, failed=0))})
    assert restarted.replicas["runtime-0"].ok == 2.0  # counters went down: a new process, all of it is new


def test_pool_signals_from_runtime_scheduler_and_gateway_samples():
    obs = Observer()
    bucket = c.GATEWAY_DURATION_BUCKET

    def gateway(count_fast: float, count_slow: float) -> list[Sample]:
        out = []
        for le in ("0.01", "1.0", "+Inf"):
            n = count_fast + (count_slow if le != "0.01" else 0)
            out.append(Sample(bucket, {"model": "digits", "le": le}, n))
        out.append(Sample(bucket, {"model": "iris", "le": "+Inf"}, 1000.0))
        return out

    def runtime(depth: float) -> list[Sample]:  # the queues are in the runtime replicas
        return [
            Sample(c.QUEUE_DEPTH, {"model": "digits", "version": "2", "priority": "standard"}, depth),
            Sample(c.QUEUE_DEPTH, {"model": "iris", "version": "1", "priority": "batch"}, 1.0),
        ]

    def scheduler() -> list[Sample]:
        return [
            Sample(c.REPLICA_UP, {"replica": "runtime-0", "device": "cpu"}, 1.0),
            Sample(c.REPLICA_EJECTED, {"replica": "runtime-0"}, 1.0),
            Sample(c.REPLICA_UP, {"replica": "by-hand", "device": "cpu"}, 1.0),
            Sample(c.REPLICA_LATENCY, {"replica": "by-hand"}, 0.03),
        ]

    obs.observe(0.0, inventory(), {"s:1": scheduler(), "g:1": gateway(0, 0), "r0:1": runtime(0)})
    o = obs.observe(1.0, inventory(), {"s:1": scheduler(), "g:1": gateway(90, 10), "r0:1": runtime(40)})
    pool = o.pools[LOCAL_POOL]
    assert pool.queue_depth == 41 and pool.running == 1 and pool.desired == 1
    assert pool.requests == 100 and 0.01 < pool.p99_s <= 1.0
    assert o.replicas["runtime-0"].ejected and o.replicas["runtime-0"].up
    by_hand = o.replicas["by-hand"]  # known to the scheduler only
    assert by_hand.service is None and by_hand.latency_s == 0.03 and by_hand.state == RUNNING
    # A pool of one model counts only that model's queue and requests.
    digits = Inventory(inventory().services, (Pool("digits-pool", 2, ("digits",)),))
    o = obs.observe(2.0, digits, {"s:1": scheduler(), "g:1": gateway(190, 10), "r0:1": runtime(7)})
    assert o.pools["digits-pool"].queue_depth == 7 and o.pools["digits-pool"].requests == 100
    # The replicas unreadable: no queue reading at all (not zero).
    o = obs.observe(3.0, inventory(), {"s:1": scheduler(), "g:1": gateway(190, 10)})
    assert o.pools[LOCAL_POOL].queue_depth is None and o.pools[LOCAL_POOL].p99_s is None


def test_a_prometheus_answer_is_grouped_by_instance():
    answer = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [
                {"metric": {"__name__": c.PROCESS_RSS, "instance": "10.0.0.5:8021", "job": "runtime"},
                 "value": [1700000000.0, "123456"]},
                {"metric": {"__name__": c.RUNTIME_EXECUTIONS, "instance": "10.0.0.5:8021", "job": "runtime",
                            "model": "iris", "status": "ok"}, "value": [1700000000.0, "42"]},
                {"metric": {"__name__": c.PROCESS_RSS, "instance": "10.0.0.9:8021"}, "value": [0, "1"]},
            ],
        },
    }  # fmt: skip
    grouped = group_by_instance(answer, ["10.0.0.5:8021", "10.0.0.7:8011"])
    assert list(grouped) == ["10.0.0.5:8021"]  # only the targets discovery knows
    rss, executions = grouped["10.0.0.5:8021"]
    assert rss == Sample(c.PROCESS_RSS, {}, 123456.0)
    assert executions.labels == {"model": "iris", "status": "ok"}
    assert group_by_instance({"status": "error", "error": "bad query"}, ["x"]) == {}


def test_the_prometheus_query_asks_for_every_series_read():
    assert PrometheusCollector.QUERY.startswith('{__name__=~"') and all(n in PrometheusCollector.QUERY for n in c.READ)
