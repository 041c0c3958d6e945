"""Result streams' store against a private redis-server: names, records, trimming, the bounded publisher, rules."""

from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest
import redis.asyncio as redis

from aiworks.core import metrics
from aiworks.core.datatypes import Tensor
from aiworks.core.errors import InvalidArgument, PayloadTooLarge
from aiworks.core.inference import InferRequest, InferResponse
from aiworks.streams.store import (
    FIELD,
    Publisher,
    Reader,
    StreamRule,
    check_entry_id,
    check_name,
    result_record,
    stream_key,
)


def _response(label: int, probabilities=None) -> InferResponse:
    probs = np.asarray(probabilities if probabilities is not None else [0.1, 0.9], dtype=np.float32)
    outputs = [Tensor.from_numpy("label", np.asarray([label], dtype=np.int64)),
               Tensor.from_numpy("probabilities", probs.reshape(1, -1))]  # fmt: skip
    return InferResponse("digits", "1", outputs, id="r1")


def test_names_and_ids_are_checked_and_named_in_the_error():
    assert check_name("plant-7.line_2") == "plant-7.line_2"
    for bad in ("", "has space", "a/b", "-lead", "x" * 65, "é"):
        with pytest.raises(InvalidArgument, match="stream name") as caught:
            check_name(bad)
        assert bad[:64] in caught.value.message
    with pytest.raises(InvalidArgument, match="stream name 'int'"):
        check_name(7)
    assert check_entry_id("1700000000000-3") == "1700000000000-3"
    with pytest.raises(InvalidArgument, match="'\\$' is not a stream entry id"):
        check_entry_id("$")
    assert stream_key("alice", "twin") == "aiworks:stream:alice:twin"


def test_a_record_is_compact_json_and_an_oversized_one_is_refused():
    record = result_record(_response(3), "twin", max_bytes=1024)
    assert record["model"] == "digits" and record["version"] == "1" and record["id"] == "r1"
    assert record["outputs"][0] == {"name": "label", "datatype": "INT64", "shape": [1], "data": [3]}
    assert record["outputs"][1]["shape"] == [1, 2]
    assert record["outputs"][1]["data"] == pytest.approx([0.1, 0.9])
    big = _response(1, np.zeros(10_000))
    with pytest.raises(PayloadTooLarge, match="stream 'twin': at most 1024 bytes"):
        result_record(big, "twin", max_bytes=1024)


def test_rules_match_on_one_element_and_are_validated():
    rule = StreamRule("twin", "probabilities", 1, ">", 0.8, "alerts")
    event = rule.match(result_record(_response(1), "twin", 1024))
    assert event["value"] == pytest.approx(0.9) and event["stream"] == "twin" and event["id"] == "r1"
    assert rule.match(result_record(_response(1, [0.3, 0.7]), "twin", 1024)) is None
    assert StreamRule("twin", "probabilities", 5, ">", 0.0, "alerts").match(
        result_record(_response(1), "twin", 1024)) is None  # fmt: skip
    for kwargs, message in (({"op": "~"}, "rule op"), ({"event_stream": "twin"}, "same stream"),
                            ({"stream": "no good"}, "rule stream"), ({"index": -1}, "negative")):  # fmt: skip
        fields = {"stream": "twin", "output": "label", "index": 0, "op": "==", "value": 3, "event_stream": "a"}
        with pytest.raises(ValueError, match=message):
            StreamRule(**{**fields, **kwargs})


def test_publisher_appends_trims_fires_rules_and_drops_when_full(redis_url):
    async def run():
        client = redis.Redis.from_url(redis_url)
        publisher = Publisher(client, max_len=100, queue_size=10_000)
        publisher.start()
        rule = StreamRule("twin", "label", 0, "==", 3, "alerts")
        published = metrics.STREAM_PUBLISHED._value.get()
        for i in range(2000):
            assert publisher.publish("alice", "twin", result_record(_response(i % 10), "twin", 1024), (rule,))
        await asyncio.wait_for(publisher.queue.join(), 30)
        assert metrics.STREAM_PUBLISHED._value.get() - published == 2000
        length = await client.xlen(stream_key("alice", "twin"))
        assert 100 <= length < 400  # MAXLEN ~ trims whole macro nodes: about the bound, never all 2000
        alerts = await client.xrange(stream_key("alice", "alerts"))
        assert alerts and all(orjson.loads(f[FIELD])["value"] == 3 for _, f in alerts)
        assert await client.exists(stream_key("bob", "twin")) == 0
        reader = Reader(client)
        newest = await reader.last_id(stream_key("alice", "twin"))
        assert await reader.after(stream_key("alice", "twin"), newest, 10, 10) == []
        await publisher.close()

        # Nobody drains the queue: the 4th record is dropped and counted, the caller never waits.
        stalled = Publisher(client, queue_size=3)
        dropped = metrics.STREAM_PUBLISH_DROPPED.labels("queue_full")._value.get()
        results = [stalled.publish("alice", "twin", {"n": i}) for i in range(5)]
        assert results == [True, True, True, False, False]
        assert metrics.STREAM_PUBLISH_DROPPED.labels("queue_full")._value.get() - dropped == 2
        await client.aclose()

    asyncio.run(run())


def test_a_consumer_group_shares_entries_and_claims_what_a_dead_member_left(redis_url):
    async def run():
        client = redis.Redis.from_url(redis_url)
        key = stream_key("alice", "twin")
        for i in range(10):
            await client.xadd(key, {FIELD: orjson.dumps({"n": i})})
        reader = Reader(client, claim_idle_s=0.2)
        await reader.join(key, "g", "0")
        await reader.join(key, "g", "0")  # joining again is harmless
        first = await reader.take(key, "g", "a", 4, 10)
        second = await reader.take(key, "g", "b", 100, 10)
        assert len(first) == 4 and len(second) == 6 and not {e for e, _ in first} & {e for e, _ in second}
        await reader.ack(key, "g", [e for e, _ in second])
        await asyncio.sleep(0.3)  # "a" never acknowledged: "b" takes its entries over
        again = await reader.take(key, "g", "b", 100, 10)
        assert [e for e, _ in again] == [e for e, _ in first]
        await reader.ack(key, "g", [e for e, _ in again])
        assert (await client.xpending(key, "g"))["pending"] == 0
        await client.aclose()

    asyncio.run(run())


def test_the_publish_parameter_is_taken_out_of_the_request_and_refused_when_streams_are_off():
    from aiworks.gateway.dataplane import GatewayDataPlane

    request = InferRequest("digits", parameters={"publish": "twin", "priority": "batch"})
    off = GatewayDataPlane(scheduler=None, routing=None)
    with pytest.raises(InvalidArgument, match="result streams are off"):
        off._publish_target(request)
    on = GatewayDataPlane(scheduler=None, routing=None, streams=Publisher(None))
    request = InferRequest("digits", parameters={"publish": "twin", "priority": "batch"})
    assert on._publish_target(request) == "twin" and request.parameters == {"priority": "batch"}
    with pytest.raises(InvalidArgument, match="stream name 'a b'"):
        on._publish_target(InferRequest("digits", parameters={"publish": "a b"}))
    assert on._publish_target(InferRequest("digits")) is None
