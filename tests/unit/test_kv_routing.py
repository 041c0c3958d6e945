"""KV-aware routing of generations: the gateway's choice on fake routing tables and a fake clock (pure logic).

Replicas of a generative version report their free KV tokens and waiting
sequences in heartbeats; the scheduler puts them in the routing table; the
gateway's router sends a new generation to the replica with the most room
(docs/generation.md, "Routing by KV room").
"""

import random

from routing_support import FakeClock, spec

from aiworks.core.datatypes import Tensor
from aiworks.core.inference import InferRequest
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
from aiworks.scheduler.catalog import Catalog, Replica
from aiworks.scheduler.converters import kv_from_pb, kv_to_pb, table_from_pb, table_to_pb
from aiworks.scheduler.mirror import RoutingMirror
from aiworks.scheduler.policy import RoutingPolicy
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.replica_state import OutlierDetector, OutlierPolicy
from aiworks.scheduler.router import AFFINITY_S, KV_STALE_S, PROMPT_HEAD_BYTES, Router, kv_reserve, prompt_head
from aiworks.scheduler.views import KvRoom, RouteReplica, RoutingTable

KEY = ("m", "1")


def catalog(clock, rooms: dict[str, tuple[int, int] | None], *, budget=1000, age_s=0.0) -> Catalog:
    """Replicas serving m/1; ``rooms``: replica -> (free tokens, waiting sequences), None for no figures."""
    cat = Catalog()
    for rid, room in rooms.items():
        r = Replica(rid, f"{rid}:1", models={KEY: spec()})
        if room is not None:
            r.kv = {KEY: KvRoom("m", "1", room[0], budget, room[1])}
            r.kv_at_s = clock() - age_s
            cat.kv_keys.add(KEY)
        cat.replicas[rid] = r
    return cat


def router(cat: Catalog, clock, seed=1) -> Router:
    return Router(cat, outliers=OutlierDetector(OutlierPolicy(), clock), rng=random.Random(seed), clock=clock)


def picks(r: Router, n: int) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _ in range(n):
        chosen = r.pick(KEY)
        counts[chosen.replica_id] = counts.get(chosen.replica_id, 0) + 1
    return counts


def test_the_replica_with_the_most_free_kv_gets_the_generation():
    clock = FakeClock()
    cat = catalog(clock, {"a": (100, 0), "b": (900, 0), "c": (400, 0)})
    r = router(cat, clock)
    # b is slower (the latency rule alone would avoid it), but it has the room.
    cat.replicas["b"].health.latency_s[KEY] = 5.0
    cat.replicas["b"].health.latency_at_s[KEY] = clock()
    assert picks(r, 20) == {"b": 20}


def test_a_waiting_sequence_outweighs_any_room():
    clock = FakeClock()
    cat = catalog(clock, {"a": (900, 1), "b": (10, 0)})
    assert picks(router(cat, clock), 10) == {"b": 10}


def test_a_realtime_generation_does_not_count_batch_sequences_waiting_ahead_of_it():
    """The engines admit the most urgent class first: a realtime generation waits behind waiting realtime ones
    only, so room held back for waiting batch generations is its room; a standard or batch one counts every
    waiting sequence of its class and the more urgent ones, as before."""
    from aiworks.core.options import Priority

    clock = FakeClock()
    cat = catalog(clock, {"a": (900, 2), "b": (100, 0)})
    cat.replicas["a"].kv = {KEY: KvRoom("m", "1", 900, 1000, 2, (0, 0, 2))}  # two batch generations wait on a
    r = router(cat, clock)
    assert {r.pick(KEY, Priority.REALTIME).replica_id for _ in range(10)} == {"a"}
    assert {r.pick(KEY, Priority.STANDARD).replica_id for _ in range(10)} == {"a"}  # standard goes ahead too
    assert {r.pick(KEY, Priority.BATCH).replica_id for _ in range(10)} == {"b"}
    cat.replicas["a"].kv = {KEY: KvRoom("m", "1", 900, 1000, 2, (1, 0, 1))}  # a realtime one waits there
    assert {r.pick(KEY, Priority.REALTIME).replica_id for _ in range(10)} == {"b"}
    cat.replicas["a"].kv = {KEY: KvRoom("m", "1", 900, 1000, 2)}  # a runtime that does not say by class: all count
    assert {r.pick(KEY, Priority.REALTIME).replica_id for _ in range(10)} == {"b"}


