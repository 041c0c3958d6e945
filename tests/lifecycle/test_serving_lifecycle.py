"""The lifecycle rules on fake replicas: shadows, drains and pipelines, through the scheduler and a gateway's routing.

The scheduler (the control plane) hands its routing table to a gateway's
dispatcher (tests/routing_support.py); the same behaviour runs on the real
processes in tests/e2e/test_shadow.py, test_hot_update.py and
test_pipeline.py; here each rule is pinned down without process start-up or
timing noise.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from routing_support import make as make_suite

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, InvalidArgument, Status, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import ModelSpec, TensorSpec, check_inputs
from aiworks.core.options import RequestOptions, read_options
from aiworks.runtime.client import Answer
from aiworks.scheduler.drain import Drainer
from aiworks.scheduler.pipeline import PipelineRunner, parse_steps
from aiworks.scheduler.shadow import ShadowMirror, answers_agree
from aiworks.scheduler.traffic_state import ShadowPolicy, TrafficPolicy


class FakeReplica:
    """Answers y = x * factor[version] after a delay (per version); counts rows per version.

    It checks its inputs as a runtime does. ``load`` answers with ``reloaded``:
    the versions a reload leaves.
    """

    def __init__(self, factors: dict[str, float], delay_s: float = 0.0, delays: dict[str, float] | None = None):
        self.factors = factors
        self.delays = delays or {}
        self.delay_s = delay_s
        self.rows: dict[str, int] = {}
        self.reloaded: list[ModelSpec] = []
        self.unloads = 0

    async def infer(self, request, options, work=None):
        check_inputs(spec(request.version), request.inputs)
        await asyncio.sleep(self.delays.get(request.version, self.delay_s))
        x = request.inputs[0].to_numpy()
        self.rows[request.version] = self.rows.get(request.version, 0) + len(x)
        return Answer([Tensor.from_numpy("y", (x * self.factors[request.version]).astype(np.float32))])

    async def load(self, model, overrides=None):
        return self.reloaded

    async def unload(self, model, timeout_s=None):
        self.unloads += 1

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
    return make_suite(replicas, [spec(v) for v in versions], **settings)


def request(version: str = "", value: float = 1.0) -> InferRequest:
    return InferRequest("m", version, [Tensor.from_numpy("x", np.full((1, 2), value, dtype=np.float32))])


async def infer(suite, req: InferRequest):
    options = read_options({}, default=suite.dispatcher.default_priority)
    answer = await suite.dispatcher.infer(req, options)
    return req.version, answer


async def settle(suite) -> None:
    for _ in range(200):
        if all(c.inflight == 0 for c in suite.dispatcher.shadows.counts.values()):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("shadow copies never finished")


def shadows(suite):
    return suite.status().shadows


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


# ---- shadow traffic through the gateway's routing -------------------------------------------------


async def test_clients_get_the_primary_and_the_shadow_is_compared_and_counted():
    replica = FakeReplica({"1": 2.0, "2": 2.0, "3": 3.0})
    suite = make({"r": replica}, versions=("1", "2", "3"))
    suite.scheduler.set_traffic(TrafficPolicy("m", {"1": 100}, ShadowPolicy("2")))
    suite.sync()
    for _ in range(10):
        version, answer = await infer(suite, request())
        assert version == "1" and float(answer.outputs[0].to_numpy()[0, 0]) == 2.0
    await settle(suite)
    [view] = shadows(suite)
    assert (view.mirrored, view.compared, view.agreed, view.errors, view.dropped) == (10, 10, 10, 0, 0)
    assert replica.rows == {"1": 10, "2": 10}

    suite.scheduler.set_traffic(TrafficPolicy("m", {"1": 100}, ShadowPolicy("3")))
    suite.sync()
    for _ in range(4):
        assert (await infer(suite, request()))[0] == "1"
    await settle(suite)
    views = {v.shadow_version: v for v in shadows(suite)}
    assert (views["3"].compared, views["3"].agreed, views["3"].active) == (4, 0, True)
    assert not views["2"].active


async def test_a_request_for_the_shadow_version_itself_is_not_mirrored_and_a_failed_primary_is_not_compared():
    replica = FakeReplica({"1": 1.0, "2": 1.0})
    suite = make({"r": replica})
    suite.scheduler.set_traffic(TrafficPolicy("m", {}, ShadowPolicy("2")))  # no weights: the latest (v2) is primary
    suite.sync()
    await infer(suite, request())
    await infer(suite, request("1"))  # named v1: mirrored to v2
    bad = request("1")
    bad.inputs = [Tensor.from_numpy("x", np.ones((1, 3), dtype=np.float32))]
    with pytest.raises(InvalidArgument):
        await infer(suite, bad)  # the replica refuses it; its copy fails too, and nothing is compared
    await settle(suite)
    [view] = shadows(suite)
    assert (view.mirrored, view.compared, view.agreed) == (2, 1, 1)


async def test_shadow_copies_are_sampled_exactly_and_bounded():
    replica = FakeReplica({"1": 1.0, "2": 1.0})
    suite = make({"r": replica})
    suite.scheduler.set_traffic(TrafficPolicy("m", {"1": 1}, ShadowPolicy("2", fraction=0.25)))
    suite.sync()
    for _ in range(40):
        await infer(suite, request())
    await settle(suite)
    [view] = shadows(suite)
    assert view.mirrored == 10 and view.compared == 10

    # A slow shadow and at most 2 copies in flight: the rest are dropped, and the clients never wait for it.
    slow_shadow = FakeReplica({"1": 1.0, "2": 1.0}, delays={"2": 0.5})
    suite = make({"r": slow_shadow}, shadow_max_inflight=2)
    suite.scheduler.set_traffic(TrafficPolicy("m", {"1": 1}, ShadowPolicy("2")))
    suite.sync()
    loop = asyncio.get_running_loop()
    started = loop.time()
    answers = await asyncio.gather(*(infer(suite, request()) for _ in range(6)))
    assert loop.time() - started < 0.4 and {version for version, _ in answers} == {"1"}
    [view] = shadows(suite)
    assert (view.mirrored, view.dropped, view.inflight) == (6, 4, 2)
    await settle(suite)
    [view] = shadows(suite)
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
    suite = make({"r": FakeReplica({"1": 1.0, "2": 1.0})})
    scheduler = suite.scheduler
    scheduler.set_traffic(TrafficPolicy("m", {}, ShadowPolicy("2")))
    scheduler.set_traffic(TrafficPolicy("m", {"1": 90, "2": 10}), keep_shadow=True)  # what a canary controller sends
    policy = scheduler.get_traffic("m")
    assert policy.weights == {"1": 90, "2": 10} and policy.shadow.version == "2"
    scheduler.set_traffic(TrafficPolicy("m", {"1": 90, "2": 10}, None))  # a shadow field with no version
    assert scheduler.get_traffic("m").shadow is None
    with pytest.raises(InvalidArgument):
        scheduler.set_traffic(TrafficPolicy("m", {}, ShadowPolicy("7")))


# ---- drain: retiring versions ---------------------------------------------------------------------


async def test_a_version_a_reload_retires_drains_on_its_replica_then_goes():
    replica = FakeReplica({"1": 1.0, "2": 2.0})
    replica.reloaded = [spec("2")]  # the reload's version policy keeps v2 only
    suite = make({"r": replica}, drain_timeout_s=5)
    registry = suite.registry
    # The replica still holds v1's queue (its heartbeat says so): the scheduler waits for it to empty.
    registry.heartbeat("r", [spec("1"), spec("2")], queues=[_queue("1", 3)])
    await suite.scheduler.load("m")
    assert registry.retiring == {("m", "1"): {"r": spec("1")}}
    suite.sync()
    assert [d.version for d in suite.mirror.table.draining] == ["1"]
    assert (await infer(suite, request()))[0] == "2"  # new requests go to what resolution picks now
    with pytest.raises(Unavailable):
        await infer(suite, request("1"))
    assert ("m", "1") in registry.retiring  # still draining on the replica
    registry.heartbeat("r", [spec("2")], queues=[])  # the replica answered v1's queue and dropped it
    for _ in range(100):
        if ("m", "1") not in registry.retiring:
            break
        await asyncio.sleep(0.02)
    assert not registry.retiring and not registry.protected


async def test_unload_stops_routing_first_then_lets_the_replicas_drain_and_forgets_the_model():
    replica = FakeReplica({"1": 1.0, "2": 1.0})
    suite = make({"r": replica})
    registry = suite.registry
    seen: list = []

    async def slow_unload(model, timeout_s=None):  # the runtime drains its queue of the model meanwhile
        suite.sync()
        seen.append(sorted(registry.closing))
        with pytest.raises(Unavailable, match="being unloaded"):
            await infer(suite, request())
        await asyncio.sleep(0.02)

    replica.unload = slow_unload
    await suite.scheduler.unload("m")
    assert seen == [[("m", "1"), ("m", "2")]]  # routing stopped before the replica unloaded
    assert not registry.closing and not any(k[0] == "m" for k in registry.known)
    suite.sync()
    with pytest.raises(Exception, match="unknown model"):
        await infer(suite, request())


async def test_a_heartbeat_sent_before_the_unload_finished_does_not_bring_the_model_back():
    """CI: `is_model_ready` read true right after `unload_model` returned. The runtime's heartbeat sent while it
    drained, listing the model, arrived after the scheduler had dropped it; the next one, without it, came later."""
    replica = FakeReplica({"1": 1.0, "2": 1.0})
    suite = make({"r": replica})
    registry = suite.registry
    before = list(registry.replicas["r"].models.values())

    async def beats():
        await asyncio.sleep(0.02)
        registry.heartbeat("r", before)  # sent before the runtime unloaded the model
        await asyncio.sleep(0.2)
        registry.heartbeat("r", [])  # its next one, once its backends changed

    async def unload(model, timeout_s=None):
        asyncio.get_running_loop().create_task(beats())

    replica.unload = unload
    await suite.scheduler.unload("m")
    for _ in range(3):  # the model stays gone whatever arrives after the unload answered
        assert not any(k[0] == "m" for k in registry.replicas["r"].models)
        await asyncio.sleep(0.05)


def _queue(version: str, queued: int):
    from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb

    return pb.QueueStatus(model="m", version=version, queued_requests=queued)


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

    async def stage(model, version, inputs, outputs, options):
        x = inputs[0].to_numpy()
        first = int(x[0, 0]) - (1 if model == "b" else 0)  # the row index (stage a added 1)
        events.append(("start", model, first))
        await asyncio.sleep(0.02)
        events.append(("end", model, first))
        return [Tensor.from_numpy("out", x + (1 if model == "a" else 100))]

    runner = PipelineRunner()
    spec = pipeline_spec(TWO_STEPS, micro="2")
    x = np.repeat(np.arange(8, dtype=np.float32)[:, None], 2, axis=1)
    request = InferRequest("p", "", [Tensor.from_numpy("x", x)])
    [out] = await runner.run(spec, request, 8, RequestOptions(), stage)
    np.testing.assert_array_equal(out.to_numpy(), x + 101)
    assert out.name == "z" and runner.micro_batches == 4
    # Micro-batch 1 (rows 2, 3) enters stage a while micro-batch 0 is in stage b; never two at once in a stage.
    assert events.index(("start", "a", 2)) < events.index(("end", "b", 0))
    for model in ("a", "b"):
        starts = [e[2] for e in events if e[:2] == ("start", model)]
        assert starts == [0, 2, 4, 6]
        for k in range(3):
            assert events.index(("end", model, 2 * k)) < events.index(("start", model, 2 * k + 2))
