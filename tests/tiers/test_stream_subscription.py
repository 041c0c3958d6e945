"""The transport-agnostic subscription against a private redis-server: position, gaps, policies, the slot bound.

``send`` here is what a front end passes: a coroutine that takes one event and returns once the
transport took it. A bounded asyncio queue plays the transport: when nobody reads it, it is full,
and ``send`` waits, as a socket or an HTTP/2 window that backed up does.
"""

from __future__ import annotations

import asyncio

import orjson
import pytest
import redis.asyncio as redis

from aiworks.core import metrics
from aiworks.core.errors import InvalidArgument, NotFound, ResourceExhausted
from aiworks.streams.store import FIELD, Reader, stream_key
from aiworks.streams.subscription import DROPPED, DROPPED_ENDING, GAP, HEARTBEAT, RECORD, Event, Subscriptions


class Transport:
    """A subscriber's connection that holds ``room`` events; ``send`` waits while it is full."""

    def __init__(self, room: int):
        self.queue: asyncio.Queue[Event] = asyncio.Queue(maxsize=room)

    async def send(self, event: Event) -> None:
        await self.queue.put(event)

    async def take(self, count: int, timeout_s: float = 10.0) -> list[Event]:
        async with asyncio.timeout(timeout_s):
            return [await self.queue.get() for _ in range(count)]

    async def take_until(self, last_id: str, timeout_s: float = 10.0) -> list[Event]:
        got: list[Event] = []
        async with asyncio.timeout(timeout_s):
            while not got or got[-1].id != last_id:
                got.append(await self.queue.get())
        return got


async def _fill(client, key: str, count: int) -> list[str]:
    return [(await client.xadd(key, {FIELD: orjson.dumps({"n": i})})).decode() for i in range(count)]


def test_open_checks_names_ids_existence_and_the_bound_before_taking_a_slot(redis_url):
    async def run():
        client = redis.Redis.from_url(redis_url)
        hub = Subscriptions(Reader(client), max_subscribers=1)
        await _fill(client, stream_key("alice", "twin"), 1)
        for kwargs, error, named in (({"name": "a b"}, InvalidArgument, "stream name 'a b'"),
                                     ({"name": "twin", "group": "-g"}, InvalidArgument, "group name '-g'"),
                                     ({"name": "twin", "start": "$"}, InvalidArgument, "'\\$' is not a stream entry id"),
                                     ({"name": "ghost"}, NotFound, "no stream 'ghost'")):  # fmt: skip
            with pytest.raises(error, match=named):
                await hub.open("alice", **kwargs)
        with pytest.raises(NotFound):
            await hub.open("bob", "twin")  # the tenant is part of the key
        first = await hub.open("alice", "twin")
        with pytest.raises(ResourceExhausted, match="1 subscribers"):
            await hub.open("alice", "twin")
        first.close()
        first.close()  # once only
        assert hub.active == 0
        (await hub.open("alice", "twin")).close()
        with pytest.raises(ValueError, match="policy 'later'"):
            await hub.open("alice", "twin", policy="later")
        assert hub.active == 0
        await client.aclose()

    asyncio.run(run())


def test_one_tenant_cannot_take_every_slot_from_the_others(redis_url):
    """Each tenant holds at most its share of the replica's slots (its own max_stream_subscribers, else the
    gateway's per-tenant bound); the others still subscribe; a closed subscription gives its slot back;
    demo mode's anonymous tenant has the replica's bound alone."""

    async def run():
        client = redis.Redis.from_url(redis_url)
        hub = Subscriptions(Reader(client), max_subscribers=10, max_per_tenant=2)
        for tenant in ("alice", "bob", ""):
            await _fill(client, stream_key(tenant, "twin"), 1)
        held = [await hub.open("alice", "twin"), await hub.open("alice", "twin")]
        with pytest.raises(ResourceExhausted, match="tenant 'alice' already holds 2 subscriptions") as refused:
            await hub.open("alice", "twin")
        assert refused.value.retry_after_s == 1
        bob = await hub.open("bob", "twin")  # alice's share is full, not the replica
        held[0].close()
        held[0].close()
        held.append(await hub.open("alice", "twin"))  # the closed one's slot is hers again
        assert hub.by_tenant == {"alice": 2, "bob": 1}
        big = [await hub.open("bob", "twin", tenant_limit=4) for _ in range(3)]  # bob's own bound: 4 in all
        with pytest.raises(ResourceExhausted, match="holds 4"):
            await hub.open("bob", "twin", tenant_limit=4)
        anonymous = [await hub.open("", "twin") for _ in range(4)]  # 2 + 4 + 4: the replica is full now
        with pytest.raises(ResourceExhausted, match="already serves 10"):
            await hub.open("", "twin")
        for subscription in [*held, bob, *big, *anonymous]:
            subscription.close()
        assert hub.active == 0 and hub.by_tenant == {}
        await client.aclose()

    asyncio.run(run())


