"""Every service's /metrics, scraped after known traffic, counts exactly that traffic.

The suite runs one runtime replica and the result cache, on a repository of
the demo ``iris`` and a copy of it with the response cache enabled. Each
service's metrics port is found from its own log line ("metrics on
http://host:port/metrics"), whoever chose it.
"""

from __future__ import annotations

import re
import shutil
import time
from collections import defaultdict
from pathlib import Path

import grpc
import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from e2e_support import internal_channel, start_suite
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from aiworks.supervisor.supervisor import free_port

HTTP_ROWS = [1, 2, 3, 4]
GRPC_ROWS = [2, 2, 2]
N = len(HTTP_ROWS) + len(GRPC_ROWS)
ROWS = sum(HTTP_ROWS) + sum(GRPC_ROWS)


def _repository(demo: Path, target: Path) -> Path:
    shutil.copytree(demo / "iris", target / "iris")
    shutil.copytree(demo / "iris", target / "iris_cached")
    config = target / "iris_cached" / "config.pbtxt"
    text = config.read_text().replace('name: "iris"', 'name: "iris_cached"')
    # Clients see cache_hit only when the model opts in (report_cache_hit, docs/cache.md).
    report = 'parameters { key: "report_cache_hit" value: { string_value: "true" } }\n'
    config.write_text(text + "response_cache { enable: true }\n" + report)
    return target


@pytest.fixture(scope="module")
def suite(model_repository, tmp_path_factory):
    repo = _repository(model_repository, tmp_path_factory.mktemp("metrics-repo"))
    env = {f"AIWORKS_{svc}_METRICS_PORT": str(free_port()) for svc in ("GATEWAY", "SCHEDULER", "RUNTIME")}
    s = start_suite(repo, tmp_path_factory.mktemp("metrics-logs"), replicas=1, extra_env=env)
    yield s
    s.supervisor.stop()


def metrics_url(suite, child: str, wait_s: float = 10) -> str | None:
    """The /metrics URL a service logged when it started serving it (None if it logged none in ``wait_s``)."""
    [log_path] = [c.log_path for c in suite.supervisor.children if c.name == child]
    deadline = time.monotonic() + wait_s
    while True:
        found = re.search(r"metrics on (http://\S+/metrics)", log_path.read_text())
        if found:
            return found.group(1)
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


class Scrape:
    """One scrape, parsed with prometheus_client's own parser."""

    def __init__(self, url: str):
        text = requests.get(url, timeout=5).text
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def sum(self, name: str, **labels) -> float:
        return sum(s.value for s in self.samples if s.name == name and labels.items() <= s.labels.items())

    def by(self, name: str, label: str, **labels) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for s in self.samples:
            if s.name == name and labels.items() <= s.labels.items():
                out[s.labels[label]] += s.value
        return dict(out)

    def names(self) -> set[str]:
        return {s.name for s in self.samples}


def iris(rows: int) -> np.ndarray:
    return np.linspace(0.1, 7.9, rows * 4, dtype=np.float32).reshape(rows, 4)


def _http_infer(client, model: str, x: np.ndarray, **parameters):
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    return client.infer(model, [inp], parameters=parameters or None)


def _grpc_infer(client, model: str, x: np.ndarray):
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return client.infer(model, [inp])


