"""Result streams over gRPC server streaming, slow-consumer policies and gap events, against the suite.

Subscribers are grpc.aio stubs generated from proto/aiworks/streams/v1/streams.proto (the module
a client builds the same way), and httpx over SSE for the gap event. The suite's gateway runs with
a send timeout of 1 s and 50 events per read (tests/tiers/conftest.py); its tenants' stream
"patient" has the ``pause`` policy, every other stream ``drop``. Each test uses its own streams.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import orjson
import pytest
import redis

from aiworks.pb.streams.v1 import streams_pb2 as pb
from aiworks.pb.streams.v1 import streams_pb2_grpc

from .test_batch_jobs import _digits
from .test_streams import Subscriber, _gateway_metric, _publish, _rss_bytes, _wait_entries

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _metadata(batch, tenant: str) -> tuple:
    return tuple(batch.headers(tenant).items())


async def _read(call, count: int, timeout_s: float = 30.0, kinds=("record",)) -> list:
    """The next ``count`` events of ``call`` whose kind is in ``kinds`` (heartbeats skipped)."""
    got = []
    async with asyncio.timeout(timeout_s):
        while len(got) < count:
            event = await call.read()
            assert event is not grpc.aio.EOF, f"the stream ended after {len(got)} events"
            if event.event in kinds:
                got.append(event)
    return got


def _order(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq)


def test_results_arrive_over_grpc_server_streaming_and_resume_after_an_id(batch_suite):
    rows = _digits(6)
    labels = [_publish(batch_suite, "alice", rows[0], "g-line")]
    _wait_entries(batch_suite, "alice", "g-line", 1)

    async def run():
        async with grpc.aio.insecure_channel(batch_suite.suite.grpc_url) as channel:
            stub = streams_pb2_grpc.ResultStreamsStub(channel)
            metadata = _metadata(batch_suite, "alice")
            live = stub.Subscribe(pb.SubscribeRequest(name="g-line", from_id="0"), metadata=metadata)
            first = await _read(live, 1)
            for i, row in enumerate(rows[1:]):
                labels.append(await asyncio.to_thread(_publish, batch_suite, "alice", row, "g-line",
                                                      "grpc" if i % 2 else "http"))  # fmt: skip
            events = first + await _read(live, 5)
            live.cancel()
            assert [orjson.loads(e.data)["outputs"][0]["data"][0] for e in events] == labels
            ids = [e.id for e in events]
            assert ids == sorted(ids, key=_order) and len(set(ids)) == 6
            record = orjson.loads(events[0].data)
            assert record["model"] == "digits" and {o["name"] for o in record["outputs"]} == {"label", "probabilities"}
            # Resume after an id: the stream continues after it, as SSE's Last-Event-ID does.
            resumed = stub.Subscribe(pb.SubscribeRequest(name="g-line", from_id=ids[2]), metadata=metadata)
            assert [e.id for e in await _read(resumed, 3)] == ids[3:]
            resumed.cancel()
            # The same entries over SSE, field for field.
            sse = await asyncio.to_thread(
                lambda: Subscriber(
                    f"{batch_suite.base}/v2/streams/g-line?from={ids[2]}", batch_suite.headers("alice"), count=3
                ).wait()
            )
            assert [e["id"] for e in sse] == ids[3:] and [orjson.loads(e["data"]) for e in sse] == [
                orjson.loads(e.data) for e in events[3:]]  # fmt: skip

    asyncio.run(run())


def test_grpc_subscriptions_are_refused_with_the_status_naming_the_problem(batch_suite):
    _publish(batch_suite, "alice", _digits(1)[0], "g-private")
    _wait_entries(batch_suite, "alice", "g-private", 1)

    async def refusal(request, metadata=()) -> grpc.aio.AioRpcError:
        async with grpc.aio.insecure_channel(batch_suite.suite.grpc_url) as channel:
            call = streams_pb2_grpc.ResultStreamsStub(channel).Subscribe(request, metadata=metadata)
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await _read(call, 1, timeout_s=10)
            return caught.value

    async def run():
        alice, bob = _metadata(batch_suite, "alice"), _metadata(batch_suite, "bob")
        error = await refusal(pb.SubscribeRequest(name="g-private"))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        error = await refusal(pb.SubscribeRequest(name="g-private"), (("authorization", "Bearer not-a-key"),))
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED
        error = await refusal(pb.SubscribeRequest(name="g-private"), bob)  # another tenant's: not there
        assert error.code() == grpc.StatusCode.NOT_FOUND and "'g-private'" in error.details()
        for request, named in ((pb.SubscribeRequest(name="no good"), "stream name 'no good'"),
                               (pb.SubscribeRequest(name=""), "stream name ''"),
                               (pb.SubscribeRequest(name="g-private", group="a b"), "group name 'a b'"),
                               (pb.SubscribeRequest(name="g-private", from_id="yesterday"), "'yesterday'")):  # fmt: skip
            error = await refusal(request, alice)
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and named in error.details(), error.details()

    asyncio.run(run())


def test_grpc_subscribers_of_one_group_share_the_stream_and_leave_nothing_pending(batch_suite):
    _publish(batch_suite, "alice", _digits(1)[0], "g-shared")
    _wait_entries(batch_suite, "alice", "g-shared", 1)

    async def run():
        async with grpc.aio.insecure_channel(batch_suite.suite.grpc_url) as channel:
            stub = streams_pb2_grpc.ResultStreamsStub(channel)
            metadata = _metadata(batch_suite, "alice")
            members = [stub.Subscribe(pb.SubscribeRequest(name="g-shared", group="twins", consumer=f"m{i}"),
                                      metadata=metadata) for i in range(2)]  # fmt: skip
            await asyncio.sleep(1.0)  # both joined (the group starts at the stream's end)
            for row in _digits(20):
                await asyncio.to_thread(_publish, batch_suite, "alice", row, "g-shared")
            got: dict[int, list] = {0: [], 1: []}

            async def drain(i: int) -> None:
                try:
                    async with asyncio.timeout(4.0):
                        while True:
                            event = await members[i].read()
                            if event.event == "record":
                                got[i].append(event.id)
                except TimeoutError:
                    pass

            await asyncio.gather(drain(0), drain(1))
            for member in members:
                member.cancel()
            ids = got[0] + got[1]
            assert len(ids) == 20 and len(set(ids)) == 20 and got[0] and got[1]

    asyncio.run(run())
    pending = redis.Redis.from_url(batch_suite.redis_url).xpending("aiworks:stream:alice:g-shared", "twins")
    assert pending["pending"] == 0


def test_a_subscriber_resuming_from_a_trimmed_id_gets_a_gap_event_first_over_grpc_and_sse(batch_suite):
    store = redis.Redis.from_url(batch_suite.redis_url)
    key = "aiworks:stream:alice:g-trimmed"
    ids = [store.xadd(key, {"r": orjson.dumps({"n": i})}).decode() for i in range(30)]
    store.xtrim(key, maxlen=10, approximate=False)  # what MAXLEN does to a stream a subscriber fell behind on
    kept = [e.decode() for e, _ in store.xrange(key)]
    assert kept == ids[20:]
    gaps_before = _gateway_metric(batch_suite, "aiworks_stream_gaps_total")

    async def run():
        async with grpc.aio.insecure_channel(batch_suite.suite.grpc_url) as channel:
            stub = streams_pb2_grpc.ResultStreamsStub(channel)
            metadata = _metadata(batch_suite, "alice")
            call = stub.Subscribe(pb.SubscribeRequest(name="g-trimmed", from_id=ids[4]), metadata=metadata)
            events = await _read(call, 11, kinds=("record", "gap"))
            call.cancel()
            assert events[0].event == "gap" and events[0].id == ""
            assert orjson.loads(events[0].data) == {"after": ids[4], "first": ids[20]}
            assert [e.id for e in events[1:]] == ids[20:]
            # Not behind the trim: no gap. From "0" (the oldest kept, whatever it is): no gap either.
            for start in (ids[25], "0"):
                call = stub.Subscribe(pb.SubscribeRequest(name="g-trimmed", from_id=start), metadata=metadata)
                events = await _read(call, 4, kinds=("record", "gap"))
                call.cancel()
                assert all(e.event == "record" for e in events), start

    asyncio.run(run())
    sse = Subscriber(f"{batch_suite.base}/v2/streams/g-trimmed",
                     {**batch_suite.headers("alice"), "last-event-id": ids[0]}, count=11).wait()  # fmt: skip
    assert sse[0]["event"] == "gap" and "id" not in sse[0]
    assert orjson.loads(sse[0]["data"]) == {"after": ids[0], "first": ids[20]}
    assert [e["id"] for e in sse[1:]] == ids[20:]
    # A new group asked to start at a trimmed id: its gap too.
    group = Subscriber(f"{batch_suite.base}/v2/streams/g-trimmed?group=late&from={ids[1]}",
                       batch_suite.headers("alice"), count=11).wait()  # fmt: skip
    assert group[0]["event"] == "gap" and orjson.loads(group[0]["data"]) == {"after": ids[1], "first": ids[20]}
    assert sorted((e["id"] for e in group[1:]), key=_order) == ids[20:]
    assert _gateway_metric(batch_suite, "aiworks_stream_gaps_total") - gaps_before == 3
    store.delete(key)
    store.close()


def _flood(store, key: str, entries: int, size: int) -> list[str]:
    record = orjson.dumps({"pad": "x" * size})
    ids = []
    for _ in range(entries // 50):
        pipe = store.pipeline()
        for _ in range(50):
            pipe.xadd(key, {"r": record})
        ids += [i.decode() for i in pipe.execute()]
    return ids


def test_a_grpc_subscriber_that_stops_reading_is_dropped_on_a_drop_stream(batch_suite):
    store = redis.Redis.from_url(batch_suite.redis_url)
    key = "aiworks:stream:alice:g-firehose"
    store.xadd(key, {"r": b"{}"})
    metric = 'aiworks_stream_subscribers_dropped_total{reason="slow"}'
    dropped_before = _gateway_metric(batch_suite, metric)
    pid = batch_suite.suite.supervisor.child("gateway").process.pid
    rss_before = _rss_bytes(pid)

    async def run():
        async with grpc.aio.insecure_channel(batch_suite.suite.grpc_url) as channel:
            call = streams_pb2_grpc.ResultStreamsStub(channel).Subscribe(
                pb.SubscribeRequest(name="g-firehose"), metadata=_metadata(batch_suite, "alice")
            )
            await asyncio.sleep(0.5)
            await asyncio.to_thread(_flood, store, key, 1000, 32_000)  # 32 MB: far more than HTTP/2 windows hold
            deadline = time.monotonic() + 30
            while _gateway_metric(batch_suite, metric) <= dropped_before:
                assert time.monotonic() < deadline, "the slow subscriber was never dropped"
                await asyncio.sleep(0.2)
            # Reading now: what the windows held, then the end of the call.
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                async with asyncio.timeout(30):
                    while await call.read() is not grpc.aio.EOF:
                        pass
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "did not read for 1 s" in caught.value.details()

    asyncio.run(run())
    assert _gateway_metric(batch_suite, "aiworks_stream_subscribers") == 0
    grown = _rss_bytes(pid) - rss_before
    assert grown < 64 << 20, f"the gateway grew {grown} bytes serving one slow subscriber"
    store.delete(key)
    store.close()


def test_a_subscriber_that_stops_reading_is_paused_on_a_pause_stream_and_misses_nothing(batch_suite):
    store = redis.Redis.from_url(batch_suite.redis_url)
    key = "aiworks:stream:alice:patient"  # the tenants file gives this stream the pause policy
    store.xadd(key, {"r": b"{}"})
    pauses_before = _gateway_metric(batch_suite, "aiworks_stream_subscriber_pauses_total")
    dropped_before = _gateway_metric(batch_suite, 'aiworks_stream_subscribers_dropped_total{reason="slow"}')
    pid = batch_suite.suite.supervisor.child("gateway").process.pid
    rss_before = _rss_bytes(pid)

    async def run():
        async with grpc.aio.insecure_channel(batch_suite.suite.grpc_url) as channel:
            call = streams_pb2_grpc.ResultStreamsStub(channel).Subscribe(
                pb.SubscribeRequest(name="patient"), metadata=_metadata(batch_suite, "alice")
            )
            await asyncio.sleep(0.5)
            ids = await asyncio.to_thread(_flood, store, key, 1000, 32_000)
            await asyncio.sleep(3.0)  # not reading for three times the send timeout: still served
            assert _gateway_metric(batch_suite, "aiworks_stream_subscribers") == 1
            grown = _rss_bytes(pid) - rss_before
            assert grown < 64 << 20, f"the gateway grew {grown} bytes holding one paused subscriber"
            events = await _read(call, 1000, timeout_s=60)  # reading again: where it stopped, nothing lost
            call.cancel()
            assert [e.id for e in events] == ids

    asyncio.run(run())
    # A send waited the send timeout or more (counted as it ended): the subscriber was paused, not dropped.
    assert _gateway_metric(batch_suite, "aiworks_stream_subscriber_pauses_total") > pauses_before
    assert _gateway_metric(batch_suite, 'aiworks_stream_subscribers_dropped_total{reason="slow"}') == dropped_before
    store.delete(key)
    store.close()


def test_a_slow_sse_subscriber_of_a_pause_stream_is_paused_not_dropped(batch_suite):
    """The policy is the stream's, whatever the transport: SSE pauses too."""
    store = redis.Redis.from_url(batch_suite.redis_url)
    key = "aiworks:stream:bob:patient"
    store.xadd(key, {"r": b"{}"})
    pauses_before = _gateway_metric(batch_suite, "aiworks_stream_subscriber_pauses_total")
    ids = _flood(store, key, 50, 100)
    reader = Subscriber(f"{batch_suite.base}/v2/streams/patient?from={ids[0]}", batch_suite.headers("bob"),
                        count=1049, idle_s=20.0, stall_s=5.0)  # fmt: skip
    ids += _flood(store, key, 1000, 32_000)  # while the reader stalls: 32 MB, more than the sockets hold
    events = reader.wait(90)
    assert [e["id"] for e in events] == ids[1:]
    assert _gateway_metric(batch_suite, "aiworks_stream_subscriber_pauses_total") > pauses_before
    store.delete(key)
    store.close()
