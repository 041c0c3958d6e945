"""Tracing helpers: W3C context in and out, span parents and links, the trace file, log lines, off-mode cost."""

from __future__ import annotations

import asyncio
import json
import logging

import numpy as np
import pytest

from aiworks.core import tracing
from aiworks.core.datatypes import Tensor
from aiworks.core.errors import InvalidArgument, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.logging import TraceIdFilter
from aiworks.core.model_config import BatchingConfig, ModelSpec, TensorSpec
from aiworks.core.settings import ServiceSettings
from aiworks.runtime.batcher import ModelQueue

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
TRACEPARENT = f"00-{TRACE_ID}-{CLIENT_SPAN}-01"


@pytest.fixture
def trace_file(tmp_path):
    """Tracing on, into a file; yields a function that flushes and returns the spans by name."""
    path = tmp_path / "spans.jsonl"
    assert tracing.setup_tracing("test", ServiceSettings(trace_file=path))

    def spans() -> dict[str, list[dict]]:
        tracing.shutdown_tracing()
        by_name: dict[str, list[dict]] = {}
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_name.setdefault(record["name"], []).append(record)
        return by_name

    yield spans
    tracing.shutdown_tracing()


def test_nothing_records_unless_an_exporter_is_configured():
    assert not tracing.setup_tracing("test", ServiceSettings())
    assert not tracing.enabled()
    assert tracing.server_span("x", None) is tracing.server_span("y", {}) is tracing.child_span("z")
    assert tracing.start_span("queue") is None


def test_off_the_callers_context_is_still_passed_on_and_logged():
    assert not tracing.enabled()
    with tracing.server_span("gateway infer", {"traceparent": TRACEPARENT}) as scope:
        assert scope.span is None  # no span object when nothing exports
        assert tracing.current_trace_id() == TRACE_ID
        carrier: dict[str, str] = {}
        tracing.inject(carrier)
    assert carrier == {"traceparent": TRACEPARENT}  # unchanged: this hop added no span
    assert tracing.current_trace_id() is None
    outside: dict[str, str] = {}
    tracing.inject(outside)
    assert outside == {}


def test_malformed_or_missing_traceparent_starts_nothing():
    assert tracing.extract({"traceparent": "not-a-traceparent"}) is None
    assert tracing.extract({"tracestate": "a=b"}) is None
    assert tracing.extract(None) is None
    assert tracing.carrier_from_metadata([("user-agent", "x")]) is None
    assert tracing.carrier_from_metadata([("traceparent", TRACEPARENT), ("x", "y")]) == {"traceparent": TRACEPARENT}


def test_spans_nest_under_the_callers_context_and_reach_the_file(trace_file):
    with tracing.server_span("gateway infer", {"traceparent": TRACEPARENT}, {"aiworks.model": "m"}):
        with tracing.child_span("cache lookup"):
            pass
        carrier: dict[str, str] = {}
        tracing.inject(carrier)
    spans = trace_file()
    [server], [child] = spans["gateway infer"], spans["cache lookup"]
    assert server["trace_id"] == child["trace_id"] == TRACE_ID
    assert server["parent_span_id"] == CLIENT_SPAN and server["kind"] == "SERVER"
    assert child["parent_span_id"] == server["span_id"]
    assert server["attributes"] == {"aiworks.model": "m"} and server["service"] == "aiworks-test"
    assert carrier["traceparent"] == f"00-{TRACE_ID}-{server['span_id']}-01"


def test_client_errors_do_not_fail_a_span_but_server_errors_do(trace_file):
    with pytest.raises(InvalidArgument):
        with tracing.server_span("bad input", None):
            raise InvalidArgument("no")
    with pytest.raises(Unavailable):
        with tracing.server_span("no replica", None):
            raise Unavailable("down")
    spans = trace_file()
    [bad], [down] = spans["bad input"], spans["no replica"]
    assert bad["status"] == "UNSET" and bad["attributes"]["aiworks.status"] == "invalid_argument"
    assert down["status"] == "ERROR" and down["attributes"]["aiworks.status"] == "unavailable"


def test_log_lines_carry_the_trace_id_inside_a_trace_only():
    record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
    TraceIdFilter().filter(record)
    assert record.trace == ""
    with tracing.remote_scope({"traceparent": TRACEPARENT}):
        TraceIdFilter().filter(record)
    assert record.trace == f" trace={TRACE_ID}"


# ---- through a replica's queue: queue spans, the batch span, its links, and the context the model runs in ----


class ContextRecordingModel:
    """Answers after a short wait; records the trace context current while it runs each batch."""

    def __init__(self):
        self.contexts: list[dict[str, str]] = []

    async def __call__(self, inputs, outputs):
        carrier: dict[str, str] = {}
        tracing.inject(carrier)  # what a call out of the batch would carry
        self.contexts.append(carrier)
        await asyncio.sleep(0.01)
        return [Tensor.from_numpy("y", inputs[0].to_numpy())], 1000


def _queue(model) -> ModelQueue:
    spec = ModelSpec(
        "m", "1", max_batch_size=8,
        inputs=(TensorSpec("x", "FP32", (2,)),), outputs=(TensorSpec("y", "FP32", (2,)),),
        batching=BatchingConfig(True, 20_000, ()),
    )  # fmt: skip
    return ModelQueue(spec, model, batching=True)


async def _infer(queue: ModelQueue, traceparent: str | None):
    request = InferRequest("m", "1", [Tensor.from_numpy("x", np.ones((1, 2), np.float32))])
    with tracing.remote_scope({"traceparent": traceparent} if traceparent else None):  # as the servicer does
        return await queue.submit(request, 1)


async def test_a_batch_span_joins_its_first_requests_trace_and_links_every_request(trace_file):
    replica = ContextRecordingModel()
    queue = _queue(replica)
    parents = [f"00-{i:032x}-{i:016x}-01" for i in range(1, 4)]
    await asyncio.gather(*(_infer(queue, tp) for tp in parents))
    await queue.close()
    spans = trace_file()
    queues = {s["trace_id"]: s for s in spans["runtime queue"]}
    assert sorted(queues) == [f"{i:032x}" for i in range(1, 4)]
    for i in range(1, 4):
        assert queues[f"{i:032x}"]["parent_span_id"] == f"{i:016x}"
    [batch] = spans["runtime batch"]  # the three waited together (20 ms delay)
    assert batch["attributes"]["aiworks.batch.rows"] == 3
    assert {link["span_id"] for link in batch["links"]} == {q["span_id"] for q in queues.values()}
    first = next(q for q in queues.values() if q["trace_id"] == batch["trace_id"])
    assert batch["parent_span_id"] == first["parent_span_id"]  # a sibling of that request's queue span
    assert queues[batch["trace_id"]]["end_unix_ns"] <= batch["start_unix_ns"] + 1_000_000
    [sent] = replica.contexts
    assert sent["traceparent"] == f"00-{batch['trace_id']}-{batch['span_id']}-01"


async def test_off_a_lone_requests_context_reaches_the_replica_and_a_shared_batch_carries_none():
    assert not tracing.enabled()
    replica = ContextRecordingModel()
    queue = _queue(replica)
    await _infer(queue, TRACEPARENT)
    await asyncio.gather(*(_infer(queue, f"00-{i:032x}-{i:016x}-01") for i in range(1, 3)))
    await _infer(queue, None)
    await queue.close()
    assert replica.contexts == [{"traceparent": TRACEPARENT}, {}, {}]