def test_generations_sent_since_the_figures_count_so_a_burst_spreads():
    clock = FakeClock()
    cat = catalog(clock, {"a": (1000, 0), "b": (700, 0)})
    for replica in cat.replicas.values():  # measured: no probation (one request at a time) in the way
        replica.health.latency_s[KEY], replica.health.latency_at_s[KEY] = 0.01, clock()
    r = router(cat, clock)
    sent = {"a": 0, "b": 0}
    for _ in range(8):  # each reserves 100 tokens: a until it has less room left than b, then in turns
        replica = r.pick(KEY)
        r.sent(replica, KEY, 100)
        sent[replica.replica_id] += 1
    assert sent == {"a": 5, "b": 3} or sent == {"a": 6, "b": 2}, sent
    assert abs((1000 - 100 * sent["a"]) - (700 - 100 * sent["b"])) <= 100


def test_stale_or_missing_figures_fall_back_to_the_latency_rule():
    clock = FakeClock()
    for rooms, age_s in (({"a": (1000, 0), "b": (0, 3)}, KV_STALE_S + 0.5), ({"a": (1000, 0), "b": None}, 0.0)):
        cat = catalog(clock, rooms, age_s=age_s)
        for rid, latency_s in (("a", 1.0), ("b", 0.01)):  # a is 100x slower: the latency rule picks b
            cat.replicas[rid].health.latency_s[KEY] = latency_s
            cat.replicas[rid].health.latency_at_s[KEY] = clock()
        assert picks(router(cat, clock), 20) == {"b": 20}, rooms


def test_models_without_figures_route_as_before():
    clock = FakeClock()
    cat = catalog(clock, {"a": None, "b": None})
    assert not cat.kv_keys
    counts = picks(router(cat, clock), 200)
    assert set(counts) == {"a", "b"} and min(counts.values()) > 50  # two unmeasured replicas: either


def test_many_replicas_use_two_random_choices():
    clock = FakeClock()
    cat = catalog(clock, {f"r{i}": (100 * i, 0) for i in range(10)})
    counts = picks(router(cat, clock), 400)
    assert "r0" not in counts  # never the better of two
    assert len(counts) >= 5  # not always the single best one
    top, bottom = (sum(counts.get(f"r{i}", 0) for i in ids) for ids in ((7, 8, 9), (1, 2, 3)))
    assert top > 3 * bottom, counts  # expected shares: 24/45 against 6/45


def test_the_reserve_estimate_is_prompt_plus_max_tokens():
    prompt = Tensor("text_input", "BYTES", (1,), b"\x0c\x00\x00\x00def fib(n):\n")
    assert kv_reserve(InferRequest("m", inputs=[prompt], parameters={"max_tokens": 50})) == 16 // 3 + 1 + 50
    assert kv_reserve(InferRequest("m", inputs=[prompt], parameters={"max_tokens": "x"})) == 16 // 3 + 1 + 16


def generation(text: str, max_tokens: int = 50) -> InferRequest:
    raw = len(text.encode()).to_bytes(4, "little") + text.encode()
    return InferRequest("m", inputs=[Tensor("text_input", "BYTES", (1,), raw)], parameters={"max_tokens": max_tokens})


SYSTEM = "You are a careful assistant. Answer in one short paragraph, in plain words. " * 2


def send(r: Router, request: InferRequest, tenant: str = "acme") -> str:
    head, reserve = prompt_head(request, tenant), kv_reserve(request)
    replica = r.pick(KEY, head=head, reserve=reserve)
    r.sent(replica, KEY, reserve, head)
    return replica.replica_id


def measured(cat: Catalog, clock) -> None:
    for replica in cat.replicas.values():  # no probation (one request at a time) in the way
        replica.health.latency_s[KEY], replica.health.latency_at_s[KEY] = 0.01, clock()


