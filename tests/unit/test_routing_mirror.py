"""A gateway's mirror of the routing table: specs come from the scheduler's pushes, and outlive the scheduler."""

from __future__ import annotations

import pytest
from routing_support import FakeReplica, make, spec

from aiworks.core.errors import InvalidArgument, NotFound, Unavailable
from aiworks.core.model_config import ModelState
from aiworks.scheduler.mirror import RoutingMirror


def test_specs_are_answered_from_the_table_without_asking_the_scheduler():
    suite = make({"r0": FakeReplica("r0")}, [spec("1"), spec("2")])
    first = suite.mirror.resolve("m", "")
    assert first.version == "2" and suite.mirror.versions("m") == ["1", "2"]
    assert suite.mirror.resolve("m", "1").version == "1"
    assert suite.mirror.resolve("m", "") is first  # the same object until the table changes: nothing refetched


def test_unknown_known_and_unloading_models_answer_400_404_or_503():
    suite = make({"r0": FakeReplica("r0")})
    with pytest.raises(InvalidArgument, match="^Request for unknown model: 'nope' is not found$"):
        suite.mirror.resolve("nope", "")
    with pytest.raises(NotFound, match="^Request for unknown model: 'm' version 7 is not found$"):
        suite.mirror.resolve("m", "7")
    suite.registry.close({("m", "1")})
    suite.sync()
    with pytest.raises(Unavailable, match="being unloaded"):
        suite.mirror.resolve("m", "")
    suite.registry.release({("m", "1")})
    suite.registry.mark_down(suite.registry.replicas["r0"], "test")
    suite.sync()
    with pytest.raises(Unavailable, match="no live replica"):
        suite.mirror.resolve("m", "")


def test_the_last_table_keeps_serving_while_the_scheduler_is_away():
    suite = make({"r0": FakeReplica("r0")})
    table = suite.scheduler.routing_table()
    fresh = RoutingMirror(lambda address: FakeReplica(address))
    assert not fresh.ready
    fresh.apply(table)
    assert fresh.ready and fresh.resolve("m", "").version == "1"
    # No further table arrives (the scheduler died): routing goes on with what it has.
    assert fresh.holders(("m", "1"))[0].replica_id == "r0"


def test_a_replica_that_stays_keeps_its_connection_and_health():
    suite = make({"r0": FakeReplica("r0"), "r1": FakeReplica("r1")})
    replica = suite.mirror.replicas["r0"]
    replica.health.latency_s[("m", "1")] = 0.5
    suite.registry.set_models(suite.registry.replicas["r0"], [spec("1"), spec("2")])
    suite.sync()
    assert suite.mirror.replicas["r0"] is replica and replica.health.latency_s[("m", "1")] == 0.5
    assert ("m", "2") in replica.models


def test_versions_not_ready_are_not_routed():
    not_ready = spec("3").with_state(ModelState.UNAVAILABLE, "warming up")
    suite = make({"r0": FakeReplica("r0")}, [spec("1"), not_ready])
    assert suite.mirror.resolve("m", "").version == "1"
