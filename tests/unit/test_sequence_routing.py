"""Stateful models through the gateway's routing: each sequence pinned to one replica, the same from every gateway."""

from __future__ import annotations

import asyncio

import pytest
from routing_support import FakeReplica, make, request, spec

from aiworks.core.errors import AIWorksError, Status, StreamLost, Unavailable
from aiworks.core.options import RequestOptions, SequenceRef
from aiworks.scheduler.dispatch import Dispatcher
from aiworks.scheduler.mirror import RoutingMirror
from aiworks.scheduler.sequence_routing import PROBES, rendezvous_order


def options(sid, start=False, end=False) -> RequestOptions:
    return RequestOptions(sequence=SequenceRef(sid, start, end))


def second_gateway(suite, replicas) -> Dispatcher:
    """Another gateway's routing over the same replicas and the same table (no memory shared with the first)."""
    mirror = RoutingMirror(lambda address: replicas[address])
    dispatcher = Dispatcher(mirror)
    table = suite.scheduler.routing_table()
    mirror.apply(table)
    dispatcher.apply(table)
    return dispatcher


async def send(dispatcher, sid, start=False, end=False):
    return await dispatcher.infer(request(), options(sid, start, end))


def holder(replicas, sid) -> str:
    [name] = [name for name, r in replicas.items() if sid in r.sequences]
    return name


def test_every_gateway_sends_a_sequence_to_the_same_replica():
    async def main():
        replicas = {n: FakeReplica(n) for n in "abc"}
        suite = make(replicas, [spec(sequence=True)])
        other = second_gateway(suite, replicas)
        ids = list(range(1, 41)) + [f"twin-{i}" for i in range(20)]
        for sid in ids:
            await send(suite.dispatcher, sid, start=True)  # started through the first gateway
            await send(other, sid)  # continued through the second, which never saw it
            await send(suite.dispatcher, sid)
        spread = {name: len(r.sequences) for name, r in replicas.items()}
        assert sum(spread.values()) == len(ids) and min(spread.values()) > 5  # spread, each on exactly one
        for sid in ids[:10]:
            expected = rendezvous_order(list(suite.mirror.replicas.values()), sid)[0].replica_id
            assert holder(replicas, sid) == expected

    asyncio.run(main())


def test_a_replica_joining_does_not_lose_running_sequences():
    async def main():
        replicas = {n: FakeReplica(n) for n in "ab"}
        suite = make(replicas, [spec(sequence=True)])
        ids = list(range(1, 31))
        for sid in ids:
            await send(suite.dispatcher, sid, start=True)
        replicas["c"] = FakeReplica("c")
        suite.registry.register("c", "c", "cpu", {}, [spec(sequence=True)])
        suite.sync()
        other = second_gateway(suite, replicas)  # knows no sequence: finds each by probing the order
        for sid in ids:
            await send(suite.dispatcher, sid)
            await send(other, sid, end=True)
        assert not any(r.sequences for r in replicas.values())
        assert replicas["c"].batches == 0  # c owns none of them; new sequences may land there
        await send(other, 999, start=True)

    asyncio.run(main())


def test_a_sequence_whose_replica_left_is_lost_and_can_start_again():
    async def main():
        replicas = {n: FakeReplica(n) for n in "ab"}
        suite = make(replicas, [spec(sequence=True)])
        await send(suite.dispatcher, 7, start=True)
        gone = holder(replicas, 7)
        del suite.registry.replicas[gone]
        replicas[gone].sequences.clear()  # it died with its sequences
        suite.sync()
        other = second_gateway(suite, replicas)  # a gateway started after the replica left: it never saw it
        with pytest.raises(AIWorksError) as lost:
            await send(suite.dispatcher, 7)
        assert lost.value.status is Status.FAILED_PRECONDITION
        assert f"held it ({gone}) left the routing table" in lost.value.message and "start the sequence again" in (
            lost.value.message
        )
        with pytest.raises(AIWorksError) as unknown:  # a gateway that never saw the replica: Triton's 400
            await send(other, 7)
        assert unknown.value.status is Status.INVALID_ARGUMENT and "START flag" in unknown.value.message
        await send(suite.dispatcher, 7, start=True)
        assert holder(replicas, 7) != gone

    asyncio.run(main())


def test_a_gateway_without_memory_of_the_sequence_still_reports_it_lost():
    async def main():
        replicas = {n: FakeReplica(n) for n in "ab"}
        suite = make(replicas, [spec(sequence=True)])
        other = second_gateway(suite, replicas)
        await send(other, 8, start=True)
        gone = holder(replicas, 8)
        del suite.registry.replicas[gone]
        replicas[gone].sequences.clear()
        suite.sync()  # the first gateway saw it leave, and never routed sequence 8
        with pytest.raises(AIWorksError) as lost:
            await send(suite.dispatcher, 8)
        assert lost.value.status is Status.FAILED_PRECONDITION and gone in lost.value.message

    asyncio.run(main())