def test_resume_sends_what_follows_and_a_trimmed_position_gets_a_gap_first(redis_url):
    async def run():
        client = redis.Redis.from_url(redis_url)
        key = stream_key("alice", "twin")
        ids = await _fill(client, key, 30)
        hub = Subscriptions(Reader(client), buffer_events=4, block_ms=50)

        async def events(start: str, count: int) -> list[Event]:
            transport = Transport(100)
            subscription = await hub.open("alice", "twin", start=start)
            task = asyncio.create_task(subscription.run(transport.send))
            try:
                return await transport.take(count)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                subscription.close()

        assert [e.id for e in await events(ids[25], 4)] == ids[26:]
        await client.xtrim(key, maxlen=10, approximate=False)
        got = await events(ids[3], 11)
        assert got[0] == Event(GAP, data=orjson.dumps({"after": ids[3], "first": ids[20]}))
        assert [(e.kind, e.id) for e in got[1:]] == [(RECORD, i) for i in ids[20:]]
        assert [e.kind for e in await events("0", 10)] == [RECORD] * 10  # "0": what is kept, no gap
        assert [e.id for e in await events(ids[20], 9)] == ids[21:]  # at the first kept: nothing lost
        await client.xdel(key, ids[22])  # a deleted entry after the position is a gap too
        got = await events(ids[21], 8)
        assert got[0].kind == GAP and [e.id for e in got[1:]] == ids[23:]
        await client.aclose()

    asyncio.run(run())


def test_a_subscriber_that_falls_behind_the_trim_while_paused_gets_a_gap(redis_url):
    async def run():
        client = redis.Redis.from_url(redis_url)
        key = stream_key("alice", "twin")
        await _fill(client, key, 1)
        hub = Subscriptions(Reader(client), buffer_events=5, send_timeout_s=0.1, block_ms=50)
        transport = Transport(2)
        subscription = await hub.open("alice", "twin", policy="pause")
        task = asyncio.create_task(subscription.run(transport.send))
        await asyncio.sleep(0.2)
        ids = await _fill(client, key, 20)  # read 5 at once: 2 fit, the third send waits
        await asyncio.sleep(0.3)
        assert not task.done()  # paused, not dropped
        await client.xtrim(key, maxlen=5, approximate=False)  # meanwhile the stream moved on
        got = await transport.take_until(ids[-1])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        subscription.close()
        at = [e.kind for e in got].index(GAP)  # after what was read before the trim (3 at least)
        assert at >= 3 and [e.id for e in got[:at]] == ids[:at]
        assert orjson.loads(got[at].data) == {"after": ids[at - 1], "first": ids[15]}
        assert [e.id for e in got[at + 1 :]] == ids[15:]
        await client.aclose()

    asyncio.run(run())


