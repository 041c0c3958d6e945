"""The batch class's bounded share of a runtime queue while online traffic is about (issue #19).

The rule on a fake clock (QueueState is a state machine with no I/O), the
slot arithmetic, and a ModelQueue over a model that runs only when the test
lets it, so what runs at once is counted, not timed.
"""

import asyncio

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import BatchingConfig, ModelSpec, TensorSpec
from aiworks.core.options import ONLINE_LOAD, Priority
from aiworks.runtime.batcher import ModelQueue, QueueLimits, batch_slot_cap
from aiworks.runtime.queue_state import Entry, QueueState

ONLINE, BATCH = Priority.STANDARD, Priority.BATCH


def entry(p: Priority, t: float, rows=1, tag=None) -> Entry:
    return Entry(payload=(p, t if tag is None else tag), priority=p, rows=rows, nbytes=8, signature="s", enqueued_s=t)


def state(share=0.25, window_s=0.1) -> QueueState:
    return QueueState(max_requests=100, max_bytes=10_000, aging_s=1.0, batch_share=share, online_window_s=window_s)


# ---- the rule on a fake clock ------------------------------------------------------------------


def test_batch_rows_are_capped_only_while_online_is_queued_or_recent():
    q = state(share=0.25, window_s=0.1)
    q.admit(entry(BATCH, 0.0, rows=8))
    assert q.batch_rows_cap(64, now_s=0.0) is None  # no online traffic ever: batch work uses everything
    q.admit(entry(ONLINE, 1.0))
    assert q.batch_rows_cap(64, now_s=1.0) == 16
    assert q.batch_rows_cap(64, now_s=5.0) == 16  # still queued: online however long ago it arrived
    q.take(0, now_s=5.0)  # the online request leaves (it ranks first)
    assert q.counts[ONLINE] == 0
    assert q.batch_rows_cap(64, now_s=5.0) is None  # arrived 4 s ago: out of the window
    q.admit(entry(Priority.REALTIME, 6.0))
    q.take(0, now_s=6.0)
    q.take(0, now_s=6.0)  # the batch request (aged first) and the realtime one
    assert q.requests == 0
    assert q.batch_rows_cap(64, now_s=6.05) == 16  # gone, but arrived 50 ms ago
    assert q.online_quiet_in(6.05) == pytest.approx(0.05)
    assert q.batch_rows_cap(64, now_s=6.2) is None and q.online_quiet_in(6.2) == 0.0
    assert q.batch_rows_cap(2, now_s=6.05) == 1  # never under one request


def test_a_full_share_turns_the_rule_off():
    q = state(share=1.0)
    q.admit(entry(ONLINE, 0.0))
    assert q.batch_rows_cap(64, now_s=0.0) is None


def test_take_bounds_the_batch_class_rows_and_fills_with_online_first():
    q = state()
    for i in range(3):
        q.admit(entry(BATCH, 0.0, rows=8, tag=i))
    q.admit(entry(ONLINE, 0.5, rows=1))
    batch, _ = q.take(64, now_s=0.5, batch_rows=16)
    assert [e.payload for e in batch] == [(ONLINE, 0.5), (BATCH, 0), (BATCH, 1)]  # 8 + 8 batch rows, not 24
    batch, _ = q.take(64, now_s=0.5, batch_rows=None)
    assert [e.payload for e in batch] == [(BATCH, 2)]


def test_take_with_no_batch_share_leaves_batch_requests_queued():
    q = state()
    q.admit(entry(BATCH, 0.0))  # ranks first: it has aged past the online one
    q.admit(entry(ONLINE, 2.5))
    batch, _ = q.take(64, now_s=3.0, batch_rows=0)
    assert [e.payload for e in batch] == [(ONLINE, 2.5)]
    batch, _ = q.take(64, now_s=3.0, batch_rows=0)
    assert batch == [] and q.counts[BATCH] == 1


def test_a_batch_request_larger_than_the_cap_still_runs_whole_on_its_own():
    q = state()
    q.admit(entry(BATCH, 0.0, rows=40))
    q.admit(entry(BATCH, 0.0, rows=1, tag="small"))
    batch, _ = q.take(64, now_s=0.0, batch_rows=16)
    assert [e.rows for e in batch] == [40]  # whole requests only; nothing joins it past the cap


def test_the_batch_lane_takes_batch_class_requests_only():
    q = state()
    q.admit(entry(BATCH, 0.0, rows=8, tag="job"))
    q.admit(entry(ONLINE, 0.0, rows=1, tag="online"))  # ranks first
    assert q.online_queued and q.batch_rows == 8 and q.rows == 9
    batch, _ = q.take(64, now_s=0.0, batch_rows=16, online=False)
    assert [e.payload for e in batch] == [(BATCH, "job")] and q.batch_rows == 0
    batch, _ = q.take(64, now_s=0.0, batch_rows=0)
    assert [e.payload for e in batch] == [(ONLINE, "online")] and not q.online_queued


