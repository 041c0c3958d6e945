"""One request with a W3C traceparent yields one trace across the gateway and the runtime.

The scheduler is off the request path (it is the control plane), so no span of
its joins a request's trace; it still exports its own.

The suite (one runtime replica, the result cache on) writes each service's
finished spans to its own trace file and also exports them over OTLP/gRPC to
a receiver this test runs (opentelemetry-proto's TraceService, a real gRPC
server). The gateway logs at DEBUG, so its per-request line shows the trace id.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from e2e_support import start_suite
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from aiworks.supervisor.supervisor import free_port

SERVICES = ("gateway", "scheduler", "runtime")
# Every traced request to a model without the response cache: (service, span name).
UNCACHED = {
    ("aiworks-gateway", "gateway infer"),
    ("aiworks-runtime", "runtime queue"),
    ("aiworks-runtime", "runtime batch"),
    ("aiworks-runtime", "runtime execute"),
}


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects what the services export: {trace id hex: [(service.name, span name)]}."""

    def __init__(self):
        self.spans: dict[str, list[tuple[str, str]]] = {}
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            for resource_spans in request.resource_spans:
                attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.setdefault(span.trace_id.hex(), []).append(
                            (attributes.get("service.name", ""), span.name)
                        )
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture(scope="module")
def traced(model_repository, tmp_path_factory):
    repo = tmp_path_factory.mktemp("tracing-repo")
    shutil.copytree(model_repository / "iris", repo / "iris")
    shutil.copytree(model_repository / "iris", repo / "iris_cached")
    config = repo / "iris_cached" / "config.pbtxt"
    config.write_text(config.read_text().replace('name: "iris"', 'name: "iris_cached"') + "response_cache { enable: true }\n")
    traces = tmp_path_factory.mktemp("traces")
    otlp_port = free_port()
    env = {}
    for svc in SERVICES:
        env[f"AIWORKS_{svc.upper()}_TRACE_FILE"] = str(traces / f"{svc}.jsonl")
        env[f"AIWORKS_{svc.upper()}_OTLP_ENDPOINT"] = f"127.0.0.1:{otlp_port}"
        env[f"AIWORKS_{svc.upper()}_METRICS_PORT"] = "0"
    suite = start_suite(
        repo, tmp_path_factory.mktemp("tracing-logs"), replicas=1, extra_env=env, log_level="DEBUG"
    )
    receiver = OtlpReceiver()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    server.add_insecure_port(f"127.0.0.1:{otlp_port}")
    server.start()
    yield suite, traces, receiver
    suite.supervisor.stop()
    server.stop(grace=None)


