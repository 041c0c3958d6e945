"""The gateway's cache client against a real in-process cache server: lookups, stores, breaker, invalidation."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from aiworks.cache.client import CacheClient
from aiworks.cache.dataplane import CacheDataPlane
from aiworks.cache.servicer import CacheServicer
from aiworks.cache.store import MemoryStore
from aiworks.core.breaker import CircuitBreaker
from aiworks.core.datatypes import Tensor
from aiworks.core.inference import InferRequest, InferResponse
from aiworks.core.model_config import ModelSpec
from aiworks.core.rpc import create_server, set_serving
from aiworks.pb.cache.v1 import cache_pb2_grpc
from aiworks.supervisor.supervisor import free_port

CACHED = {"response_cache": "true"}


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_breaker_opens_after_the_threshold_probes_once_and_closes_on_success():
    clock = FakeClock()
    breaker = CircuitBreaker(failure_threshold=2, retry_after_s=1.0, clock=clock)
    breaker.failure()
    assert breaker.allow()  # one failure is not enough
    breaker.failure()
    assert not breaker.allow()
    clock.now += 1.0
    assert breaker.allow() and not breaker.allow()  # one probe at a time
    breaker.failure()  # the probe failed: open again
    assert not breaker.allow()
    clock.now += 1.0
    assert breaker.allow()
    breaker.success()
    assert breaker.allow() and breaker.allow() and not breaker.is_open


class CacheServer:
    """The real CacheService on a port of its own, in this event loop."""

    def __init__(self, port: int):
        self.port = port
        self.server = None
        self.dataplane = None

    async def start(self):
        self.dataplane = CacheDataPlane(MemoryStore(1 << 20))
        self.server, health = create_server(1 << 20)
        cache_pb2_grpc.add_CacheServiceServicer_to_server(CacheServicer(self.dataplane), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        await self.server.start()
        await set_serving(health, True)

    async def stop(self):
        await self.server.stop(grace=0)


class Backend:
    """Stands in for the routing table (the spec) and a runtime replica (inference), counting calls."""

    def __init__(self, parameters=CACHED, version="3"):
        self.spec = ModelSpec(name="m", version=version, parameters=dict(parameters))
        self.version = version
        self.infer_calls = 0

    async def infer(self, request: InferRequest) -> InferResponse:
        self.infer_calls += 1
        x = request.inputs[0].to_numpy()
        return InferResponse(request.model, request.version or self.version, [Tensor.from_numpy("y", x * 2)], id=request.id)


def request(value: float = 1.0, **parameters) -> InferRequest:
    x = Tensor.from_numpy("x", np.full((1, 4), value, dtype=np.float32))
    return InferRequest("m", "", [x], id="r1", parameters=parameters)


async def until(predicate, timeout_s: float = 3.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)


@pytest.fixture
async def server():
    s = CacheServer(free_port())
    await s.start()
    yield s
    await s.stop()


async def test_miss_store_then_hit_without_the_scheduler(server):
    backend = Backend()
    client = CacheClient(f"127.0.0.1:{server.port}", max_message_bytes=1 << 20, lookup_timeout_s=0.5)
    try:
        first = await client.infer(request(), backend.spec, backend.infer)
        # The gateway learns whether it was a hit; the client is not told unless the model opts in.
        assert first.cache_hit is False and first.parameters == {} and backend.infer_calls == 1
        await until(lambda: client.counters.stores == 1)
        hit = await client.infer(request(), backend.spec, backend.infer)
        assert hit.cache_hit is True and hit.parameters == {} and backend.infer_calls == 1
        assert (hit.model, hit.version, hit.id) == ("m", "3", "r1")
        np.testing.assert_array_equal(hit.outputs[0].to_numpy(), first.outputs[0].to_numpy())
        skipped = await client.infer(request(cache_bypass=True), backend.spec, backend.infer)
        assert "cache_hit" not in skipped.parameters and backend.infer_calls == 2
        c = client.counters
        assert (c.hits, c.misses, c.skipped, c.bypassed, c.lookup_errors) == (1, 1, 1, 0, 0)
    finally:
        await client.close()


def tenant_request(tenant: str, value: float = 1.0) -> InferRequest:
    r = request(value)
    r.tenant = tenant
    return r


@pytest.mark.parametrize(
    ("parameters", "b_hits", "reported"),
    [
        ({}, False, None),  # per tenant, not reported: the default
        ({"report_cache_hit": "true"}, False, False),
        ({"cache_scope": "shared", "report_cache_hit": "true"}, True, True),
        ({"cache_scope": "shared"}, True, None),
    ],
    ids=["tenant", "tenant-reported", "shared-reported", "shared"],
)
async def test_entries_are_per_tenant_unless_the_model_shares_them(server, parameters, b_hits, reported):
    backend = Backend(parameters={**CACHED, **parameters})
    client = CacheClient(f"127.0.0.1:{server.port}", max_message_bytes=1 << 20, lookup_timeout_s=0.5)
    try:
        await client.infer(tenant_request("alice"), backend.spec, backend.infer)
        await until(lambda: client.counters.stores == 1)
        again = await client.infer(tenant_request("alice"), backend.spec, backend.infer)
        assert again.cache_hit is True and backend.infer_calls == 1
        bob = await client.infer(tenant_request("bob"), backend.spec, backend.infer)
        assert bob.cache_hit is b_hits and backend.infer_calls == (1 if b_hits else 2)
        assert bob.parameters.get("cache_hit") is reported
    finally:
        await client.close()


def test_invalid_scope_or_report_values_disable_the_cache():
    from aiworks.cache.policy import CachePolicy

    assert CachePolicy.from_parameters({**CACHED, "cache_scope": "Shared "}).shared
    assert not CachePolicy.from_parameters({**CACHED, "cache_scope": "global"}).enabled
    assert not CachePolicy.from_parameters({**CACHED, "report_cache_hit": "yes"}).enabled
    default = CachePolicy.from_parameters(CACHED)
    assert default.enabled and not default.shared and not default.report_hit


async def test_a_model_without_the_response_cache_goes_straight_through(server):
    backend = Backend(parameters={})  # not cached: no lookup, no store
    client = CacheClient(f"127.0.0.1:{server.port}", max_message_bytes=1 << 20)
    try:
        responses = await asyncio.gather(*(client.infer(request(), backend.spec, backend.infer) for _ in range(20)))
        assert all(r.parameters == {} and not r.cache_hit for r in responses) and backend.infer_calls == 20
        assert server.dataplane.counters.hits + server.dataplane.counters.misses == 0
        assert client._policy(backend.spec) is client._policy(backend.spec)  # read once per spec
    finally:
        await client.close()


async def test_results_too_large_for_the_policy_are_not_stored(server):
    backend = Backend(parameters={**CACHED, "cache_max_entry_bytes": "16"})
    client = CacheClient(f"127.0.0.1:{server.port}", max_message_bytes=1 << 20, lookup_timeout_s=0.5)
    try:
        await client.infer(request(), backend.spec, backend.infer)
        await client.infer(request(), backend.spec, backend.infer)
        assert client.counters.stores_dropped == 2 and backend.infer_calls == 2
    finally:
        await client.close()


async def test_an_unreachable_cache_is_bypassed_and_caching_resumes_when_it_returns():
    port = free_port()
    backend = Backend()
    client = CacheClient(
        f"127.0.0.1:{port}",
        max_message_bytes=1 << 20,
        lookup_timeout_s=0.2,
        failure_threshold=3,
        retry_after_s=0.2,
    )
    server = CacheServer(port)
    try:
        for i in range(30):
            response = await client.infer(request(float(i)), backend.spec, backend.infer)
            assert response.cache_hit is False and response.parameters == {}
        assert backend.infer_calls == 30
        assert client.counters.bypassed == 30
        assert 3 <= client.counters.lookup_errors < 30  # the breaker skipped the rest
        await client.invalidate("m")  # cannot reach the cache: remembered, retried
        assert "m" in client._pending_invalidations
        await server.start()
        await until(lambda: not client._pending_invalidations)
        assert server.dataplane.counters.invalidations == 1

        async def cached():
            await client.infer(request(99.0), backend.spec, backend.infer)
            return client.counters.hits > 0

        deadline = time.monotonic() + 5
        while not await cached():
            assert time.monotonic() < deadline, "caching did not resume"
            await asyncio.sleep(0.05)
    finally:
        await client.close()
        if server.server is not None:
            await server.stop()