@pytest.mark.parametrize(
    ("slots", "share", "cap"),
    [(1, 0.25, 1), (2, 0.25, 1), (2, 0.9, 1), (4, 0.5, 2), (4, 0.25, 1), (8, 0.25, 2), (4, 1.0, 4)],
)
def test_batch_slots_are_a_share_but_at_least_one_and_never_the_last(slots, share, cap):
    assert batch_slot_cap(slots, share) == cap


# ---- a queue over a model the test steps ------------------------------------------------------


class Stepped:
    """A model that runs a batch only when the test releases it; records the classes running at once."""

    def __init__(self):
        self.running: list[float] = []  # tags of the batches running now
        self.release = asyncio.Event()

    async def __call__(self, inputs, outputs):
        x = inputs[0].to_numpy()
        tag = float(x[0, 0])
        self.running.append(tag)
        try:
            await self.release.wait()
        finally:
            self.running.remove(tag)
        return [Tensor.from_numpy("y", x)], 0


def two_slot_queue(model, *, share=0.5, window_s=30.0, slots=2, lane=None) -> ModelQueue:
    spec = ModelSpec(
        "m", "1", max_batch_size=0, inputs=(TensorSpec("x", "FP32", (2,)),), outputs=(TensorSpec("y", "FP32", (2,)),),
        batching=BatchingConfig(False, 0, ()), instance_count=slots,
    )  # fmt: skip
    limits = QueueLimits(aging_s=0.1, batch_share_when_online=share, online_window_s=window_s)
    return ModelQueue(spec, model, batching=False, limits=limits, run_lane=lane)


def submit(q: ModelQueue, tag: float, priority: Priority):
    x = np.full((1, 2), tag, dtype=np.float32)
    return asyncio.ensure_future(q.submit(InferRequest("m", "1", [Tensor.from_numpy("x", x)]), 1, priority))


async def settle():
    for _ in range(20):
        await asyncio.sleep(0)


async def test_batch_work_keeps_a_slot_free_for_online_requests():
    model = Stepped()
    q = two_slot_queue(model)
    try:
        model.release.set()
        await submit(q, 0.0, ONLINE)  # online traffic was here a moment ago (the window is 30 s)
        model.release.clear()
        jobs = [submit(q, 10.0 + i, BATCH) for i in range(3)]
        await settle()
        assert model.running == [10.0]  # one of two slots: the other waits for online requests
        online = submit(q, 1.0, ONLINE)
        await settle()
        assert sorted(model.running) == [1.0, 10.0]  # served at once, beside the batch request
        model.release.set()
        assert (await online).outputs[0].to_numpy()[0, 0] == 1.0
        assert [(await j).outputs[0].to_numpy()[0, 0] for j in jobs] == [10.0, 11.0, 12.0]
    finally:
        await q.close()


async def test_with_the_batch_lane_an_online_request_never_waits_for_a_batch_jobs_batch():
    """One instance slot. Without the lane a running batch-class batch holds it and an online request waits
    (the test above keeps a second slot free for that); with the lane the job's batches run beside the slot,
    one at a time, and online requests take the slot at once."""
    slot, lane = Stepped(), Stepped()
    q = two_slot_queue(slot, slots=1, lane=lane)
    try:
        jobs = [submit(q, 10.0 + i, BATCH) for i in range(3)]
        await settle()
        assert lane.running == [10.0] and slot.running == []  # the lane's one batch; nothing holds the slot
        online = [submit(q, 1.0, ONLINE), submit(q, 2.0, ONLINE)]
        await settle()
        assert slot.running == [1.0] and lane.running == [10.0], "served at once, beside the job's batch"
        assert q.running == 2 and not q.idle
        slot.release.set()
        assert [(await o).outputs[0].to_numpy()[0, 0] for o in online] == [1.0, 2.0]
        assert lane.running == [10.0], "the job's batch still runs; the online ones came and went"
        lane.release.set()
        assert [(await j).outputs[0].to_numpy()[0, 0] for j in jobs] == [10.0, 11.0, 12.0]
        assert q.idle
    finally:
        await q.close()


