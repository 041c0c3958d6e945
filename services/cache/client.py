"""The cache's public face: the client a gateway looks results up with before routing, and stores them after.

Other code imports this module (and ``settings``), never the cache's other
modules; pb2 stays inside the package.


For each request to a model whose config enables the response cache, the
gateway computes the key (:mod:`aiworks.cache.keys`) from the model's resolved
version, asks the cache, and on a hit answers without the scheduler. On a
miss it schedules the request, answers, and stores the result in the
background. Keys are per tenant unless the model shares its entries
(``cache_scope: shared``). Whether the cache answered is in the response's
``cache_hit`` field, which the gateway meters; the client sees it as the
response parameter ``cache_hit`` only when the model opts in
(``report_cache_hit: true``), since it tells a caller what was asked before.

The cache is an optimization, never a dependency: a lookup slower than
``lookup_timeout_s`` or failing counts as a miss; after ``failure_threshold``
failures in a row the breaker opens and the cache is skipped for
``retry_after_s``, then probed again, so caching resumes on its own.

Which models are cached comes from the spec of the version the request
resolved to (the gateway's routing table, which the scheduler keeps
current); the policy is read from it once per spec.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from aiworks.cache.converters import decode_response, encode_response
from aiworks.cache.keys import request_key
from aiworks.cache.policy import CachePolicy, skip_reason
from aiworks.core import metrics, tracing
from aiworks.core.breaker import CircuitBreaker
from aiworks.core.errors import AIWorksError
from aiworks.core.inference import InferRequest, InferResponse
from aiworks.core.model_config import ModelSpec
from aiworks.core.rpc import blocking_channel, client_channel
from aiworks.core.stream import MultiplexedStream
from aiworks.pb.cache.v1 import cache_pb2 as pb
from aiworks.pb.cache.v1 import cache_pb2_grpc
from aiworks.security.callers import ClientCaller
from aiworks.security.tls import TLSFiles

log = logging.getLogger(__name__)

HIT = "cache_hit"
# Results of aiworks_gateway_cache_lookups_total: the cache answered (hit, miss); it was not asked
# (bypass: the request opted out, an invalidation is pending, or the cache's own store is down);
# or asking failed (error: timeout, unreachable, or the breaker is open after such failures).
LOOKUP_RESULTS = (R_HIT, R_MISS, R_BYPASS, R_ERROR) = ("hit", "miss", "bypass", "error")
_PUT_TIMEOUT_S = 1.0
_INVALIDATE_TIMEOUT_S = 5.0

Compute = Callable[[InferRequest], Awaitable[InferResponse]]


@dataclass
class GatewayCacheCounters:
    """What this gateway's cache client did since it started."""

    hits: int = 0
    misses: int = 0
    skipped: int = 0  # the request asked to bypass the cache, or is not deterministic
    bypassed: int = 0  # the cache was down, slow or skipped by the breaker: served without it
    lookup_errors: int = 0
    stores: int = 0
    store_errors: int = 0
    stores_dropped: int = 0  # too many stores in flight, or too large for the model's policy
    invalidation_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class CacheClient:
    """Calls the CacheService from the gateway; failures never reach the client."""

    def __init__(
        self,
        address: str,
        *,
        max_message_bytes: int,
        lookup_timeout_s: float = 0.01,
        failure_threshold: int = 10,
        retry_after_s: float = 1.0,
        max_pending_stores: int = 256,
        clock: Callable[[], float] = time.monotonic,
        tls: TLSFiles | None = None,
    ):
        self.address = address
        self.lookup_timeout_s = lookup_timeout_s
        self.max_pending_stores = max_pending_stores
        self._clock = clock
        self._channel = client_channel(address, max_message_bytes, tls, server_name="cache")
        self._stub = cache_pb2_grpc.CacheServiceStub(self._channel)
        self._gets = MultiplexedStream(self._stub.GetStream, f"cache {address}", pb.GetRequestFrame, max_message_bytes)
        self._puts = MultiplexedStream(self._stub.PutStream, f"cache {address}", pb.PutRequestFrame, max_message_bytes)
        self.breaker = CircuitBreaker(failure_threshold=failure_threshold, retry_after_s=retry_after_s, clock=clock)
        self.counters = GatewayCacheCounters()
        self._policies: dict[int, tuple[ModelSpec, CachePolicy]] = {}  # id(spec) -> (spec, its policy)
        self._stores: set[asyncio.Task] = set()
        self._pending_invalidations: set[str] = set()
        self._retry_task: asyncio.Task | None = None
        self._last_warning_s = -1e9
        self._lookup_children: dict[str, dict[str, object]] = {}

    # ---- the request path ---------------------------------------------------------------------

    async def infer(self, request: InferRequest, spec: ModelSpec, compute: Compute) -> InferResponse:
        """Answer ``request`` (for version ``spec``) from the cache, or with ``compute`` and store the result."""
        policy = self._policy(spec)
        if not policy.enabled:  # not a cached model: no lookup at all
            if skip_reason(request.parameters):
                self.counters.skipped += 1
            return await compute(request)
        lookups = self._lookups(request.model)
        if skip_reason(request.parameters):
            self.counters.skipped += 1
            lookups[R_BYPASS].inc()
            return await compute(request)
        if request.model in self._pending_invalidations:
            self.counters.bypassed += 1
            lookups[R_BYPASS].inc()
            return self._mark(await compute(request), False, policy)
        with tracing.child_span("cache lookup", {"aiworks.model": request.model}) as span:
            key = request_key(
                request.model, spec.version, request.inputs, request.outputs, request.parameters, policy,
                tenant=request.tenant, classification=request.classification,
            )  # fmt: skip
            found, result = await self._lookup(request.model, key)
            response = None
            if result == R_HIT:
                try:
                    response = decode_response(found.value, request.id)
                except Exception as exc:  # a corrupt entry is a miss
                    log.warning("unreadable cache entry for %s: %s", request.model, exc)
                    result = R_MISS
            span.set("aiworks.cache.result", result)
        lookups[result].inc()
        if response is not None:
            self.counters.hits += 1
            return self._mark(response, True, policy)
        response = await compute(request)
        if found is not None:
            self.counters.misses += 1
            if response.version == spec.version:
                self._store_later(request.model, key, found.epoch, response, policy)
        return self._mark(response, False, policy)

    def _lookups(self, model: str) -> dict[str, object]:
        """The lookup counters of ``model`` (a cached model, so the label stays bounded), by result."""
        children = self._lookup_children.get(model)
        if children is None:
            children = {r: metrics.GATEWAY_CACHE_LOOKUPS.labels(model, r) for r in LOOKUP_RESULTS}
            self._lookup_children[model] = children
        return children

    @staticmethod
    def _mark(response: InferResponse, hit: bool, policy: CachePolicy) -> InferResponse:
        response.cache_hit = hit
        if policy.report_hit:
            response.parameters[HIT] = hit
        return response

    async def _lookup(self, model: str, key: bytes) -> tuple[pb.GetResponse | None, str]:
        """The cache's answer and the lookup's result; no answer when it is skipped, slow or failing."""
        if not self.breaker.allow():  # open after failures: counted as an error, as they were
            self.counters.bypassed += 1
            return None, R_ERROR
        try:
            reply = await self._gets.call(pb.GetRequest(model=model, key=key), self.lookup_timeout_s)
        except AIWorksError as exc:
            self.counters.lookup_errors += 1
            self.counters.bypassed += 1
            self._failed(f"lookup failed: {exc.message}")
            return None, R_ERROR
        self.breaker.success()
        if reply.bypassed:  # the cache answered, but its store is down: nothing to store into either
            self.counters.bypassed += 1
            return None, R_BYPASS
        return reply, (R_HIT if reply.found else R_MISS)

    def _failed(self, why: str) -> None:
        self.breaker.failure()
        now = self._clock()
        if now - self._last_warning_s > 5:
            self._last_warning_s = now
            log.warning("result cache at %s bypassed: %s", self.address, why)

    def _store_later(self, model: str, key: bytes, epoch: int, response: InferResponse, policy: CachePolicy) -> None:
        """Store without delaying the response; drop the store when too many are in flight."""
        value = encode_response(response)
        if len(value) > policy.max_entry_bytes or len(self._stores) >= self.max_pending_stores:
            self.counters.stores_dropped += 1
            return
        request = pb.PutRequest(model=model, key=key, value=value, epoch=epoch, ttl_ms=int(policy.ttl_s * 1000))
        task = asyncio.get_running_loop().create_task(self._store(request))
        self._stores.add(task)
        task.add_done_callback(self._stores.discard)

    async def _store(self, request: pb.PutRequest) -> None:
        try:
            reply = await self._puts.call(request, _PUT_TIMEOUT_S)
        except AIWorksError as exc:
            self.counters.store_errors += 1
            self._failed(f"store failed: {exc.message}")
            return
        if reply.stored:
            self.counters.stores += 1

    # ---- which models are cached ----------------------------------------------------------------

    def _policy(self, spec: ModelSpec) -> CachePolicy:
        """The cache policy a version's config sets, read once per spec."""
        entry = self._policies.get(id(spec))
        if entry is None or entry[0] is not spec:
            if len(self._policies) > 4096:
                self._policies.clear()
            entry = self._policies[id(spec)] = (spec, CachePolicy.from_parameters(spec.parameters, spec.name))
        return entry[1]

    # ---- invalidation ---------------------------------------------------------------------------

    async def invalidate(self, model: str) -> None:
        """Drop ``model``'s entries (after a load or unload). Never raises.

        Until the cache confirms, this gateway bypasses the cache for the
        model, and retries the invalidation in the background.
        """
        self._pending_invalidations.add(model)
        if not await self._invalidate(model):
            self._ensure_retrying()

    async def _invalidate(self, model: str) -> bool:
        try:
            reply = await self._stub.Invalidate(pb.InvalidateRequest(model=model), timeout=_INVALIDATE_TIMEOUT_S)
        except Exception as exc:
            self.counters.invalidation_errors += 1
            log.warning("invalidation of %s in the cache at %s failed, will retry: %s", model, self.address, exc)
            return False
        self._pending_invalidations.discard(model)
        log.info("invalidated %d cached result(s) of %s", reply.removed, model)
        return True

    def _ensure_retrying(self) -> None:
        if self._retry_task is None or self._retry_task.done():
            self._retry_task = asyncio.get_running_loop().create_task(self._retry_invalidations())

    async def _retry_invalidations(self) -> None:
        while self._pending_invalidations:
            await asyncio.sleep(self.breaker.retry_after_s)
            for model in sorted(self._pending_invalidations):
                await self._invalidate(model)

    async def close(self) -> None:
        if self._retry_task is not None:
            self._retry_task.cancel()
        if self._stores:
            await asyncio.wait(list(self._stores), timeout=_PUT_TIMEOUT_S)
        await self._gets.close()
        await self._puts.close()
        await self._channel.close()


def fetch_stats(
    address: str, tls: TLSFiles | None = None, caller: ClientCaller | None = None, timeout_s: float = 5.0
) -> pb.StatsResponse:
    """The cache service's counters, in one blocking call (tools and benchmarks); failures stay grpc.RpcError."""
    with blocking_channel(address, tls, server_name="cache", caller=caller) as channel:
        return cache_pb2_grpc.CacheServiceStub(channel).Stats(pb.StatsRequest(), timeout=timeout_s)
