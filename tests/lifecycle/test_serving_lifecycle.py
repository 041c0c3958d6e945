"""The scheduler's lifecycle logic on fake replicas and a fake clock: shadows, drains, pipelines.

The same behaviour runs on the real processes in tests/e2e/test_shadow.py,
test_hot_update.py and test_pipeline.py; here each rule is pinned down
without process start-up or timing noise.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.drain import Drainer
from aiworks.scheduler.pipeline import PipelineRunner, parse_steps
from aiworks.scheduler.qos import Priority
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.settings import SchedulerSettings
from aiworks.scheduler.shadow import ShadowMirror, answers_agree
from aiworks.scheduler.traffic_state import ShadowPolicy, TrafficPolicy

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, InvalidArgument, Status, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import ModelSpec, TensorSpec


class FakeReplica:
    """Answers y = x * factor[version] after a delay (per version); counts rows per version.

    ``load`` answers with ``reloaded``: the versions a reload leaves.
    """

    def __init__(self, factors: dict[str, float], delay_s: float = 0.0, delays: dict[str, float] | None = None):
        self.factors = factors
        self.delays = delays or {}
        self.delay_s = delay_s
        self.rows: dict[str, int] = {}
        self.reloaded: list[ModelSpec] = []

    async def execute(self, model, version, inputs, outputs, timeout_s=None):
        await asyncio.sleep(self.delays.get(version, self.delay_s))
        x = inputs[0].to_numpy()
        self.rows[version] = self.rows.get(version, 0) + len(x)
        return [Tensor.from_numpy("y", (x * self.factors[version]).astype(np.float32))], 0

    async def load(self, model):
        return self.reloaded

    async def unload(self, model):
        pass

    async def close(self):
        pass


def spec(version: str) -> ModelSpec:
    return ModelSpec(
        "m",
        version,
        max_batch_size=8,
        inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=(TensorSpec("y", "FP32", (2,)),),
    )


def make(replicas: dict[str, FakeReplica], versions=("1", "2"), **settings):
    registry = ReplicaRegistry(lambda address: replicas[address])
    for rid in replicas:
        registry.register(rid, rid, "cpu", {}, [spec(v) for v in versions])
    return Scheduler(SchedulerSettings(**settings), registry), registry


def request(version: str = "", value: float = 1.0) -> InferRequest:
    return InferRequest("m", version, [Tensor.from_numpy("x", np.full((1, 2), value, dtype=np.float32))])


async def settle(scheduler: Scheduler) -> None:
    for _ in range(200):
        if all(c.inflight == 0 for c in scheduler.shadows.counts.values()):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("shadow copies never finished")


# ---- comparing answers ---------------------------------------------------------------------------


def _t(name, array):
    return Tensor.from_numpy(name, np.asarray(array))


def test_integers_compare_exactly_floats_within_the_tolerance_or_by_argmax():
    probs = np.array([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2]], dtype=np.float32)
    label = np.array([1, 0], dtype=np.int64)
    primary = [_t("label", label), _t("p", probs)]
    assert answers_agree(primary, [_t("label", label), _t("p", probs + 5e-5)], "allclose", 1e-4)
    assert not answers_agree(primary, [_t("label", label), _t("p", probs + 0.05)], "allclose", 1e-4)
    # Same decisions, other confidences: argmax agrees, allclose does not.
    assert answers_agree(primary, [_t("label", label), _t("p", probs * 0.5)], "argmax", 1e-4)
    assert not answers_agree(primary, [_t("label", label), _t("p", probs[:, ::-1])], "argmax", 1e-4)
    assert not answers_agree(primary, [_t("label", label + 1), _t("p", probs)], "argmax", 1e-4)  # ints: exact
    assert not answers_agree(primary, [_t("label", label)], "allclose", 1e-4)  # an output missing
    assert not answers_agree(primary, [_t("label", label), _t("p", probs[:1])], "allclose", 1e-4)  # shape
    text = [Tensor.from_numpy("t", np.array([b"a", b"b"], dtype=object))]
    assert answers_agree(text, [Tensor.from_numpy("t", np.array([b"a", b"b"], dtype=object))], "allclose", 0)
    assert not answers_agree(text, [Tensor.from_numpy("t", np.array([b"a", b"c"], dtype=object))], "allclose", 0)


def test_shadow_policies_are_checked():
    with pytest.raises(InvalidArgument):
        ShadowPolicy("")
    with pytest.raises(InvalidArgument):
        ShadowPolicy("2", fraction=0)
    with pytest.raises(InvalidArgument):
        ShadowPolicy("2", compare="median")
    with pytest.raises(InvalidArgument):
        ShadowPolicy("2", tolerance=float("nan"))
    assert not TrafficPolicy("m", shadow=ShadowPolicy("2")).empty


# ---- shadow traffic through the scheduler ---------------------------------------------------------


async def test_clients_get_the_primary_and_the_shadow_is_compared_and_counted():
    replica = FakeReplica({"1": 2.0, "2": 2.0, "3": 3.0})
    scheduler, _ = make({"r": replica}, versions=("1", "2", "3"))
    scheduler.set_traffic(TrafficPolicy("m", {"1": 100}, ShadowPolicy("2")))
    for _ in range(10):
        response = await scheduler.infer(request())
        assert response.version == "1" and float(response.outputs[0].to_numpy()[0, 0]) == 2.0
    await settle(scheduler)
    [view] = scheduler.status().shadows
    assert (view.mirrored, view.compared, view.agreed, view.errors, view.dropped) == (10, 10, 10, 0, 0)
    assert replica.rows == {"1": 10, "2": 10}

    scheduler.set_traffic(TrafficPolicy("m", {"1": 100}, ShadowPolicy("3")))
    for _ in range(4):
        assert (await scheduler.infer(request())).version == "1"
    await settle(scheduler)
    views = {v.shadow_version: v for v in scheduler.status().shadows}
    assert (views["3"].compared, views["3"].agreed, views["3"].active) == (4, 0, True)
    assert not views["2"].active


async def test_a_request_for_the_shadow_version_itself_is_not_mirrored_and_a_failed_primary_is_not_compared():
    replica = FakeReplica({"1": 1.0, "2": 1.0})
    scheduler, _ = make({"r": replica})
    scheduler.set_traffic(TrafficPolicy("m", {}, ShadowPolicy("2")))  # no weights: the latest (v2) is primary
    await scheduler.infer(request())
    await scheduler.infer(request("1"))  # named v1: mirrored to v2
    with pytest.raises(InvalidArgument):
        bad = request("1")
        bad.inputs = [Tensor.from_numpy("x", np.ones((1, 3), dtype=np.float32))]
        await scheduler.infer(bad)  # refused before any copy is made
    await settle(scheduler)
    [view] = scheduler.status().shadows
    assert (view.mirrored, view.compared, view.agreed) == (1, 1, 1)


async def test_shadow_copies_are_sampled_exactly_and_bounded():
    replica = FakeReplica({"1": 1.0, "2": 1.0})
    scheduler, _ = make({"r": replica})
    scheduler.set_traffic(TrafficPolicy("m", {"1": 1}, ShadowPolicy("2", fraction=0.25)))
    for _ in range(40):
        await scheduler.infer(request())
    await settle(scheduler)
    [view] = scheduler.status().shadows
    assert view.mirrored == 10 and view.compared == 10

    # A slow shadow and at most 2 copies in flight: the rest are dropped, and the clients never wait for it.
    slow_shadow = FakeReplica({"1": 1.0, "2": 1.0}, delays={"2": 0.5})
    scheduler, _ = make({"r": slow_shadow}, shadow_max_inflight=2, batching=False, max_inflight_batches=8)
    scheduler.set_traffic(TrafficPolicy("m", {"1": 1}, ShadowPolicy("2")))
    loop = asyncio.get_running_loop()
    started = loop.time()
    responses = await asyncio.gather(*(scheduler.infer(request()) for _ in range(6)))
    assert loop.time() - started < 0.4 and {r.version for r in responses} == {"1"}
    [view] = scheduler.status().shadows
    assert (view.mirrored, view.dropped, view.inflight) == (6, 4, 2)
    await settle(scheduler)
    [view] = scheduler.status().shadows
    assert (view.compared, view.agreed) == (2, 2)


async def test_a_full_shadow_queue_drops_copies_instead_of_failing_clients():
    mirror = ShadowMirror(lambda req, t: _refuse(), max_inflight=8)
    copy = mirror.begin(ShadowPolicy("2"), request("1"), "1")
    mirror.finish(copy, [_t("y", [1.0])])
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    [counts] = mirror.counts.values()
    assert (counts.mirrored, counts.dropped, counts.errors, counts.compared) == (1, 1, 0, 0)


async def _refuse():
    raise AIWorksError("full", Status.RESOURCE_EXHAUSTED)


async def test_setting_weights_keeps_the_shadow_and_the_reverse():
    scheduler, _ = make({"r": FakeReplica({"1": 1.0, "2": 1.0})})
    scheduler.set_traffic(TrafficPolicy("m", {}, ShadowPolicy("2")))
    scheduler.set_traffic(TrafficPolicy("m", {"1": 90, "2": 10}), keep_shadow=True)  # what a canary controller sends
    policy = scheduler.get_traffic("m")
    assert policy.weights == {"1": 90, "2": 10} and policy.shadow.version == "2"
    scheduler.set_traffic(TrafficPolicy("m", {"1": 90, "2": 10}, None))  # a shadow field with no version
    assert scheduler.get_traffic("m").shadow is None
    with pytest.raises(InvalidArgument):
        scheduler.set_traffic(TrafficPolicy("m", {}, ShadowPolicy("7")))


# ---- drain: retiring versions ---------------------------------------------------------------------


async def test_a_version_a_reload_retires_still_serves_its_queue_then_goes():
    replica = FakeReplica({"1": 1.0, "2": 2.0}, delay_s=0.05)
    replica.reloaded = [spec("2")]  # the reload's version policy keeps v2 only
    scheduler, registry = make({"r": replica}, max_inflight_batches=1, batching=False, drain_timeout_s=5)
    queued = [asyncio.ensure_future(scheduler.infer(request("1"))) for _ in range(4)]
    await asyncio.sleep(0.01)  # one runs, three wait in v1's queue

    await scheduler.load("m")
    assert registry.retiring == {("m", "1"): {"r": spec("1")}}
    assert [q.draining for q in scheduler.status().queues] == [True]
    new = await scheduler.infer(request())
    assert new.version == "2"  # new requests go to what resolution picks now
    with pytest.raises(Unavailable):
        await scheduler.infer(request("1"))
    assert [r.version for r in await asyncio.gather(*queued)] == ["1"] * 4  # v1's queue drained on v1
    for _ in range(100):
        if ("m", "1") not in registry.retiring:
            break
        await asyncio.sleep(0.01)
    assert not registry.retiring and not registry.protected
    assert [(q.model, q.version) for q in scheduler.status().queues] == [("m", "2")]  # v1's queue closed


async def test_unload_refuses_new_requests_and_answers_queued_ones_first():
    replica = FakeReplica({"1": 1.0, "2": 1.0}, delay_s=0.03)
    scheduler, registry = make({"r": replica}, max_inflight_batches=1, batching=False)
    queued = [asyncio.ensure_future(scheduler.infer(request("2"))) for _ in range(5)]
    await asyncio.sleep(0.005)
    unloading = asyncio.ensure_future(scheduler.unload("m"))
    await asyncio.sleep(0.005)
    with pytest.raises(Unavailable, match="being unloaded"):
        await scheduler.infer(request())
    await unloading
    assert all(r.version == "2" for r in await asyncio.gather(*queued))
    assert not registry.closing and not any(k[0] == "m" for k in registry.known)


async def test_the_drainer_gives_up_at_its_timeout():
    now = [0.0]
    busy = {("m", "1"): True, ("m", "2"): False}
    drainer = Drainer(lambda k: busy[k], timeout_s=1.0, poll_s=0.001, clock=lambda: now[0])
    assert await drainer.wait([("m", "2")]) == []
    waiting = asyncio.ensure_future(drainer.wait(busy))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    now[0] = 2.0
    assert await waiting == [("m", "1")] and drainer.timed_out == 1


# ---- pipelines ---------------------------------------------------------------------------------------


def pipeline_spec(steps: list[dict], outputs=("z",), micro: str = "") -> ModelSpec:
    parameters = {"ensemble_scheduling": json.dumps({"step": steps})}
    if micro:
        parameters["micro_batch_rows"] = micro
    return ModelSpec(
        "p",
        "1",
        platform="ensemble",
        max_batch_size=64,
        inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=tuple(TensorSpec(o, "FP32", (2,)) for o in outputs),
        parameters=parameters,
    )


TWO_STEPS = [
    {"model_name": "a", "model_version": "-1", "input_map": {"in": "x"}, "output_map": {"out": "h"}},
    {"model_name": "b", "model_version": "2", "input_map": {"in": "h"}, "output_map": {"out": "z"}},
]


def test_pipeline_steps_must_produce_what_they_read_and_what_the_pipeline_returns():
    steps = parse_steps(pipeline_spec(TWO_STEPS))
    assert [(s.model, s.version) for s in steps] == [("a", ""), ("b", "2")]
    with pytest.raises(InvalidArgument, match="no step produces"):
        parse_steps(pipeline_spec([TWO_STEPS[1]]))
    with pytest.raises(InvalidArgument, match="produced by no step"):
        parse_steps(pipeline_spec(TWO_STEPS, outputs=("z", "w")))
    with pytest.raises(InvalidArgument, match="itself"):
        parse_steps(pipeline_spec([{**TWO_STEPS[0], "model_name": "p"}]))


async def test_micro_batches_overlap_across_stages_and_come_back_in_order():
    events: list[tuple[str, str, int]] = []

    async def stage(model, version, inputs, outputs, priority, deadline_s):
        x = inputs[0].to_numpy()
        first = int(x[0, 0]) - (1 if model == "b" else 0)  # the row index (stage a added 1)
        events.append(("start", model, first))
        await asyncio.sleep(0.02)
        events.append(("end", model, first))
        return [Tensor.from_numpy("out", x + (1 if model == "a" else 100))]

    runner = PipelineRunner(stage)
    spec = pipeline_spec(TWO_STEPS, micro="2")
    x = np.repeat(np.arange(8, dtype=np.float32)[:, None], 2, axis=1)
    request = InferRequest("p", "", [Tensor.from_numpy("x", x)])
    [out] = await runner.run(spec, request, 8, Priority.STANDARD, None)
    np.testing.assert_array_equal(out.to_numpy(), x + 101)
    assert out.name == "z" and runner.micro_batches == 4
    # Micro-batch 1 (rows 2, 3) enters stage a while micro-batch 0 is in stage b; never two at once in a stage.
    assert events.index(("start", "a", 2)) < events.index(("end", "b", 0))
    for model in ("a", "b"):
        starts = [e[2] for e in events if e[:2] == ("start", model)]
        assert starts == [0, 2, 4, 6]
        for k in range(3):
            assert events.index(("end", model, 2 * k)) < events.index(("start", model, 2 * k + 2))
