"""Priorities, aging, deadlines and admission control of the scheduler, on fake replicas."""

import asyncio

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, DeadlineExceeded, InvalidArgument, PayloadTooLarge, Status
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import BatchingConfig, ModelSpec, TensorSpec
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.qos import ClassResolver, Priority, parse_priority, parse_timeout_s
from aiworks.scheduler.queue_state import Entry, QueueState
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.settings import SchedulerSettings


class TaggingReplica:
    """Echoes its input; records the first value of every row it ran, in order."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.rows_seen: list[float] = []
        self.batches = 0

    async def execute(self, model, version, inputs, outputs, timeout_s=None):
        x = inputs[0].to_numpy()
        await asyncio.sleep(self.delay_s)
        self.rows_seen.extend(float(v) for v in x[:, 0])
        self.batches += 1
        return [Tensor.from_numpy("y", x)], 0

    async def close(self):
        pass


def spec(max_batch=4, delay_us=0) -> ModelSpec:
    return ModelSpec(
        "m",
        "1",
        max_batch_size=max_batch,
        inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=(TensorSpec("y", "FP32", (2,)),),
        batching=BatchingConfig(True, delay_us, ()),
    )


def make(replica, model_spec=None, **settings) -> Scheduler:
    registry = ReplicaRegistry(lambda address: replica)
    registry.register("r0", "r0", "cpu", {}, [model_spec or spec()])
    return Scheduler(SchedulerSettings(**settings), registry)


def request(tag: float, rows: int = 1, **parameters) -> InferRequest:
    x = np.full((rows, 2), tag, dtype=np.float32)
    return InferRequest("m", "", [Tensor.from_numpy("x", x)], parameters=parameters)


# ---- parsing ---------------------------------------------------------------------------------


def test_priority_follows_tritons_levels_and_names():
    assert parse_priority(None) is None and parse_priority(0) is None
    assert parse_priority(1) is Priority.REALTIME
    assert parse_priority(2) is Priority.STANDARD
    assert parse_priority(3) is Priority.BATCH
    assert parse_priority(7) is Priority.BATCH
    assert parse_priority("Realtime") is Priority.REALTIME
    assert parse_priority("3") is Priority.BATCH
    for bad in ("urgent", -1, True, 1.5):
        with pytest.raises(InvalidArgument):
            parse_priority(bad)


def test_timeout_is_microseconds_and_zero_means_none():
    assert parse_timeout_s(None) is None and parse_timeout_s(0) is None
    assert parse_timeout_s(250_000) == 0.25
    assert parse_timeout_s("1000") == 0.001
    with pytest.raises(InvalidArgument):
        parse_timeout_s(-5)


def test_tenant_default_applies_when_the_request_names_no_class():
    resolver = ClassResolver(Priority.STANDARD, tenant_default=lambda r: Priority.BATCH)
    assert resolver.priority(InferRequest("m")) is Priority.BATCH
    assert resolver.priority(InferRequest("m", parameters={"priority": 1})) is Priority.REALTIME
    assert ClassResolver(Priority.STANDARD).priority(InferRequest("m")) is Priority.STANDARD


# ---- the queue state machine -----------------------------------------------------------------


def entry(p: Priority, t: float, rows=1, nbytes=8, deadline=None, sig="s") -> Entry:
    return Entry(payload=(p, t), priority=p, rows=rows, nbytes=nbytes, signature=sig, enqueued_s=t, deadline_s=deadline)


def test_higher_classes_go_first_and_aging_bounds_the_wait():
    q = QueueState(max_requests=100, max_bytes=10_000, aging_s=1.0)
    q.admit(entry(Priority.BATCH, 0.0))
    q.admit(entry(Priority.STANDARD, 0.5))
    q.admit(entry(Priority.REALTIME, 1.0))  # rank 1.0 < standard's 1.5 < batch's 2.0
    q.admit(entry(Priority.REALTIME, 2.5))  # rank 2.5: after the batch request that has aged
    order = [q.take(0, 0.0)[0][0].payload for _ in range(4)]
    assert order == [
        (Priority.REALTIME, 1.0),
        (Priority.STANDARD, 0.5),
        (Priority.BATCH, 0.0),
        (Priority.REALTIME, 2.5),
    ]
    assert q.requests == 0 and q.nbytes == 0


def test_a_batch_takes_the_best_matching_requests_up_to_max_rows():
    q = QueueState(max_requests=100, max_bytes=10_000, aging_s=1.0)
    q.admit(entry(Priority.BATCH, 0.0, rows=2))
    q.admit(entry(Priority.REALTIME, 0.1, rows=2, sig="other"))
    q.admit(entry(Priority.STANDARD, 0.2, rows=3))
    q.admit(entry(Priority.REALTIME, 0.3, rows=1))
    batch, _ = q.take(4, 0.0)
    # realtime 0.1 first; its signature differs from the rest, so it leaves alone
    assert [e.payload for e in batch] == [(Priority.REALTIME, 0.1)]
    batch, _ = q.take(4, 0.0)
    assert [e.payload for e in batch] == [(Priority.REALTIME, 0.3), (Priority.STANDARD, 0.2)]
    batch, _ = q.take(4, 0.0)
    assert [e.payload for e in batch] == [(Priority.BATCH, 0.0)]


def test_expired_requests_are_dropped_not_run():
    q = QueueState(max_requests=100, max_bytes=10_000, aging_s=1.0)
    q.admit(entry(Priority.STANDARD, 0.0, deadline=1.0))
    q.admit(entry(Priority.STANDARD, 0.1, deadline=5.0))
    batch, expired = q.take(8, now_s=2.0)
    assert [e.payload for e in batch] == [(Priority.STANDARD, 0.1)]
    assert [e.payload for e in expired] == [(Priority.STANDARD, 0.0)]


def test_bounds_refuse_or_shed_lower_classes():
    q = QueueState(max_requests=3, max_bytes=100, aging_s=1.0)
    for t in (0.0, 0.1):
        assert q.admit(entry(Priority.BATCH, t)) == []
    assert q.admit(entry(Priority.STANDARD, 0.2)) == []
    assert q.admit(entry(Priority.BATCH, 0.3)) is None  # full, and nothing lower to shed
    assert q.admit(entry(Priority.REALTIME, 0.4)) == [(Priority.BATCH, 0.1)]  # the youngest batch request
    assert q.counts == {Priority.REALTIME: 1, Priority.STANDARD: 1, Priority.BATCH: 1}
    # 90 bytes more need both lower requests gone (the byte bound), batch first
    assert q.admit(entry(Priority.REALTIME, 0.5, nbytes=90)) == [(Priority.BATCH, 0.0), (Priority.STANDARD, 0.2)]
    assert q.admit(entry(Priority.REALTIME, 0.6, nbytes=5)) is None  # only realtime left: refused
    assert q.nbytes == 8 + 90 and q.requests == 2


def test_removed_entries_free_their_room_and_do_not_pile_up():
    q = QueueState(max_requests=10, max_bytes=10_000, aging_s=1.0)
    for i in range(10_000):
        e = entry(Priority.STANDARD, float(i))
        assert q.admit(e) is not None
        q.remove(e)
    assert q.requests == 0 and q.peek() is None
    assert sum(len(lane) for lane in q._lanes.values()) < 100


# ---- through the scheduler -------------------------------------------------------------------


async def test_under_contention_realtime_is_served_before_batch():
    replica = TaggingReplica(delay_s=0.02)
    scheduler = make(replica, spec(max_batch=2), max_inflight_batches=1, priority_aging_ms=10_000)
    blocker = asyncio.ensure_future(scheduler.infer(request(-1)))  # occupies the replica
    await asyncio.sleep(0.005)
    tasks = [asyncio.ensure_future(scheduler.infer(request(3.0, priority=3))) for _ in range(6)]
    tasks += [asyncio.ensure_future(scheduler.infer(request(1.0, priority=1))) for _ in range(4)]
    tasks += [asyncio.ensure_future(scheduler.infer(request(2.0))) for _ in range(4)]
    await asyncio.gather(blocker, *tasks)
    served = replica.rows_seen[1:]
    assert served == [1.0] * 4 + [2.0] * 4 + [3.0] * 6


async def test_aging_lets_batch_requests_through_under_sustained_realtime_load():
    replica = TaggingReplica(delay_s=0.01)
    scheduler = make(replica, spec(max_batch=1), max_inflight_batches=1, priority_aging_ms=20)
    stop = asyncio.Event()

    async def realtime_client():
        while not stop.is_set():
            await scheduler.infer(request(1.0, priority="realtime"))

    clients = [asyncio.ensure_future(realtime_client()) for _ in range(4)]
    await asyncio.sleep(0.05)
    done = await asyncio.wait_for(scheduler.infer(request(3.0, priority="batch")), timeout=2.0)
    stop.set()
    await asyncio.gather(*clients)
    assert done.outputs[0].to_numpy()[0, 0] == 3.0


async def test_a_request_whose_deadline_passes_in_the_queue_is_dropped_with_504():
    replica = TaggingReplica(delay_s=0.15)
    scheduler = make(replica, spec(max_batch=1), max_inflight_batches=1)
    blocker = asyncio.ensure_future(scheduler.infer(request(-1)))
    await asyncio.sleep(0.01)
    with pytest.raises(DeadlineExceeded) as info:
        await scheduler.infer(request(5.0, timeout=30_000))  # 30 ms, behind a 150 ms batch
    assert info.value.status.http == 504
    await blocker
    await asyncio.sleep(0.01)
    assert 5.0 not in replica.rows_seen  # never ran
    queue = scheduler.status().queues[0]
    assert queue.expired == 1 and queue.queued_requests == 0


async def test_the_transport_deadline_applies_like_the_timeout_parameter():
    replica = TaggingReplica(delay_s=0.15)
    scheduler = make(replica, spec(max_batch=1), max_inflight_batches=1)
    blocker = asyncio.ensure_future(scheduler.infer(request(-1)))
    await asyncio.sleep(0.01)
    with pytest.raises(DeadlineExceeded):
        await scheduler.infer(request(5.0), timeout_s=0.03)
    await blocker


async def test_a_full_queue_answers_429_with_retry_after_and_stays_bounded():
    replica = TaggingReplica(delay_s=0.05)
    scheduler = make(replica, spec(max_batch=1), max_inflight_batches=1, max_queue_requests=5)
    tasks = [asyncio.ensure_future(scheduler.infer(request(float(i)))) for i in range(40)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    rejected = [r for r in results if isinstance(r, AIWorksError)]
    assert rejected and all(r.status is Status.RESOURCE_EXHAUSTED for r in rejected)
    assert all(r.status.http == 429 and r.retry_after_s >= 1 for r in rejected)
    served = [r for r in results if not isinstance(r, BaseException)]
    assert len(served) >= 5 and len(served) + len(rejected) == 40
    assert scheduler.status().queues[0].rejected == len(rejected)


async def test_a_request_larger_than_the_byte_bound_is_refused_as_too_large():
    scheduler = make(TaggingReplica(), spec(max_batch=4), max_queue_bytes=16)
    with pytest.raises(PayloadTooLarge):
        await scheduler.infer(request(1.0, rows=4))  # 32 bytes


async def test_realtime_sheds_queued_batch_requests_when_full():
    replica = TaggingReplica(delay_s=0.05)
    scheduler = make(replica, spec(max_batch=1), max_inflight_batches=1, max_queue_requests=3)
    blocker = asyncio.ensure_future(scheduler.infer(request(-1)))
    await asyncio.sleep(0.01)
    batch = [asyncio.ensure_future(scheduler.infer(request(3.0, priority=3))) for _ in range(3)]
    await asyncio.sleep(0.005)
    urgent = await scheduler.infer(request(1.0, priority=1))
    assert urgent.outputs[0].to_numpy()[0, 0] == 1.0
    results = await asyncio.gather(blocker, *batch, return_exceptions=True)
    shed = [r for r in results if isinstance(r, AIWorksError)]
    assert len(shed) == 1 and shed[0].status is Status.RESOURCE_EXHAUSTED


# ---- the servicer: deadlines from the message and the call, Retry-After on the stream ---------


class FakeContext:
    def __init__(self, time_remaining=None):
        self._remaining = time_remaining
        self.aborted = None
        self.trailing = ()

    def time_remaining(self):
        return self._remaining

    def set_trailing_metadata(self, md):
        self.trailing = md

    async def abort(self, code, message):
        self.aborted = (code, message)
        raise RuntimeError("aborted")


def pb_request(tag: float, **kwargs):
    from aiworks.core.converters import from_infer_request

    message = from_infer_request(request(tag))
    for k, v in kwargs.items():
        setattr(message, k, v)
    return message


async def test_the_servicer_honours_timeout_us_and_the_grpc_deadline():
    import grpc

    from aiworks.scheduler.servicer import SchedulerServicer

    replica = TaggingReplica(delay_s=0.15)
    servicer = SchedulerServicer(make(replica, spec(max_batch=1), max_inflight_batches=1))
    blocker = asyncio.ensure_future(servicer.Infer(pb_request(-1), FakeContext()))
    await asyncio.sleep(0.01)
    for message, context in [(pb_request(1, timeout_us=30_000), FakeContext()), (pb_request(2), FakeContext(0.03))]:
        with pytest.raises(RuntimeError, match="aborted"):
            await servicer.Infer(message, context)
        assert context.aborted[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    await blocker


async def test_a_429_on_the_stream_carries_retry_after():
    from aiworks.scheduler.servicer import SchedulerServicer

    replica = TaggingReplica(delay_s=0.05)
    servicer = SchedulerServicer(make(replica, spec(max_batch=1), max_inflight_batches=1, max_queue_requests=1))
    replies = await asyncio.gather(*(servicer._infer_on_stream(pb_request(float(i))) for i in range(5)))
    refused = [r for r in replies if r.error_code]
    assert refused and all(r.error_code == 8 and r.retry_after_s >= 1 for r in refused)  # RESOURCE_EXHAUSTED