def test_a_stopping_replica_keeps_its_sequences_until_they_end_and_takes_nothing_new():
    """Its heartbeat says stopping: the table keeps it, marked, so both gateways (the one that started the
    sequence and one that never saw it) still reach its sequences there; starts and stateless requests go
    to the live replicas only; once it leaves the table its sequences are lost, as with any departure."""

    async def main():
        replicas = {n: FakeReplica(n) for n in "ab"}
        suite = make(replicas, [spec(sequence=True)])
        other = second_gateway(suite, replicas)
        ids = list(range(1, 21))
        for sid in ids:
            await send(suite.dispatcher, sid, start=True)
        stopping = holder(replicas, ids[0])
        held = [sid for sid in ids if holder(replicas, sid) == stopping]
        assert suite.registry.heartbeat(stopping, [spec(sequence=True)], stopping=True)
        table = suite.scheduler.routing_table()
        assert [(r.replica_id, r.stopping) for r in table.replicas if r.replica_id == stopping] == [(stopping, True)]
        suite.sync()
        other.mirror.apply(table)
        other.apply(table)
        assert stopping not in suite.mirror.replicas and stopping in suite.mirror.stopping
        before = replicas[stopping].batches
        *ending, kept = held
        for sid in ending:  # its sequences go on there, from either gateway, and end there
            await send(suite.dispatcher, sid)
            await send(other, sid, end=True)
        await send(other, kept)
        assert replicas[stopping].batches == before + 2 * len(ending) + 1 and replicas[stopping].sequences == {kept}
        for sid in range(100, 120):  # nothing new starts there
            await send(suite.dispatcher, sid, start=True)
            await send(other, sid + 100, start=True)
        assert replicas[stopping].batches == before + 2 * len(ending) + 1
        # It leaves the table (its heartbeats ended): the sequence it still held is lost, and says where.
        del suite.registry.replicas[stopping]
        suite.sync()
        assert stopping not in suite.mirror.stopping and stopping not in suite.mirror.replicas
        with pytest.raises(AIWorksError) as lost:
            await send(suite.dispatcher, kept)
        assert lost.value.status is Status.FAILED_PRECONDITION and f"({stopping}) left the routing table" in (
            lost.value.message
        )

    asyncio.run(main())


def test_a_stopping_replica_whose_drain_ended_loses_its_sequences_with_a_412():
    async def main():
        replicas = {n: FakeReplica(n) for n in "ab"}
        suite = make(replicas, [spec(sequence=True)])
        await send(suite.dispatcher, 3, start=True)
        name = holder(replicas, 3)
        suite.registry.heartbeat(name, [spec(sequence=True)], stopping=True)
        suite.sync()
        replicas[name].fail_next = 1
        replicas[name].fail_with = Unavailable(f"replica {name} is stopping")  # its drain ended
        with pytest.raises(AIWorksError) as lost:
            await send(suite.dispatcher, 3)
        assert lost.value.status is Status.FAILED_PRECONDITION
        assert f"({name}) could not be reached (replica {name} is stopping)" in lost.value.message

    asyncio.run(main())


def test_a_broken_stream_mid_sequence_is_not_retried_elsewhere():
    async def main():
        replicas = {n: FakeReplica(n) for n in "ab"}
        suite = make(replicas, [spec(sequence=True)])
        await send(suite.dispatcher, 9, start=True)
        name = holder(replicas, 9)
        other = next(n for n in replicas if n != name)
        replicas[name].fail_next = 1
        replicas[name].fail_with = StreamLost(f"stream to {name} failed")
        with pytest.raises(AIWorksError) as lost:
            await send(suite.dispatcher, 9)
        assert lost.value.status is Status.FAILED_PRECONDITION and "could not be reached" in lost.value.message
        assert replicas[other].batches == 0 and suite.dispatcher.retries == {}

    asyncio.run(main())


def test_a_start_skips_an_unreachable_replica():
    async def main():
        replicas = {n: FakeReplica(n) for n in "ab"}
        suite = make(replicas, [spec(sequence=True)])
        first = rendezvous_order(list(suite.mirror.replicas.values()), 5)[0].replica_id
        replicas[first].fail_next = 1
        await send(suite.dispatcher, 5, start=True)
        assert holder(replicas, 5) != first
        await send(suite.dispatcher, 5)  # remembered: straight to where it started

    asyncio.run(main())


def test_requests_outside_any_sequence_are_400():
    async def main():
        replicas = {n: FakeReplica(n) for n in "ab"}
        suite = make(replicas, [spec(sequence=True)])
        with pytest.raises(AIWorksError) as never:
            await send(suite.dispatcher, 123)
        assert never.value.status is Status.INVALID_ARGUMENT
        assert "inference request for sequence 123 to model 'm' must specify the START flag" in never.value.message
        assert sum(len(r.seen_timeouts) for r in replicas.values()) <= PROBES  # bounded probing
        with pytest.raises(AIWorksError) as no_id:
            await suite.dispatcher.infer(request(), RequestOptions())
        assert "must specify a non-zero or non-empty correlation ID" in no_id.value.message

    asyncio.run(main())


def test_the_only_replica_stopping_keeps_its_sequences_and_refuses_starts():
    """A pool of one replica in a rolling update: with no live replica for the version, the sequences the stopping
    one holds still reach it until they end; a new sequence gets a 503 (nothing live to start it on)."""

    async def main():
        replicas = {"a": FakeReplica("a")}
        suite = make(replicas, [spec(sequence=True)])
        for sid in (1, 2):
            await send(suite.dispatcher, sid, start=True)
        suite.registry.heartbeat("a", [spec(sequence=True)], stopping=True)
        suite.sync()
        assert not suite.mirror.replicas and "a" in suite.mirror.stopping
        before = replicas["a"].batches
        await send(suite.dispatcher, 1)
        await send(suite.dispatcher, 1, end=True)
        await send(second_gateway(suite, replicas), 2)  # a gateway that never saw it finds it there too
        assert replicas["a"].batches == before + 3 and replicas["a"].sequences == {2}
        with pytest.raises(Unavailable, match="no live replica"):
            await send(suite.dispatcher, 3, start=True)
        assert replicas["a"].batches == before + 3

    asyncio.run(main())
