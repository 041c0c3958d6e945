"""The metric helpers, each service's scrape-time collector, and what the request paths observe."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from aiworks.cache.dataplane import CacheDataPlane
from aiworks.cache.server import CacheCollector
from aiworks.cache.store import MemoryStore
from aiworks.gateway.telemetry import GatewayTelemetry
from aiworks.runtime.collector import RuntimeCollector
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.repository import ModelRepository
from aiworks.runtime.triton_backend import parse_device_metrics
from aiworks.scheduler.collector import SchedulerCollector
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.settings import SchedulerSettings
from onnx import TensorProto, helper
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aiworks.core import metrics
from aiworks.core.datatypes import Tensor
from aiworks.core.errors import DeadlineExceeded, InvalidArgument, NotFound, Status
from aiworks.core.inference import InferRequest, InferResponse
from aiworks.core.model_config import BatchingConfig, ModelSpec, TensorSpec

TRITON_METRICS = Path(__file__).parent.parent / "tritonserver" / "testdata" / "gpu_metrics.txt"


def scrape(*collectors) -> dict[tuple[str, tuple], float]:
    """Samples of ``collectors`` as Prometheus would read them: {(name, sorted labels): value}."""
    registry = CollectorRegistry()
    for c in collectors:
        registry.register(c)
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def sample(name: str, **labels) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


# ---- helpers ------------------------------------------------------------------------------------


def test_status_label_names_the_error_table_row():
    assert metrics.status_label(None) == "ok"
    assert metrics.status_label(InvalidArgument("x")) == "invalid_argument"
    assert metrics.status_label(DeadlineExceeded("x")) == "deadline_exceeded"
    assert metrics.status_label(ValueError("a bug")) == "internal"
    assert metrics.status_label(asyncio.CancelledError()) == "unavailable"  # as the table maps CANCELLED
    assert {metrics.status_label(type("E", (Exception,), {"status": s})()) for s in Status} == {
        s.name.lower() for s in Status
    }


def test_children_are_cached_and_count_into_the_metric():
    children = metrics.Children(metrics.SCHEDULER_RETRIES, max_size=2)
    first = children("children-test", "1")
    assert children("children-test", "1") is first
    before = sample("aiworks_scheduler_retries_total", model="children-test", version="1")
    first.inc(2)
    children("children-test", "2")
    children("children-test", "3")  # over max_size: the cache starts again, the series stay
    children("children-test", "1").inc()
    assert sample("aiworks_scheduler_retries_total", model="children-test", version="1") == before + 3


async def test_on_loop_reads_on_the_loops_thread_from_another_thread():
    loop = asyncio.get_running_loop()
    threads = []
    read = metrics.on_loop(loop, lambda: threads.append(threading.get_ident()) or len(threads))
    assert read() == 1  # on the loop's thread: directly
    assert await asyncio.to_thread(read) == 2  # from the scrape thread: handed to the loop
    assert threads == [threading.get_ident()] * 2
    stuck = metrics.on_loop(loop, lambda: None, timeout_s=0.05)
    task = asyncio.ensure_future(asyncio.to_thread(stuck))
    await asyncio.sleep(0)  # the thread starts and hands the read to the loop...
    time.sleep(0.2)  # ...which is blocked, as a stuck loop would be
    with pytest.raises(TimeoutError):
        await task


# ---- gateway -----------------------------------------------------------------------------------


def test_gateway_counts_requests_by_outcome_and_keeps_model_labels_bounded():
    telemetry = GatewayTelemetry()
    labels = {"version": "4", "tenant": "acme", "protocol": "grpc"}
    before_ok = sample("aiworks_gateway_requests_total", model="gw-test", status="ok", **labels)
    before_bad = sample("aiworks_gateway_requests_total", model="gw-test", status="invalid_argument", **labels)
    before_junk = sample(
        "aiworks_gateway_requests_total", model="", version="", tenant="", protocol="http", status="not_found"
    )
    with telemetry.infer("grpc", "gw-test", "", None) as call:
        call.request = InferRequest("gw-test", tenant="acme")
        assert sample("aiworks_gateway_inflight_requests", protocol="grpc") >= 1
        call.response = InferResponse("gw-test", "4", [])
    with pytest.raises(InvalidArgument):
        with telemetry.infer("grpc", "gw-test", "4", None) as call:
            call.request = InferRequest("gw-test", "4", tenant="acme")
            raise InvalidArgument("bad shape")
    with pytest.raises(NotFound):
        with telemetry.infer("http", "no-such-model-x7", "", None):
            raise NotFound("unknown model")
    assert sample("aiworks_gateway_requests_total", model="gw-test", status="ok", **labels) == before_ok + 1
    assert sample("aiworks_gateway_requests_total", model="gw-test", status="invalid_argument", **labels) == (
        before_bad + 1
    )
    assert sample(
        "aiworks_gateway_requests_total", model="", version="", tenant="", protocol="http", status="not_found"
    ) == before_junk + 1
    assert "no-such-model-x7" not in generate_latest(REGISTRY).decode()
    assert sample("aiworks_gateway_request_duration_seconds_count", model="gw-test", **labels) >= 2


# ---- scheduler ---------------------------------------------------------------------------------


class EchoReplica:
    def __init__(self, delay_s: float = 0.01):
        self.delay_s = delay_s
        self.batches: list[int] = []

    async def execute(self, model, version, inputs, outputs, timeout_s=None):
        self.batches.append(inputs[0].shape[0])
        await asyncio.sleep(self.delay_s)
        return [Tensor.from_numpy("y", inputs[0].to_numpy())], 0

    async def close(self):
        pass


def _spec(name: str) -> ModelSpec:
    return ModelSpec(
        name, "1", max_batch_size=8,
        inputs=(TensorSpec("x", "FP32", (2,)),), outputs=(TensorSpec("y", "FP32", (2,)),),
        batching=BatchingConfig(True, 5_000, ()),
    )  # fmt: skip


def _scheduler(name: str, replicas: dict, **settings) -> Scheduler:
    registry = ReplicaRegistry(lambda address: replicas[address])
    for rid in replicas:
        registry.register(rid, rid, "gpu" if rid.endswith("g") else "cpu", {}, [_spec(name)])
    return Scheduler(SchedulerSettings(max_inflight_batches=1, **settings), registry)


def _request(name: str, rows: int = 1, **parameters) -> InferRequest:
    return InferRequest(name, "", [Tensor.from_numpy("x", np.ones((rows, 2), np.float32))], parameters=parameters)


async def test_scheduler_observes_requests_queue_waits_and_batches():
    name = "sched-metrics"
    replica = EchoReplica()
    scheduler = _scheduler(name, {"r0": replica})
    rows = [1, 2, 3, 1, 2]
    await asyncio.gather(*(scheduler.infer(_request(name, n, priority="realtime")) for n in rows))
    with pytest.raises(InvalidArgument):
        await scheduler.infer(_request(name, 1, priority="nonsense"))
    with pytest.raises(DeadlineExceeded):
        await scheduler.infer(_request(name, 1, timeout=1))  # 1 us: expired before it ran
    await scheduler.close()
    mv = {"model": name, "version": "1"}
    assert sample("aiworks_scheduler_requests_total", priority="realtime", status="ok", **mv) == len(rows)
    assert sample("aiworks_scheduler_requests_total", priority="standard", status="deadline_exceeded", **mv) == 1
    assert sample("aiworks_scheduler_timeouts_total", **mv) == 1
    # Failed before its version resolved, but the model is known: labelled with it, version as asked.
    assert sample("aiworks_scheduler_requests_total", model=name, version="", priority="standard",
                  status="invalid_argument") == 1  # fmt: skip
    assert sample("aiworks_scheduler_queue_duration_seconds_count", priority="realtime", **mv) == len(rows)
    assert sample("aiworks_scheduler_batch_size_rows_count", **mv) == len(replica.batches)
    assert sample("aiworks_scheduler_batch_size_rows_sum", **mv) == sum(rows) == sum(replica.batches)
    assert sample("aiworks_scheduler_batch_duration_seconds_count", **mv) == len(replica.batches)
    assert sample("aiworks_scheduler_batch_duration_seconds_sum", **mv) >= 0.01 * len(replica.batches)


async def test_scheduler_counts_rejections_by_reason():
    name = "sched-reject"
    scheduler = _scheduler(name, {"r0": EchoReplica(delay_s=0.05)}, max_queue_requests=2)
    results = await asyncio.gather(*(scheduler.infer(_request(name)) for _ in range(8)), return_exceptions=True)
    refused = [r for r in results if isinstance(r, Exception)]
    await scheduler.close()
    assert refused and all(r.status is Status.RESOURCE_EXHAUSTED for r in refused)
    assert sample("aiworks_scheduler_rejections_total", model=name, version="1", reason="queue_full") == len(refused)
    assert sample("aiworks_scheduler_requests_total", model=name, version="1", priority="standard",
                  status="resource_exhausted") == len(refused)  # fmt: skip


async def test_scheduler_collector_reads_queues_and_replicas_at_scrape_time():
    name = "sched-collect"
    slow = EchoReplica(delay_s=0.2)
    scheduler = _scheduler(name, {"r0": slow, "r1g": EchoReplica()})
    scheduler.registry.mark_down(scheduler.registry.replicas["r1g"], "test")
    collector = SchedulerCollector(metrics.on_loop(asyncio.get_running_loop(), scheduler.status))
    scheduler.eject_replica("r1g", 5, "test")
    waiting = [asyncio.ensure_future(scheduler.infer(_request(name, priority="batch")))]
    await asyncio.sleep(0.05)  # it runs on r0 (the only live replica) for 0.2 s...
    waiting += [asyncio.ensure_future(scheduler.infer(_request(name, priority=p))) for p in ("batch", "realtime")]
    await asyncio.sleep(0.05)  # ...while these two wait in the queue
    samples = await asyncio.to_thread(scrape, collector)  # as the metrics server's thread does
    await asyncio.gather(*waiting)
    await scheduler.close()
    depth = {
        labels[1][1]: value
        for (n, labels), value in samples.items()
        if n == "aiworks_scheduler_queue_depth_requests"
    }
    assert depth == {"realtime": 1.0, "standard": 0.0, "batch": 1.0}
    assert samples[("aiworks_scheduler_queue_bytes", (("model", name), ("version", "1")))] == 2 * 8
    assert samples[("aiworks_scheduler_replica_up", (("device", "cpu"), ("replica", "r0")))] == 1
    assert samples[("aiworks_scheduler_replica_up", (("device", "gpu"), ("replica", "r1g")))] == 0
    assert samples[("aiworks_scheduler_replica_ejected", (("replica", "r1g"),))] == 1
    assert samples[("aiworks_scheduler_replica_ejected", (("replica", "r0"),))] == 0
    assert samples[("aiworks_scheduler_replica_inflight_batches", (("replica", "r0"),))] == 1
    assert ("aiworks_scheduler_replica_latency_seconds", (("replica", "r0"),)) in samples


def test_a_collector_that_cannot_read_still_lets_the_scrape_answer():
    def broken():
        raise TimeoutError("the loop is stuck")

    assert scrape(SchedulerCollector(broken)) == {}


# ---- runtime -----------------------------------------------------------------------------------


def _scale_model(root: Path) -> Path:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [2.0])],
    )
    (root / "rt-metrics" / "1").mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), root / "rt-metrics/1/model.onnx")
    (root / "rt-metrics" / "config.pbtxt").write_text("max_batch_size: 8\n")
    return root


async def test_runtime_counts_executions_rows_and_compute_time(tmp_path):
    dataplane = RuntimeDataPlane(ModelRepository(_scale_model(tmp_path)), replica_id="rt-test")
    await dataplane.load("rt-metrics")
    mv = {"model": "rt-metrics", "version": "1"}
    before = sample("aiworks_runtime_executions_total", status="ok", **mv)
    for rows in (1, 3, 4):
        await dataplane.execute("rt-metrics", "", [Tensor.from_numpy("x", np.ones((rows, 3), np.float32))], [])
    with pytest.raises(InvalidArgument):
        await dataplane.execute("rt-metrics", "1", [Tensor.from_numpy("x", np.ones((1, 3), np.float32))], ["nope"])
    with pytest.raises(NotFound):
        await dataplane.execute("never-loaded-x9", "", [], [])
    dataplane.close()
    assert sample("aiworks_runtime_executions_total", status="ok", **mv) == before + 3
    assert sample("aiworks_runtime_inference_rows_total", **mv) == 8
    assert sample("aiworks_runtime_compute_duration_seconds_count", **mv) == 3
    assert sample("aiworks_runtime_executions_total", status="invalid_argument", **mv) == 1
    assert sample("aiworks_runtime_executions_total", model="", version="", status="not_found") >= 1
    assert sample("aiworks_runtime_inflight_batches", replica="rt-test") == 0


def test_runtime_collector_exports_models_loaded_and_tritons_gpu_metrics():
    reported = parse_device_metrics(TRITON_METRICS.read_text())
    samples = scrape(RuntimeCollector("rt-0", lambda: 3, lambda: reported))
    assert samples[("aiworks_runtime_models_loaded", (("replica", "rt-0"),))] == 3
    gpu = (("gpu", "GPU-a1b2"), ("replica", "rt-0"))
    assert samples[("aiworks_runtime_gpu_utilization_ratio", gpu)] == 0.73
    assert samples[("aiworks_runtime_gpu_memory_used_bytes", gpu)] == 2147483648
    assert samples[("aiworks_runtime_gpu_memory_total_bytes", gpu)] == 150754820096
    assert len([k for k in samples if k[0].startswith("aiworks_runtime_gpu_")]) == 6  # two GPUs × three


def test_runtime_collector_exports_no_gpu_series_on_a_cpu_replica_or_when_triton_fails():
    def unreachable():
        raise OSError("connection refused")

    for gpus in (lambda: None, unreachable):
        samples = scrape(RuntimeCollector("rt-0", lambda: 1, gpus))
        assert list(samples) == [("aiworks_runtime_models_loaded", (("replica", "rt-0"),))]


# ---- cache -------------------------------------------------------------------------------------


async def test_cache_collector_keeps_the_counter_names_and_reports_the_store_down_while_its_breaker_is_open():
    dataplane = CacheDataPlane(MemoryStore(1 << 20), failure_threshold=1, retry_after_s=60)
    await dataplane.put("m", b"k", b"v", 0)
    await dataplane.get("m", b"k")
    await dataplane.get("m", b"other")
    samples = scrape(CacheCollector(dataplane))
    assert samples[("aiworks_cache_hits_total", ())] == 1
    assert samples[("aiworks_cache_misses_total", ())] == 1
    assert samples[("aiworks_cache_puts_total", ())] == 1
    assert samples[("aiworks_cache_backend_up", (("store", "memory"),))] == 1
    dataplane.breaker.failure()
    assert scrape(CacheCollector(dataplane))[("aiworks_cache_backend_up", (("store", "memory"),))] == 0
