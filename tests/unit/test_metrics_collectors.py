"""The metric helpers, each service's scrape-time collector, and what the request paths observe."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from routing_support import FakeReplica, make

from aiworks.cache.dataplane import CacheDataPlane
from aiworks.cache.server import CacheCollector
from aiworks.cache.store import MemoryStore
from aiworks.core import metrics
from aiworks.core.datatypes import Tensor
from aiworks.core.errors import DeadlineExceeded, InvalidArgument, NotFound, Status
from aiworks.core.inference import InferRequest, InferResponse
from aiworks.core.options import Priority, RequestOptions, SequenceRef
from aiworks.gateway.telemetry import GatewayTelemetry
from aiworks.runtime.batcher import QueueLimits
from aiworks.runtime.collector import RuntimeCollector
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.repository import ModelRepository
from aiworks.runtime.triton_backend import parse_device_metrics
from aiworks.scheduler.collector import SchedulerCollector

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


# ---- the scheduling stage: a runtime's queues, the scheduler's global view ----------------------


def _options(priority=Priority.STANDARD, timeout_s=None) -> RequestOptions:
    return RequestOptions(priority, time.monotonic() + timeout_s if timeout_s is not None else None)


async def test_runtime_queues_observe_requests_queue_waits_and_batches(tmp_path):
    dataplane = RuntimeDataPlane(ModelRepository(_scale_model(tmp_path, "q-metrics")), replica_id="rt-q")
    await dataplane.load("q-metrics")
    rows = [1, 2, 3, 1, 2]
    answers = await asyncio.gather(
        *(dataplane.queues.infer(_scale_request("q-metrics", n), _options(Priority.REALTIME)) for n in rows)
    )
    with pytest.raises(InvalidArgument):
        await dataplane.queues.infer(_scale_request("q-metrics", 1, width=4), _options())
    with pytest.raises(DeadlineExceeded):
        await dataplane.queues.infer(_scale_request("q-metrics", 1), _options(timeout_s=-1))  # expired already
    await dataplane.close()
    mv = {"model": "q-metrics", "version": "1"}
    assert sample("aiworks_scheduler_requests_total", priority="realtime", status="ok", **mv) == len(rows)
    assert sample("aiworks_scheduler_requests_total", priority="standard", status="deadline_exceeded", **mv) == 1
    assert sample("aiworks_scheduler_requests_total", priority="standard", status="invalid_argument", **mv) == 1
    batches = sample("aiworks_scheduler_batch_size_rows_count", **mv)
    assert sample("aiworks_scheduler_queue_duration_seconds_count", priority="realtime", **mv) == len(rows)
    assert 1 <= batches <= len(rows)
    assert sample("aiworks_scheduler_batch_size_rows_sum", **mv) == sum(rows)
    assert sample("aiworks_scheduler_batch_duration_seconds_count", **mv) == batches
    assert all(a.compute_ns > 0 for a in answers)
    # An unknown model is never a label: callers cannot grow the series.
    with pytest.raises(NotFound):
        await dataplane.queues.infer(InferRequest("no-such-model-q1", "1", []), _options())
    assert "no-such-model-q1" not in generate_latest(REGISTRY).decode()


async def test_runtime_queues_count_rejections_by_reason(tmp_path):
    dataplane = RuntimeDataPlane(
        ModelRepository(_scale_model(tmp_path, "q-reject")), replica_id="rt-r", debug_delay_ms=50,
        queue_limits=QueueLimits(max_requests=2),
    )  # fmt: skip
    await dataplane.load("q-reject")
    results = await asyncio.gather(
        *(dataplane.queues.infer(_scale_request("q-reject", 1), _options()) for _ in range(8)), return_exceptions=True
    )
    await dataplane.close()
    refused = [r for r in results if isinstance(r, Exception)]
    assert refused and all(r.status is Status.RESOURCE_EXHAUSTED for r in refused)
    mv = {"model": "q-reject", "version": "1"}
    assert sample("aiworks_scheduler_rejections_total", reason="queue_full", **mv) == len(refused)
    assert sample("aiworks_scheduler_requests_total", priority="standard", status="resource_exhausted",
                  **mv) == len(refused)  # fmt: skip


async def test_a_replicas_stateful_sequences_are_read_at_scrape_time(tmp_path):
    """What a replica holds of a stateful model (what its stop's drain waits for) and how its sequences went:
    Triton's accumulator with one slot, so a second sequence waits; sequences idle out after 0.3 s."""
    from aiworks.demo.qa_streaming import write_accumulator

    write_accumulator(tmp_path, "acc", max_batch_size=1, candidates=1, idle_us=300_000)
    dataplane = RuntimeDataPlane(ModelRepository(tmp_path), replica_id="rt-s")
    await dataplane.load("acc")
    collector = RuntimeCollector("rt-s", lambda: 1, read_sequences=metrics.on_loop(
        asyncio.get_running_loop(), dataplane.queues.sequence_stats))  # fmt: skip

    def add(sequence: int, start=False, end=False):
        request = InferRequest("acc", "1", [Tensor.from_numpy("INPUT", np.array([[1]], np.int32))])
        return dataplane.queues.infer(request, RequestOptions(sequence=SequenceRef(sequence, start, end)))

    def read(samples, name, **labels) -> float:
        return samples[(name, tuple(sorted({"replica": "rt-s", "model": "acc", "version": "1", **labels}.items())))]

    try:
        await add(1, start=True)
        second = asyncio.ensure_future(add(2, start=True))  # the one slot is taken: it waits
        await asyncio.sleep(0.05)
        samples = await asyncio.to_thread(scrape, collector)
        assert read(samples, "aiworks_runtime_sequences", state="active") == 1
        assert read(samples, "aiworks_runtime_sequences", state="waiting") == 1
        assert read(samples, "aiworks_runtime_sequence_outcomes_total", outcome="started") == 2
        await add(1, end=True)  # frees the slot: the second runs, then idles out
        await second
        deadline = time.monotonic() + 10
        while True:  # idled out 0.3 s after its last request (the batcher's reaper looks a few times a second)
            samples = await asyncio.to_thread(scrape, collector)
            if read(samples, "aiworks_runtime_sequence_outcomes_total", outcome="idled") or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert read(samples, "aiworks_runtime_sequences", state="active") == 0
        assert read(samples, "aiworks_runtime_sequences", state="waiting") == 0
        outcomes = {o: read(samples, "aiworks_runtime_sequence_outcomes_total", outcome=o)
                    for o in ("started", "ended", "idled", "refused")}  # fmt: skip
        assert outcomes == {"started": 2, "ended": 1, "idled": 1, "refused": 0}, outcomes
    finally:
        await dataplane.close()


async def test_queue_depths_are_read_at_scrape_time_where_the_queues_are(tmp_path):
    dataplane = RuntimeDataPlane(
        ModelRepository(_scale_model(tmp_path, "q-collect")), replica_id="rt-c", debug_delay_ms=200
    )
    await dataplane.load("q-collect")
    collector = RuntimeCollector("rt-c", lambda: 1, read_queues=metrics.on_loop(asyncio.get_running_loop(),
                                                                                  dataplane.queues.stats))  # fmt: skip
    infer = dataplane.queues.infer
    waiting = [asyncio.ensure_future(infer(_scale_request("q-collect", 1), _options(Priority.BATCH)))]
    await asyncio.sleep(0.05)  # it runs for 0.2 s...
    waiting += [asyncio.ensure_future(infer(_scale_request("q-collect", 1), _options(p)))
                for p in (Priority.BATCH, Priority.REALTIME)]  # fmt: skip
    await asyncio.sleep(0.05)  # ...while these two wait in the queue
    samples = await asyncio.to_thread(scrape, collector)  # as the metrics server's thread does
    await asyncio.gather(*waiting)
    await dataplane.close()
    depth = {
        labels[1][1]: value
        for (n, labels), value in samples.items()
        if n == "aiworks_scheduler_queue_depth_requests"
    }
    assert depth == {"realtime": 1.0, "standard": 0.0, "batch": 1.0}
    assert samples[("aiworks_scheduler_queue_bytes", (("model", "q-collect"), ("version", "1")))] == 2 * 12


async def test_scheduler_collector_reads_the_replicas_at_scrape_time():
    suite = make({"r0": FakeReplica("r0", delay_s=0.01), "r1g": FakeReplica("r1g"), "r2": FakeReplica("r2")},
                 devices={"r1g": "gpu"})  # fmt: skip
    suite.registry.replicas["r0"].inflight_batches = 1
    suite.registry.heartbeat("r2", [], stopping=True)
    suite.registry.mark_down(suite.registry.replicas["r1g"], "test")
    suite.scheduler.eject_replica("r1g", 5, "test")
    suite.sync()
    await suite.infer()
    suite.scheduler.report(suite.dispatcher.report("g0"))
    collector = SchedulerCollector(metrics.on_loop(asyncio.get_running_loop(), suite.scheduler.status))
    samples = await asyncio.to_thread(scrape, collector)
    assert samples[("aiworks_scheduler_replica_up", (("device", "cpu"), ("replica", "r0")))] == 1
    assert samples[("aiworks_scheduler_replica_up", (("device", "gpu"), ("replica", "r1g")))] == 0
    assert samples[("aiworks_scheduler_replica_ejected", (("replica", "r1g"),))] == 1
    assert samples[("aiworks_scheduler_replica_ejected", (("replica", "r0"),))] == 0
    assert samples[("aiworks_scheduler_replica_stopping", (("replica", "r0"),))] == 0
    assert samples[("aiworks_scheduler_replica_stopping", (("replica", "r2"),))] == 1
    assert samples[("aiworks_scheduler_replica_up", (("device", "cpu"), ("replica", "r2")))] == 0
    assert samples[("aiworks_scheduler_replica_inflight_batches", (("replica", "r0"),))] == 1
    assert samples[("aiworks_scheduler_replica_latency_seconds", (("replica", "r0"),))] > 0


def test_a_collector_that_cannot_read_still_lets_the_scrape_answer():
    def broken():
        raise TimeoutError("the loop is stuck")

    assert scrape(SchedulerCollector(broken)) == {}


# ---- runtime -----------------------------------------------------------------------------------


def _scale_model(root: Path, name: str = "rt-metrics") -> Path:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [2.0])],
    )
    (root / name / "1").mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), root / name / "1/model.onnx")
    (root / name / "config.pbtxt").write_text("max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: 5000 }\n")
    return root