async def test_the_lane_runs_as_many_batches_as_slots_and_only_its_share_while_online_is_about():
    for online_first, expected in ((False, [10.0, 11.0]), (True, [10.0])):
        slot, lane = Stepped(), Stepped()
        q = two_slot_queue(slot, lane=lane)  # two slots, a share of 0.5: one lane batch while online is about
        try:
            if online_first:
                slot.release.set()
                await submit(q, 0.0, ONLINE)  # within the 30-s window from now on
            jobs = [submit(q, 10.0 + i, BATCH) for i in range(3)]
            await settle()
            assert sorted(lane.running) == expected and slot.running == []
            lane.release.set()
            await asyncio.gather(*jobs)
        finally:
            await q.close()


async def test_without_online_traffic_batch_work_uses_every_slot():
    model = Stepped()
    q = two_slot_queue(model)
    try:
        jobs = [submit(q, 10.0 + i, BATCH) for i in range(3)]
        await settle()
        assert sorted(model.running) == [10.0, 11.0]
        model.release.set()
        await asyncio.gather(*jobs)
    finally:
        await q.close()


async def test_batch_work_takes_every_slot_again_once_the_window_has_passed():
    model = Stepped()
    q = two_slot_queue(model, window_s=0.05)
    try:
        model.release.set()
        await submit(q, 0.0, ONLINE)
        model.release.clear()
        jobs = [submit(q, 10.0 + i, BATCH) for i in range(3)]
        await settle()
        assert model.running == [10.0]
        for _ in range(200):  # the held request starts when the window ends; no fixed sleep to guess
            if len(model.running) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(model.running) == [10.0, 11.0]
        model.release.set()
        await asyncio.gather(*jobs)
    finally:
        await q.close()


# ---- the online_load signal on batch-class answers ----------------------------------------------


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def signalling_queue(clock: Clock, *, share=1.0, window_s=0.1, max_batch_size=0) -> ModelQueue:
    spec = ModelSpec(
        "m", "1", max_batch_size=max_batch_size, inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=(TensorSpec("y", "FP32", (2,)),), batching=BatchingConfig(max_batch_size > 0, 0, ()),
    )  # fmt: skip
    limits = QueueLimits(aging_s=0.1, batch_share_when_online=share, online_window_s=window_s)
    return ModelQueue(spec, Stepped(), batching=max_batch_size > 0, limits=limits, clock=clock)


@pytest.mark.parametrize("share", [1.0, 0.25])  # the signal does not depend on the share rule being on
async def test_batch_answers_say_whether_online_traffic_is_within_the_window(share):
    clock = Clock()
    q = signalling_queue(clock, share=share)
    q._run_batch.release.set()
    try:
        assert (await submit(q, 1.0, BATCH)).parameters == {ONLINE_LOAD: False}  # nothing online yet
        assert (await submit(q, 2.0, ONLINE)).parameters == {}  # online answers carry nothing
        clock.now += 0.05  # within the 100 ms window of that online request
        assert (await submit(q, 3.0, BATCH)).parameters == {ONLINE_LOAD: True}
        clock.now += 0.06  # past it
        assert (await submit(q, 4.0, BATCH)).parameters == {ONLINE_LOAD: False}
    finally:
        await q.close()


async def test_an_online_request_queued_when_the_batch_ends_sets_the_signal():
    clock = Clock()
    q = signalling_queue(clock, window_s=0.0)  # no window: only queued online requests count
    model = q._run_batch
    try:
        job = submit(q, 10.0, BATCH)
        await settle()
        assert model.running == [10.0]
        online = submit(q, 1.0, ONLINE)  # waits behind the running batch request (one slot)
        await settle()
        model.release.set()
        answer = await job
        assert answer.parameters == {ONLINE_LOAD: True}
        assert (await online).parameters == {}
        assert (await submit(q, 11.0, BATCH)).parameters == {ONLINE_LOAD: False}
    finally:
        await q.close()


async def test_in_a_mixed_batch_only_the_batch_class_rows_carry_the_signal():
    clock = Clock()
    q = signalling_queue(clock, max_batch_size=8)
    model = q._run_batch
    try:
        first = submit(q, 9.0, BATCH)  # holds the one slot while the others queue
        await settle()
        rest = [submit(q, 1.0, ONLINE), submit(q, 10.0, BATCH), submit(q, 11.0, BATCH)]
        await settle()
        model.release.set()
        answers = [await first] + [await r for r in rest]
        assert [a.outputs[0].to_numpy()[0, 0] for a in answers] == [9.0, 1.0, 10.0, 11.0]  # each its own row back
        assert [a.parameters for a in answers] == [{ONLINE_LOAD: True}, {}, {ONLINE_LOAD: True}, {ONLINE_LOAD: True}]
        assert q.batches == 2  # the three queued ones ran as one batch
    finally:
        await q.close()