def spans_of(traces: Path, trace_id: str, expected: set[tuple[str, str]], timeout_s: float = 15) -> list[dict]:
    """The trace's spans from every service's trace file, once all ``expected`` (service, name) arrived."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        for svc in SERVICES:
            path = traces / f"{svc}.jsonl"
            if path.exists():
                found += [s for s in map(json.loads, path.read_text().splitlines()) if s["trace_id"] == trace_id]
        if expected <= {(s["service"], s["name"]) for s in found} or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def _one(spans: list[dict], name: str) -> dict:
    [span] = [s for s in spans if s["name"] == name]
    return span


def test_one_traced_request_is_one_trace_across_the_services(traced):
    suite, traces, _ = traced
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    client = httpclient.InferenceServerClient(suite.http_url)
    # Another input first, untraced: the gateway's stream to the cache is open before the traced lookup (opening it
    # can take longer than the lookup's 10 ms budget on a loaded machine, and the lookup would then be "error").
    warm = httpclient.InferInput("input", [1, 4], "FP32")
    warm.set_data_from_numpy(np.full((1, 4), 0.25, np.float32), binary_data=True)
    client.infer("iris_cached", [warm])
    x = np.full((2, 4), 0.5, np.float32)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    result = client.infer("iris_cached", [inp], headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    client.close()
    assert result.as_numpy("label").shape == (2, 1)

    expected = {
        ("aiworks-gateway", "gateway infer"),
        ("aiworks-gateway", "cache lookup"),
        ("aiworks-runtime", "runtime queue"),
        ("aiworks-runtime", "runtime batch"),
        ("aiworks-runtime", "runtime execute"),
    }
    spans = spans_of(traces, trace_id, expected)
    assert {(s["service"], s["name"]) for s in spans} == expected
    assert len(spans) == len(expected)  # one of each: nothing else joined this trace
    gateway, lookup = _one(spans, "gateway infer"), _one(spans, "cache lookup")
    queue, batch, execute = _one(spans, "runtime queue"), _one(spans, "runtime batch"), _one(spans, "runtime execute")
    assert gateway["parent_span_id"] == client_span and gateway["kind"] == "SERVER"
    assert gateway["attributes"]["aiworks.status"] == "ok" and gateway["attributes"]["aiworks.version"] == "1"
    assert lookup["parent_span_id"] == gateway["span_id"] and lookup["attributes"]["aiworks.cache.result"] == "miss"
    assert queue["parent_span_id"] == gateway["span_id"]
    assert batch["parent_span_id"] == gateway["span_id"]
    assert [link["span_id"] for link in batch["links"]] == [queue["span_id"]]
    assert batch["attributes"]["aiworks.batch.rows"] == 2
    assert execute["parent_span_id"] == batch["span_id"] and execute["kind"] == "INTERNAL"
    assert execute["attributes"]["aiworks.replica"] == "runtime-0"
    # Time nests: the queue wait ends as its batch starts; the runtime runs inside the batch.
    assert queue["end_unix_ns"] <= batch["start_unix_ns"] + 5_000_000
    assert batch["start_unix_ns"] <= execute["start_unix_ns"] <= execute["end_unix_ns"] <= batch["end_unix_ns"]
    assert gateway["start_unix_ns"] <= lookup["start_unix_ns"] and batch["end_unix_ns"] <= gateway["end_unix_ns"]

    [gateway_log] = [c.log_path for c in suite.supervisor.children if c.name == "gateway"]
    lines = [line for line in gateway_log.read_text().splitlines() if f"trace={trace_id}" in line]
    assert lines and any("http infer iris_cached -> ok" in line for line in lines)


def test_grpc_metadata_carries_the_trace_and_spans_reach_the_otlp_collector(traced):
    suite, traces, receiver = traced
    trace_id, client_span = os.urandom(16).hex(), os.urandom(8).hex()
    client = grpcclient.InferenceServerClient(suite.grpc_url)
    x = np.full((1, 4), 1.5, np.float32)
    inp = grpcclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    client.infer("iris", [inp], headers={"traceparent": f"00-{trace_id}-{client_span}-01"})
    client.close()

    spans = spans_of(traces, trace_id, UNCACHED)  # each service flushes its file on its own schedule
    gateway = _one(spans, "gateway infer")
    assert gateway["parent_span_id"] == client_span and gateway["attributes"]["aiworks.protocol"] == "grpc"
    assert not [s for s in spans if s["name"] == "cache lookup"]  # iris is not a cached model
    assert _one(spans, "runtime execute")["parent_span_id"] == _one(spans, "runtime batch")["span_id"]

    deadline = time.monotonic() + 15
    while len(receiver.spans.get(trace_id, [])) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(receiver.spans.get(trace_id, [])) == sorted(UNCACHED)


def test_a_request_without_traceparent_starts_its_own_trace(traced):
    suite, traces, _ = traced
    client = httpclient.InferenceServerClient(suite.http_url)
    x = np.full((1, 4), 2.5, np.float32)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    client.infer("iris", [inp], request_id="untraced-1")
    client.close()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        roots = [
            s for s in map(json.loads, (traces / "gateway.jsonl").read_text().splitlines())
            if s["name"] == "gateway infer" and s["parent_span_id"] is None
            and s["attributes"]["aiworks.model"] == "iris"  # the first test's untraced warm-up was for iris_cached
        ]  # fmt: skip
        if roots:
            break
        time.sleep(0.2)
    [root] = roots
    spans = spans_of(traces, root["trace_id"], UNCACHED)
    assert {(s["service"], s["name"]) for s in spans} == UNCACHED