def _scale_request(name: str, rows: int, width: int = 3) -> InferRequest:
    return InferRequest(name, "1", [Tensor.from_numpy("x", np.ones((rows, width), np.float32))])


async def test_runtime_counts_executions_rows_and_compute_time(tmp_path):
    dataplane = RuntimeDataPlane(ModelRepository(_scale_model(tmp_path)), replica_id="rt-test")
    await dataplane.load("rt-metrics")
    mv = {"model": "rt-metrics", "version": "1"}
    before = sample("aiworks_runtime_executions_total", status="ok", **mv)
    for rows in (1, 3, 4):
        await dataplane.execute("rt-metrics", "", [Tensor.from_numpy("x", np.ones((rows, 3), np.float32))], [])
    with pytest.raises(NotFound):
        await dataplane.execute("never-loaded-x9", "", [], [])
    await dataplane.close()
    assert sample("aiworks_runtime_executions_total", status="ok", **mv) == before + 3
    assert sample("aiworks_runtime_inference_rows_total", **mv) == 8
    assert sample("aiworks_runtime_compute_duration_seconds_count", **mv) == 3
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
        samples = scrape(RuntimeCollector("rt-0", lambda: 1, gpus, inflight=lambda: 2))
        assert samples == {
            ("aiworks_runtime_models_loaded", (("replica", "rt-0"),)): 1,
            ("aiworks_runtime_inflight_requests", (("replica", "rt-0"),)): 2,
        }


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


def test_a_generations_audited_sampling_is_numbers_and_flags_never_text() -> None:
    """What a client sends as sampling parameters reaches the audit line only as numbers, flags, type names and
    the count of stop strings: a huge integer, a NaN or a string where a number goes cannot carry text or bulk."""
    from aiworks.gateway.telemetry import sampling_asked

    asked = {"max_tokens": 12, "temperature": 0.7, "top_k": 10**40, "top_p": float("nan"), "seed": "secret text",
             "ignore_eos": True, "stop": '["my private stop", "another"]', "prompt": "never"}  # fmt: skip
    assert sampling_asked(asked) == {"max_tokens": 12, "temperature": 0.7, "top_k": "int", "top_p": "float",
                                     "seed": "str", "ignore_eos": True, "stop_strings": 2}  # fmt: skip
    assert sampling_asked({"stop": "one"}) == {"stop_strings": 1}
    assert sampling_asked({"stop": "[not json"}) == {"stop_strings": 1}
    assert sampling_asked({}) == {}
