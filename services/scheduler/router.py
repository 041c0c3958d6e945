"""Chooses the replica for each request, on the gateway, from the scheduler's routing table.

1. **Candidates**: live replicas that hold the model version (or still
   retire it), minus those already tried for this request.
   When none serves it but a replica is bringing it back (its backend
   restarts, the version shows as LOADING), the request waits for it
   (:class:`Recovering`) rather than failing.
2. **Unreachable and ejected**: replicas that just failed to answer at all
   are left out for a moment (until :data:`DOWN_S` passes or the table says
   otherwise), and replicas ejected as outliers until their time is up,
   unless that leaves none; then all serve (Envoy's panic routing: better a
   suspect replica than none).
3. **Pools**: if the request's class has a preferred pool (by default
   realtime → ``device=gpu``, batch → ``device=cpu``) and a candidate matches
   it, only matching candidates serve.
4. **Power of two choices**: among two random candidates, the one with the
   lower expected cost: its latency for the version × (1 + the requests this
   gateway has in flight there). The latency is the replica's moving average,
   or, while it has requests in flight and has answered none of them for
   longer than that, the time it has been silent: a replica that hangs costs
   more with every millisecond and stops getting requests long before any
   timeout. A replica not yet measured counts as twice as fast as the
   fastest measured one, so it gets tried first, and its requests in flight
   still count (a replica costing 0 would take every request until measured).
   An average not refreshed for a while fades towards that guess (half of it
   every :data:`FADE_S`, as Finagle's peak-EWMA balancer decays by time), so a
   replica avoided for being slow is tried again later, not never.
5. **Probation**: a replica not measured, or whose average has faded, gets
   one request at a time until it answers, unless no other candidate is
   left: a replica that came up broken (or hangs) holds one request, not a
   burst of them, and that one is retried elsewhere.
   A replica k times slower holds each request k times longer and so loses
   the comparisons while the other has fewer in flight: it gets about 1/k as
   many requests.

6. **KV room**, before steps 4 and 5 (generative versions, whose replicas report it in their
   heartbeats and the routing table carries): when every candidate left has
   figures younger than :data:`KV_STALE_S`, the one with the most free KV
   tokens wins, among all of them when they are at most
   :data:`KV_ALL_UP_TO`, else among two random ones. Its free tokens are
   those it reported, less an estimate of what each generation this gateway
   sent it since then reserves (prompt + ``max_tokens``), less a whole
   budget per sequence waiting there for room that this generation would
   wait behind: those of its QoS class and the more urgent ones, as the
   replica reports them by class (a queue is worse than any room
   elsewhere, but a realtime generation is admitted ahead of waiting batch
   ones); ties go to the lower cost of step 4. Probation (step 5)
   holds back only replicas never measured: a faded average says nothing
   against a replica whose heartbeats report room. Figures missing on any
   candidate, or stale, and it is steps 4 and 5 as for any model. Other
   models pay one set lookup.
   **Prompt affinity** comes first within this step: a generation whose
   prompt begins (its first :data:`PROMPT_HEAD_BYTES` bytes, and its tenant)
   as one this gateway sent in the last :data:`AFFINITY_S` goes to the
   same replica, whose engines then copy that beginning's cache entries
   instead of reading it again (the ``n`` choices of one request, a system
   prompt; docs/generation.md, "Shared prompts"), as long as that replica's
   room is within :data:`AFFINITY_SLACK` of this generation's reserve of
   the most room: a prompt every request begins with still spreads.
   Before the first figures (or when they are stale) the bound is requests
   in flight instead: at most :data:`AFFINITY_SLACK` more than the least
   busy candidate.

No replica is reserved and nothing waits here: requests queue at the
replica, where the batcher forms batches by class and deadline.
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable

from aiworks.core import metrics
from aiworks.core.errors import AIWorksError, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.options import Priority
from aiworks.scheduler.catalog import Catalog, Key, Replica
from aiworks.scheduler.replica_state import OutlierDetector

Selector = tuple[tuple[str, str], ...]
# How long a replica that could not be reached at all is left out of routing.
DOWN_S = 1.0
# Half-life of a latency average that is not refreshed: it fades towards the optimistic guess for unmeasured
# replicas, so a replica once slow is tried again (and, if still bad, ejected) rather than avoided for ever.
FADE_S = 2.0
# KV figures older than this (three heartbeats at the default 1 s, and the scheduler republishes unchanged ones
# every two) are not routed by: the replica, or this gateway's watch of the scheduler, has gone quiet.
KV_STALE_S = 3.5
# Up to this many candidates, a generation goes to the one with the most KV room of all; above, of two random.
KV_ALL_UP_TO = 4
# Bytes of prompt per token, for the estimate of a generation's reserve (byte-level BPE: 3 to 4 on code, so
# the estimate errs high).
KV_BYTES_PER_TOKEN = 3
# The reserve estimated when a request names no max_tokens (the llm backend's default default_max_tokens).
KV_DEFAULT_MAX_TOKENS = 16
# Prompt affinity (step 6): the bytes of a prompt's beginning that must agree (about the 16 tokens an engine
# shares from), how long a beginning remembers its replica, how many reserves of room less than the best that
# replica may have and still take it, and how many beginnings a router remembers (the oldest are forgotten).
PROMPT_HEAD_BYTES = 64
AFFINITY_S = 10.0
AFFINITY_SLACK = 3
AFFINITY_ENTRIES = 4096


class Recovering(Unavailable):
    """No replica serves the version now, but one is bringing it back (its backend restarts): wait for it."""


class PoolPolicy:
    """Preferred replicas per class, as ``key=value`` terms on device and labels."""

    def __init__(self, selectors: dict[Priority, Selector] | None = None):
        self.selectors = selectors or {}

    @classmethod
    def parse(cls, by_class: dict[str, str]) -> PoolPolicy:
        """From settings such as ``{"realtime": "device=gpu", "batch": "device=cpu,pool=spot"}``."""
        selectors = {}
        for name, text in by_class.items():
            terms = []
            for term in filter(None, (t.strip() for t in text.split(","))):
                key, sep, value = term.partition("=")
                if not sep:
                    raise ValueError(f"pool term '{term}' for {name} is not key=value")
                terms.append((key.strip(), value.strip()))
            selectors[Priority.named(name)] = tuple(terms)
        return cls(selectors)

    @staticmethod
    def matches(replica: Replica, selector: Selector) -> bool:
        return all((replica.device if k == "device" else replica.labels.get(k)) == v for k, v in selector)

    def prefer(self, priority: Priority, replicas: list[Replica]) -> list[Replica]:
        selector = self.selectors.get(priority)
        if not selector:
            return replicas
        return [r for r in replicas if self.matches(r, selector)] or replicas


class Router:
    """Latency-aware routing with outlier ejection and class pools, over a catalog of replicas."""

    def __init__(
        self,
        catalog: Catalog,
        *,
        outliers: OutlierDetector,
        pools: PoolPolicy | None = None,
        ewma_alpha: float = 0.3,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.catalog = catalog
        self.outliers = outliers
        self.pools = pools or PoolPolicy()
        self.ewma_alpha = ewma_alpha
        self._rng = rng or random.Random()
        self._clock = clock
        self._down_until: dict[str, float] = {}
        self._affinity: OrderedDict[tuple[Key, bytes], tuple[str, float]] = OrderedDict()  # -> (replica, sent at)

    # ---- choice --------------------------------------------------------------------------

    def candidates(
        self, key: Key, priority: Priority, exclude: frozenset[str] | set[str] = frozenset()
    ) -> list[Replica]:
        holders = [r for r in self.catalog.holders(key) if r.replica_id not in exclude]
        if not holders:
            if self.catalog.recovering(key, exclude):
                raise Recovering(f"model '{key[0]}' version {key[1]} is coming back on its replica")
            raise Unavailable(f"no live replica serves model '{key[0]}' version {key[1]}")
        now = self._clock()
        reachable = [r for r in holders if self._down_until.get(r.replica_id, 0.0) <= now] or holders
        healthy = [r for r in reachable if not self.outliers.ejected(r.health)] or reachable
        return self.pools.prefer(priority, healthy)

    def _latency(self, replica: Replica, key: Key, now: float, unmeasured_s: float) -> tuple[float, bool]:
        """The latency to expect of ``replica`` for ``key``, and whether it is on probation (unknown or faded)."""
        health = replica.health
        measured = health.latency_s.get(key)
        if measured is None:
            return unmeasured_s, True
        weight = 0.5 ** ((now - health.latency_at_s.get(key, now)) / FADE_S)
        return unmeasured_s + (measured - unmeasured_s) * weight, weight < 0.5

    def _cost(self, latency_s: float, replica: Replica, now: float) -> float:
        if replica.outstanding:
            silent_s = now - max(replica.busy_since_s, replica.answered_s)
            latency_s = max(latency_s, silent_s)
        return latency_s * (1 + replica.outstanding)

    def pick(self, key: Key, priority: Priority = Priority.STANDARD, exclude: frozenset[str] | set[str] = frozenset(),
             head: bytes = b"", reserve: int = 0) -> Replica:  # fmt: skip
        """The replica for the next request of ``key``; UNAVAILABLE when none holds it. ``head`` and ``reserve``:
        a generation's :func:`prompt_head` and :func:`kv_reserve`, for its prompt affinity (step 6)."""
        candidates = self.candidates(key, priority, exclude)
        if len(candidates) == 1:
            return candidates[0]
        now = self._clock()
        measured = [r.health.latency_s[key] for r in candidates if key in r.health.latency_s]
        unmeasured_s = min(measured) / 2 if measured else 1e-3
        expected = {r.replica_id: self._latency(r, key, now, unmeasured_s) for r in candidates}
        affine = self._affine(key, head, candidates, now) if head else None
        if self.catalog.kv_keys and key in self.catalog.kv_keys:
            # Probation for replicas never measured only: one whose heartbeats report room is no suspect for a
            # faded average (generations come in bursts after quiet spells).
            trusted = [r for r in candidates if key in r.health.latency_s or not r.outstanding] or candidates
            chosen = self._most_kv_room(key, trusted, expected, now, affine, reserve, priority)
            if chosen is not None:
                return chosen
        # Probation: one request at a time for a replica not (or no longer) known to answer.
        candidates = [r for r in candidates if not (expected[r.replica_id][1] and r.outstanding)] or candidates
        if affine is not None and any(r is affine for r in candidates):  # (identity: Replica compares by value)
            if affine.outstanding <= min(r.outstanding for r in candidates) + AFFINITY_SLACK:
                return affine  # no KV figures (yet): bounded by requests in flight instead of room
        if len(candidates) > 2:
            candidates = self._rng.sample(candidates, 2)
        elif len(candidates) == 2 and self._rng.random() < 0.5:
            candidates = [candidates[1], candidates[0]]  # ties go either way
        return min(candidates, key=lambda r: (self._cost(expected[r.replica_id][0], r, now), r.outstanding))

    def _affine(self, key: Key, head: bytes, candidates: list[Replica], now: float) -> Replica | None:
        """The candidate a generation of this prompt beginning went to in the last :data:`AFFINITY_S`, if any."""
        replica_id, at = self._affinity.get((key, head), ("", 0.0))
        if now - at > AFFINITY_S:
            return None
        return next((r for r in candidates if r.replica_id == replica_id), None)

    def _most_kv_room(self, key: Key, candidates: list[Replica], expected: dict, now: float,
                      affine: Replica | None = None, reserve: int = 0,
                      priority: Priority = Priority.STANDARD) -> Replica | None:  # fmt: skip
        """Step 6 of the module docstring; None when some candidate has no fresh KV figures for ``key``."""
        room = {}
        for r in candidates:
            figures = r.kv.get(key) if r.kv is not None else None
            if figures is None or now - r.kv_at_s > KV_STALE_S:
                return None
            reserved = sum(tokens for _, k, tokens in r.kv_sent if k == key)
            waiting = figures.waiting_ahead(int(priority))  # a realtime generation does not wait behind batch ones
            room[r.replica_id] = figures.free_tokens - reserved - waiting * figures.budget_tokens
        if affine is not None and affine.replica_id in room:
            held = room[affine.replica_id]
            if held >= reserve and held >= max(room.values()) - AFFINITY_SLACK * reserve:
                return affine
        if len(candidates) > KV_ALL_UP_TO:
            candidates = self._rng.sample(candidates, 2)
        return max(candidates, key=lambda r: (room[r.replica_id], -self._cost(expected[r.replica_id][0], r, now),
                                              -r.outstanding))  # fmt: skip

    def is_down(self, replica: Replica) -> bool:
        """``replica`` could not be reached a moment ago (:data:`DOWN_S`)."""
        return self._down_until.get(replica.replica_id, 0.0) > self._clock()

    # ---- outcomes ------------------------------------------------------------------------

    def sent(self, replica: Replica, key: Key | None = None, kv_tokens: int = 0, head: bytes = b"") -> None:
        """A request leaves for ``replica``; ``kv_tokens``: a generation's estimated KV reserve there; ``head``: its
        :func:`prompt_head`, which goes to ``replica`` next time too while it has room (step 6)."""
        now = self._clock()
        if head:
            self._affinity[(key, head)] = (replica.replica_id, now)
            self._affinity.move_to_end((key, head))
            if len(self._affinity) > AFFINITY_ENTRIES:
                self._affinity.popitem(last=False)
        if not replica.outstanding:
            replica.busy_since_s = now
        replica.outstanding += 1
        if kv_tokens:
            sent = replica.kv_sent
            sent.append((now, key, kv_tokens))
            if len(sent) > 256:  # no new figures for long: entries older than any usable figures count for nothing
                sent[:] = [s for s in sent if now - s[0] <= KV_STALE_S]

    def answered(self, replica: Replica) -> None:
        """``replica`` answered a request (whatever the answer)."""
        replica.outstanding -= 1
        replica.answered_s = self._clock()

    def succeeded(self, replica: Replica, key: Key, latency_s: float, rows: int = 1) -> None:
        replica.health.observe(key, latency_s, rows, self.ewma_alpha, self._clock())
        self.outliers.success(replica.health)
        self._down_until.pop(replica.replica_id, None)

    def failed(
        self, replica: Replica, exc: AIWorksError, key: Key | None = None, waited_s: float | None = None
    ) -> None:
        """A failure that was the replica's fault: count it towards ejection; leave it out a moment if unreachable.

        A timeout (``waited_s`` given) also counts as a latency sample, so a
        replica that hangs looks slow once it is back, not unmeasured.
        """
        if key is not None and waited_s is not None:
            replica.health.observe_latency(key, waited_s, self.ewma_alpha, self._clock())
        population = [r.health for r in self.catalog.replicas.values()]
        if self.outliers.failure(replica.health, population):
            metrics.SCHEDULER_EJECTIONS.labels(replica.replica_id, "outlier").inc()
        if exc.status is Unavailable.status:
            self._down_until[replica.replica_id] = self._clock() + DOWN_S