def test_counts_match_the_traffic_on_every_service(suite):
    http = httpclient.InferenceServerClient(suite.http_url)
    grpc_client = grpcclient.InferenceServerClient(suite.grpc_url)
    for rows in HTTP_ROWS:
        _http_infer(http, "iris", iris(rows))
    for rows in GRPC_ROWS:
        _grpc_infer(grpc_client, "iris", iris(rows))
    # Three invalid requests: two with a shape the model refuses (the scheduler says so), one the codec refuses.
    with pytest.raises(InferenceServerException, match="400|shape|dims"):
        _http_infer(http, "iris", np.ones((1, 5), np.float32))
    with pytest.raises(InferenceServerException) as bad_grpc:
        _grpc_infer(grpc_client, "iris", np.ones((2, 3), np.float32))
    assert "INVALID_ARGUMENT" in str(bad_grpc.value.status())
    bad = {"inputs": [{"name": "input", "datatype": "FP99", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
    assert requests.post(f"{suite.base}/v2/models/iris/infer", json=bad, timeout=10).status_code == 400
    http.close()
    grpc_client.close()

    gateway = Scrape(metrics_url(suite, "gateway"))
    requests_by_status = gateway.by("aiworks_gateway_requests_total", "status", model="iris")
    assert requests_by_status == {"ok": N, "invalid_argument": 3}
    assert gateway.by("aiworks_gateway_requests_total", "protocol", model="iris", status="ok") == {
        "http": len(HTTP_ROWS),
        "grpc": len(GRPC_ROWS),
    }
    assert gateway.sum("aiworks_gateway_requests_total", model="iris", version="1", status="ok") == N
    assert gateway.sum("aiworks_gateway_request_duration_seconds_count", model="iris") == N + 3
    assert gateway.sum("aiworks_gateway_request_duration_seconds_sum", model="iris") > 0
    assert gateway.sum("aiworks_gateway_inflight_requests") == 0
    # Standard names, as generic process and Python dashboards expect them.
    assert {"process_cpu_seconds_total", "process_resident_memory_bytes", "python_gc_objects_collected_total",
            "python_info"} <= gateway.names()

    # The scheduling stage: queues and batches on the runtime replica (where they run); the scheduler's
    # own gauges are its global view of the replicas.
    mv = {"model": "iris", "version": "1"}
    replicas = [Scrape(metrics_url(suite, "runtime-0"))]

    def total(name: str, **labels) -> float:
        return sum(r.sum(name, **labels) for r in replicas)

    by_status: dict[str, float] = {}
    for r in replicas:
        for status, value in r.by("aiworks_scheduler_requests_total", "status", **mv).items():
            by_status[status] = by_status.get(status, 0) + value
    assert by_status == {"ok": N, "invalid_argument": 2}
    assert total("aiworks_scheduler_queue_duration_seconds_count", **mv) == N
    batches = total("aiworks_scheduler_batch_size_rows_count", **mv)
    assert 1 <= batches <= N
    assert total("aiworks_scheduler_batch_size_rows_sum", **mv) == ROWS
    assert total("aiworks_scheduler_batch_duration_seconds_count", **mv) == batches
    assert total("aiworks_scheduler_queue_depth_requests", **mv) == 0
    assert total("aiworks_scheduler_queue_bytes", **mv) == 0
    scheduler = Scrape(metrics_url(suite, "scheduler"))
    assert scheduler.sum("aiworks_scheduler_replica_up", replica="runtime-0", device="cpu") == 1
    assert scheduler.sum("aiworks_scheduler_replica_inflight_batches", replica="runtime-0") == 0
    deadline = time.monotonic() + 5  # latency averages reach the scheduler in the gateway's next report
    while not scheduler.sum("aiworks_scheduler_replica_latency_seconds", replica="runtime-0") > 0:
        assert time.monotonic() < deadline, "the gateway's routing report never reached the scheduler"
        time.sleep(0.2)
        scheduler = Scrape(metrics_url(suite, "scheduler"))

    assert total("aiworks_runtime_inference_rows_total", **mv) == ROWS
    assert total("aiworks_runtime_executions_total", status="ok", **mv) == batches
    assert total("aiworks_runtime_compute_duration_seconds_count", **mv) == batches
    runtime = replicas[0]
    assert runtime.sum("aiworks_runtime_inflight_batches", replica="runtime-0") == 0
    assert runtime.sum("aiworks_runtime_models_loaded", replica="runtime-0") == 2
    assert runtime.sum("aiworks_runtime_inflight_requests", replica="runtime-0") == 0  # all answered
    assert not [n for n in runtime.names() if n.startswith("aiworks_runtime_gpu_")]  # a CPU replica


def test_cache_lookups_count_hits_misses_and_bypasses(suite):
    http = httpclient.InferenceServerClient(suite.http_url)
    x = iris(3)
    first = _http_infer(http, "iris_cached", x)
    assert first.get_response()["parameters"]["cache_hit"] is False
    computed = 1
    deadline = time.monotonic() + 10
    while not _http_infer(http, "iris_cached", x).get_response()["parameters"]["cache_hit"]:
        computed += 1  # the first answer is stored in the background; until then, misses
        assert time.monotonic() < deadline
        time.sleep(0.05)
    _http_infer(http, "iris_cached", x, cache_bypass=True)
    _http_infer(http, "iris", x)  # not a cached model: no lookup
    http.close()

    gateway = Scrape(metrics_url(suite, "gateway"))
    assert gateway.by("aiworks_gateway_cache_lookups_total", "result", model="iris_cached") == {
        "hit": 1,
        "miss": computed,
        "bypass": 1,
        "error": 0,
    }
    assert gateway.sum("aiworks_gateway_cache_lookups_total", model="iris") == 0
    # Only what the cache did not answer reached a replica.
    runtime = Scrape(metrics_url(suite, "runtime-0"))
    assert runtime.sum("aiworks_runtime_inference_rows_total", model="iris_cached") == 3 * (computed + 1)
    # The cache service's own view, where the suite gives it a metrics port (a local `aiworks up` may not).
    cache_url = metrics_url(suite, "cache", wait_s=0)
    if cache_url is not None:
        cache = Scrape(cache_url)
        assert cache.sum("aiworks_cache_hits_total") == 1
        assert cache.sum("aiworks_cache_misses_total") == computed
        assert cache.sum("aiworks_cache_backend_up", store="memory") == 1
        assert "process_resident_memory_bytes" in cache.names()


def test_eject_replica_is_counted_and_shown_then_refused_for_an_unknown_replica(suite):
    with internal_channel(suite.supervisor, suite.supervisor.scheduler_address, "scheduler") as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        reply = stub.EjectReplica(
            scheduler_pb2.EjectReplicaRequest(replica_id="runtime-0", duration_s=30, reason="e2e: p99 breach"),
            timeout=5,
        )
        assert reply.ejected and reply.ejected_for_s == pytest.approx(30, abs=0.5)
        assert "e2e: p99 breach" in reply.message
        [status] = stub.Status(scheduler_pb2.StatusRequest(), timeout=5).replicas
        assert status.ejected and status.ejected_for_s > 25
        with pytest.raises(grpc.RpcError) as unknown:
            stub.EjectReplica(scheduler_pb2.EjectReplicaRequest(replica_id="nope", duration_s=1), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND

    scheduler = Scrape(metrics_url(suite, "scheduler"))
    assert scheduler.sum("aiworks_scheduler_ejections_total", replica="runtime-0", reason="monitor") == 1
    assert scheduler.sum("aiworks_scheduler_replica_ejected", replica="runtime-0") == 1
    # Outlier ejections are each gateway's own (counted there); none happened.
    assert Scrape(metrics_url(suite, "gateway")).sum("aiworks_scheduler_ejections_total", reason="outlier") == 0
    # Every holder ejected: panic routing still serves (better a suspect replica than none).
    http = httpclient.InferenceServerClient(suite.http_url)
    assert _http_infer(http, "iris", iris(1)).as_numpy("label").shape == (1, 1)
    http.close()