def test_the_choices_of_one_prompt_go_where_the_first_went():
    clock = FakeClock()
    cat = catalog(clock, {"a": (1000, 0), "b": (1000, 0), "c": (1000, 0)})
    measured(cat, clock)
    r = router(cat, clock)
    prompt = generation(SYSTEM + "Question one?")
    first = send(r, prompt)
    # Without affinity the next three would spread by room (each a reserve of ~100 tokens less where it went).
    assert [send(r, prompt) for _ in range(3)] == [first] * 3
    other = send(r, generation("x" * 80 + "a prompt of its own"))
    assert other != first  # a prompt of another beginning goes by room
    # Another tenant's same prompt does not follow it: affinity is per tenant, as the engines' sharing is.
    assert prompt_head(prompt, "acme") != prompt_head(prompt, "globex")
    assert send(r, prompt, "globex") != first
    # A beginning remembers its replica for AFFINITY_S; after that, room decides again.
    clock.now += AFFINITY_S + 1
    for replica in cat.replicas.values():
        replica.kv_at_s = clock()  # fresh figures: a is fullest of what this gateway sent
    assert send(r, prompt) != first


def test_a_beginning_every_request_shares_still_spreads_over_the_replicas():
    clock = FakeClock()
    cat = catalog(clock, {"a": (2000, 0), "b": (2000, 0)})
    measured(cat, clock)
    r = router(cat, clock)
    went = [send(r, generation(SYSTEM + f"Question {i}?")) for i in range(20)]
    counts = {rid: went.count(rid) for rid in "ab"}
    # Each replica takes them while its room is within AFFINITY_SLACK (3) reserves of the other's.
    assert abs(counts["a"] - counts["b"]) <= 4, went
    assert went[:4] == [went[0]] * 4  # the first few stay together: their engines copy the beginning


def test_before_any_figures_affinity_is_bounded_by_requests_in_flight():
    clock = FakeClock()
    cat = catalog(clock, {"a": None, "b": None})  # no KV figures yet: the latency rule, and affinity before it
    measured(cat, clock)
    r = router(cat, clock)
    prompt = generation(SYSTEM + "Question one?")
    went = [send(r, prompt) for _ in range(6)]  # none answered yet: each stays in flight
    # The first four together (at most AFFINITY_SLACK more in flight than the other), then the other takes one.
    assert went[:4] == [went[0]] * 4 and went[4] != went[0], went


def test_a_replica_on_probation_takes_no_burst_for_affinity():
    clock = FakeClock()
    prompt = generation(SYSTEM + "Question one?")
    for rooms in ({"a": (1000, 0), "b": (1000, 0)}, {"a": None, "b": None}):  # with KV figures and without
        cat = catalog(clock, rooms)  # never measured: probation, one request at a time
        r = router(cat, clock)
        first = send(r, prompt)
        assert send(r, prompt) != first  # its first one has not answered: the next goes elsewhere


def test_a_prompt_head_is_its_tenant_and_first_bytes():
    long = generation("p" * (PROMPT_HEAD_BYTES + 1))
    assert prompt_head(long, "t") == b"t\0" + b"p" * PROMPT_HEAD_BYTES
    assert prompt_head(generation("p" * PROMPT_HEAD_BYTES), "t") == b""  # too short to share
    assert prompt_head(InferRequest("m", inputs=[Tensor("x", "FP32", (1,), b"\0" * 4)]), "t") == b""


def test_the_table_carries_kv_figures_and_the_mirror_dates_them():
    room = KvRoom("m", "1", 300, 1000, 2, (0, 1, 1))
    assert kv_from_pb(kv_to_pb(room)) == room
    table = RoutingTable(
        generation=3,
        replicas=[
            RouteReplica("a", "a:1", "cpu", {}, (spec(),), (room,), 1.5),
            RouteReplica("b", "b:1", "cpu", {}, (spec(),)),
        ],  # fmt: skip
        traffic=[],
        draining=[],
        ejections=[],
        known=[KEY],
        policy=RoutingPolicy(),
    )
    back = table_from_pb(table_to_pb(table))
    assert back.replicas[0].kv == (room,) and back.replicas[0].kv_age_s == 1.5
    assert back.replicas[1].kv == () and not pb.RouteReplica().kv

    mirror = RoutingMirror(lambda address: None)
    mirror.apply(back)
    a, b = mirror.replicas["a"], mirror.replicas["b"]
    assert mirror.kv_keys == {KEY} and a.kv == {KEY: room} and b.kv is None
    import time

    now = time.monotonic()
    assert now - 2.0 < a.kv_at_s < now - 1.4
    a.kv_sent = [(a.kv_at_s - 1.0, KEY, 10), (a.kv_at_s + 0.5, KEY, 20)]  # before the figures: counted in them
    mirror.apply(back)
    assert [t for _, _, t in a.kv_sent] == [20]
    back.replicas[0] = RouteReplica("a", "a:1", "cpu", {}, (spec(),))
    mirror.apply(back)
    assert a.kv is None and a.kv_sent == [] and not mirror.kv_keys