def prompt_head(request: InferRequest, tenant: str) -> bytes:
    """A generation's tenant and the first :data:`PROMPT_HEAD_BYTES` bytes of its prompt (``text_input``'s one
    element), its key to prompt affinity; b"" for a shorter prompt or another shape of request."""
    for t in request.inputs:
        if t.name == "text_input" and len(t.raw) >= 4:
            length = int.from_bytes(t.raw[:4], "little")  # a BYTES element: its length, then its bytes
            if length > PROMPT_HEAD_BYTES and len(t.raw) >= 4 + PROMPT_HEAD_BYTES:
                return tenant.encode() + b"\0" + bytes(t.raw[4 : 4 + PROMPT_HEAD_BYTES])
    return b""


def kv_reserve(request: InferRequest) -> int:
    """The KV tokens a generation is likely to reserve on its replica: its prompt's (estimated) and max_tokens."""
    prompt_bytes = sum(len(t.raw) for t in request.inputs if t.name == "text_input")
    max_tokens = request.parameters.get("max_tokens", KV_DEFAULT_MAX_TOKENS)
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        max_tokens = KV_DEFAULT_MAX_TOKENS  # the runtime refuses it; the estimate need not
    return prompt_bytes // KV_BYTES_PER_TOKEN + 1 + min(max_tokens, 1 << 20)