def test_drop_ends_a_subscriber_that_stops_reading_and_pause_waits_for_it(redis_url):
    async def run():
        client = redis.Redis.from_url(redis_url)
        key = stream_key("alice", "twin")
        await _fill(client, key, 1)
        hub = Subscriptions(Reader(client), buffer_events=10, send_timeout_s=0.2, block_ms=50)
        dropped = metrics.STREAM_SUBSCRIBERS_DROPPED.labels("slow")._value.get()
        stuck = Transport(3)
        subscription = await hub.open("alice", "twin", policy="drop")
        ending = asyncio.create_task(subscription.run(stuck.send))
        await asyncio.sleep(0.1)
        ids = await _fill(client, key, 50)
        assert await asyncio.wait_for(ending, 5) == DROPPED_ENDING
        subscription.close()
        assert metrics.STREAM_SUBSCRIBERS_DROPPED.labels("slow")._value.get() - dropped == 1
        assert [e.id for e in await stuck.take(3)] == ids[:3]  # the drop notice found no room

        pauses = metrics.STREAM_SUBSCRIBER_PAUSES._value.get()
        slow = Transport(3)
        subscription = await hub.open("alice", "twin", start=ids[0], policy="pause")
        task = asyncio.create_task(subscription.run(slow.send))
        await asyncio.sleep(0.6)  # three times the send timeout without reading
        assert not task.done()
        got = await slow.take(49)  # reading again: where it stopped, nothing lost, nothing twice
        assert [e.id for e in got] == ids[1:] and DROPPED not in {e.kind for e in got}
        assert metrics.STREAM_SUBSCRIBER_PAUSES._value.get() - pauses == 1  # counted as it resumed
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        subscription.close()
        assert hub.active == 0
        await client.aclose()

    asyncio.run(run())


def test_a_group_member_acknowledges_what_it_sent_and_a_late_group_gets_its_gap(redis_url):
    async def run():
        client = redis.Redis.from_url(redis_url)
        key = stream_key("alice", "twin")
        ids = await _fill(client, key, 20)
        hub = Subscriptions(Reader(client), buffer_events=8, block_ms=50)
        transport = Transport(100)
        subscription = await hub.open("alice", "twin", group="g", consumer="m1", start="0")
        task = asyncio.create_task(subscription.run(transport.send))
        got = await transport.take(20)
        await asyncio.sleep(0.1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        subscription.close()
        assert [e.id for e in got] == ids and (await client.xpending(key, "g"))["pending"] == 0
        await client.xtrim(key, maxlen=5, approximate=False)
        late = await hub.open("alice", "twin", group="late", start=ids[2])
        task = asyncio.create_task(late.run(transport.send))
        got = await transport.take(6)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        late.close()
        assert got[0].kind == GAP and orjson.loads(got[0].data) == {"after": ids[2], "first": ids[15]}
        assert [e.id for e in got[1:]] == ids[15:]
        await client.aclose()

    asyncio.run(run())


def test_stream_policies_in_the_tenants_file_are_validated_and_looked_up_per_stream():
    from aiworks.gateway.tenancy import parse_tenants

    config = parse_tenants({"tenants": [{"id": "plant", "stream_policies": {"twin": "pause", "*": "drop"}},
                                        {"id": "lab", "stream_policies": {"*": "pause"}}, {"id": "shop"}]}, "t.yaml")  # fmt: skip
    plant, lab, shop = (config.tenants[t] for t in ("plant", "lab", "shop"))
    assert (plant.stream_policy("twin"), plant.stream_policy("alerts")) == ("pause", "drop")
    assert (lab.stream_policy("twin"), shop.stream_policy("twin")) == ("pause", "drop")
    for policies, named in (({"twin": "wait"}, "stream_policies"), ({"no good": "pause"}, "'no good', not a stream")):
        with pytest.raises(InvalidArgument, match=named) as caught:
            parse_tenants({"tenants": [{"id": "plant", "stream_policies": policies}]}, "t.yaml")
        assert "plant" in caught.value.message and "t.yaml" in caught.value.message


def test_a_quiet_stream_sends_heartbeats_and_then_what_comes(redis_url):
    async def run():
        client = redis.Redis.from_url(redis_url)
        key = stream_key("alice", "twin")
        await _fill(client, key, 1)
        hub = Subscriptions(Reader(client), heartbeat_s=0.1, block_ms=50)
        transport = Transport(100)
        subscription = await hub.open("alice", "twin")
        task = asyncio.create_task(subscription.run(transport.send))
        assert [e.kind for e in await transport.take(2)] == [HEARTBEAT, HEARTBEAT]
        new = await _fill(client, key, 1)
        got = await transport.take_until(new[0])
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        subscription.close()
        assert {e.kind for e in got[:-1]} <= {HEARTBEAT} and got[-1].kind == RECORD
        await client.aclose()

    asyncio.run(run())