def test_the_registry_publishes_changed_figures_and_refreshes_unchanged_ones():
    clock = FakeClock()
    reg = ReplicaRegistry(lambda address: None, clock=clock)
    reg.register("a", "a:1", "cpu", {}, [spec()])
    room = KvRoom("m", "1", 300, 1000, 0)
    g = reg.generation
    assert reg.heartbeat("a", [spec()], kv=[room], kv_refresh_s=2.0) and reg.generation > g
    g = reg.generation
    clock.now += 1.0
    reg.heartbeat("a", [spec()], kv=[room], kv_refresh_s=2.0)
    assert reg.generation == g  # the same figures, published a second ago: no new table
    clock.now += 1.0
    reg.heartbeat("a", [spec()], kv=[room], kv_refresh_s=2.0)
    assert reg.generation > g and reg.replicas["a"].kv_at_s == clock.now  # refreshed, so gateways keep them
    g = reg.generation
    reg.heartbeat("a", [spec()], kv=[KvRoom("m", "1", 200, 1000, 0)], kv_refresh_s=2.0)
    assert reg.generation > g
    g = reg.generation
    reg.heartbeat("a", [spec()])  # it reports none any more (the version was unloaded)
    assert reg.generation > g and reg.replicas["a"].kv is None
    g = reg.generation
    reg.heartbeat("a", [spec()])
    assert reg.generation == g  # a replica without figures changes nothing


def test_a_faded_average_does_not_hold_back_a_replica_with_room_but_a_never_measured_one_waits():
    clock = FakeClock()
    cat = catalog(clock, {"full": (0, 5), "roomy": (1000, 0)})
    for replica in cat.replicas.values():
        replica.health.latency_s[KEY], replica.health.latency_at_s[KEY] = 0.01, clock() - 60  # long faded
    r = router(cat, clock)
    for _ in range(5):  # a burst after a quiet minute: all to the replica with room, not one at a time
        chosen = r.pick(KEY)
        r.sent(chosen, KEY, 10)
        assert chosen.replica_id == "roomy"
    fresh = catalog(clock, {"full": (0, 5), "new": (1000, 0)})
    fresh.replicas["full"].health.latency_s[KEY] = 0.01
    fresh.replicas["full"].health.latency_at_s[KEY] = clock()
    r = router(fresh, clock)
    first = r.pick(KEY)
    r.sent(first, KEY, 10)
    assert first.replica_id == "new" and r.pick(KEY).replica_id == "full"  # "new" holds one until it answers


def test_status_shows_each_replicas_kv_room_and_the_cli_prints_it():
    from routing_support import FakeReplica, make

    from aiworks.scheduler.converters import status_from_pb, status_to_pb
    from aiworks.status import format_status

    clock = FakeClock()
    suite = make({"kv-a": FakeReplica("kv-a"), "kv-b": FakeReplica("kv-b")}, clock=clock)
    suite.registry.heartbeat("kv-a", [spec()], kv=[KvRoom("m", "1", 250, 1000, 3)])
    clock.now += 0.5
    view = {r.replica_id: r for r in suite.status().replicas}
    assert view["kv-a"].kv == [KvRoom("m", "1", 250, 1000, 3)] and view["kv-a"].kv_age_s == 0.5
    assert view["kv-b"].kv == [] and view["kv-b"].kv_age_s == 0.0  # no generative version
    message = status_to_pb(suite.status())
    assert status_from_pb(message).replicas == suite.status().replicas  # the proto round trip keeps them
    text = format_status(message)
    assert "generation KV cache (1):" in text
    (row,) = [line for line in text.splitlines() if line.strip().startswith("kv-a ") and " m " in line]
    assert row.split()[:8] == ["kv-a", "m", "1", "750", "250", "1000", "75%", "3"]
    bare = make({"plain": FakeReplica("plain")})
    assert "generation KV cache" not in format_status(status_to_pb(bare.status()))
