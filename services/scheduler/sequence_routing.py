"""Stateful models: each sequence is pinned to one runtime replica for its life, the same from every gateway.

A stateful model's state lives in the replica that runs its sequence
(services/model-runtime/sequence_batcher.py), so every request of a sequence
must reach that replica, whichever gateway it passes through. Gateways do
not share memory; they agree by **rendezvous (highest-random-weight)
hashing**: each live replica holding the model version gets a weight, a
hash of its id and the correlation id, and the sequence belongs to the
highest. Every gateway with the same routing table computes the same
order; a replica leaving moves only its own sequences, and one joining
takes only those it now outweighs.

- A **start** goes to the first replica of that order (a replica just found
  unreachable is tried last); if it cannot be reached nothing has started,
  so the next one is tried.
- Each gateway remembers where its sequences went (a bounded table, an
  entry dropped at the sequence's end). A later request of a remembered
  sequence goes there and nowhere else: it is never retried on another
  replica mid-sequence, since that replica would not know it. If its
  replica has left the routing table, or its stream broke, the client is
  told the sequence was lost with its replica and must be started again
  (FAILED_PRECONDITION: HTTP 412).
- A replica that got its stop signal stays in the table, marked stopping,
  while it drains: nothing new goes to it (no start, no request of a
  stateless model), but the later requests of the sequences it holds still
  do, so a sequence that ends within the drain is not lost. Its drain waits
  for them (services/model-runtime/server.py).
- A request of a sequence this gateway has not seen (another gateway
  started it, or a replica joined since and now outweighs the one holding
  it) tries the first :data:`PROBES` replicas of the order; a replica that
  does not hold the sequence says so at no cost, and stopping replicas that
  hold the model are asked after them. If none holds it, the
  answer is Triton's 400 ("must specify the START flag on the first request
  of the sequence"), or the sequence-lost error when a replica that served
  the model left the table within the last :data:`LOST_WINDOW_S` seconds
  or could not be reached.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from aiworks.core.errors import AIWorksError, InvalidArgument, Status, Unavailable
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import ModelSpec
from aiworks.core.options import RequestOptions, SequenceRef
from aiworks.runtime.client import Answer, Work
from aiworks.scheduler.catalog import Key, Replica
from aiworks.scheduler.mirror import RoutingMirror

log = logging.getLogger(__name__)

# Replicas of the rendezvous order a request of an unknown sequence may try: covers replicas joining meanwhile.
PROBES = 3
# Sequences a gateway remembers the replica of (least recently used forgotten first).
MAX_PINS = 65_536
# How recently a replica must have left for an unknown sequence to count as lost with it (or the model's idle time).
LOST_WINDOW_S = 30.0

Send = Callable[[Key, Replica, InferRequest, RequestOptions, "Work | None"], Awaitable[Answer]]


def rendezvous_weight(replica_id: str, sequence_id: int | str) -> int:
    """A replica's weight for a sequence: the same in every process (Python's own hash is salted per process)."""
    kind = "s" if isinstance(sequence_id, str) else "u"
    digest = hashlib.blake2b(f"{replica_id}\x00{kind}:{sequence_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(replicas: list[Replica], sequence_id: int | str) -> list[Replica]:
    """``replicas`` by weight for ``sequence_id``, highest first."""
    return sorted(replicas, key=lambda r: (rendezvous_weight(r.replica_id, sequence_id), r.replica_id), reverse=True)


def sequence_lost(ref: SequenceRef, key: Key, replica_id: str, why: str) -> AIWorksError:
    return AIWorksError(
        f"sequence {ref.id} of model '{key[0]}' was lost: the runtime replica that held it ({replica_id}) {why}; "
        "start the sequence again (sequence_start)",
        Status.FAILED_PRECONDITION,
    )


def not_started(ref: SequenceRef, key: Key) -> InvalidArgument:
    return InvalidArgument(
        f"inference request for sequence {ref.id} to model '{key[0]}' must specify the START flag on the first "
        "request of the sequence"
    )


class SequenceRouting:
    """Sends the requests of stateful models; see the module docstring.

    ``send`` tries one replica (the dispatcher's accounting, per-try timeout
    and outlier counting); ``is_down`` says a replica was just found
    unreachable.
    """

    def __init__(self, mirror: RoutingMirror, send: Send, is_down: Callable[[Replica], bool],
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.mirror = mirror
        self._send = send
        self._is_down = is_down
        self._clock = clock
        self._pins: OrderedDict[tuple[Key, int | str], str] = OrderedDict()

    def _remember(self, key: Key, ref: SequenceRef, replica_id: str) -> None:
        pin = (key, ref.id)
        if ref.end:
            self._pins.pop(pin, None)
            return
        self._pins[pin] = replica_id
        self._pins.move_to_end(pin)
        while len(self._pins) > MAX_PINS:
            self._pins.popitem(last=False)

    def where(self, key: Key, sequence_id: int | str) -> str | None:
        """The replica this gateway sent the sequence to, if it remembers one."""
        return self._pins.get((key, sequence_id))

    async def send(self, spec: ModelSpec, request: InferRequest, options: RequestOptions,
                   work: Work | None) -> Answer:  # fmt: skip
        key = (spec.name, spec.version)
        ref = options.sequence
        if ref is None:
            raise InvalidArgument(
                f"inference request to model '{spec.name}' must specify a non-zero or non-empty correlation ID"
            )
        pinned = self._pins.get((key, ref.id))
        if pinned is not None:
            replica = self.mirror.replicas.get(pinned)
            if replica is not None and any(r.replica_id == pinned for r in self.mirror.holders(key)):
                return await self._pinned(key, ref, replica, request, options, work)
            draining = self.mirror.stopping.get(pinned)
            if draining is not None and draining.holds(key) and not ref.start:  # it ends there within the drain
                return await self._pinned(key, ref, draining, request, options, work)
            self._pins.pop((key, ref.id), None)
            if not ref.start:
                raise sequence_lost(ref, key, pinned, "left the routing table")
        holders = self.mirror.holders(key)
        # Another gateway's sequence may be on a stopping replica: probed after the live ones, never started there.
        draining = [] if ref.start else self.mirror.stopping_holders(key)
        if not holders and not draining:
            raise Unavailable(f"no live replica serves model '{key[0]}' version {key[1]}")
        order = rendezvous_order(holders, ref.id)
        if ref.start:
            # A replica just found unreachable goes last: nothing has started anywhere yet.
            order = [r for r in order if not self._is_down(r)] + [r for r in order if self._is_down(r)]
            return await self._start(key, ref, order, request, options, work)
        return await self._find(spec, key, ref, order[:PROBES] + draining, request, options, work)

    async def _pinned(self, key, ref, replica, request, options, work) -> Answer:
        try:
            answer = await self._send(key, replica, request, options, work)
        except AIWorksError as exc:
            if exc.status is Status.UNAVAILABLE:
                self._pins.pop((key, ref.id), None)
                raise sequence_lost(ref, key, replica.replica_id, f"could not be reached ({exc.message})") from None
            if exc.status is Status.FAILED_PRECONDITION:  # it idled out there, or the replica started afresh
                self._pins.pop((key, ref.id), None)
                raise InvalidArgument(exc.message) from None
            raise
        self._remember(key, ref, replica.replica_id)
        return answer

    async def _start(self, key, ref, order, request, options, work) -> Answer:
        error: AIWorksError | None = None
        for replica in order[:PROBES]:
            try:
                answer = await self._send(key, replica, request, options, work)
            except AIWorksError as exc:
                if exc.status is not Status.UNAVAILABLE:
                    raise
                error = exc
                log.warning("sequence %s of %s/%s: replica %s unreachable (%s); starting it on the next one",
                            ref.id, *key, replica.replica_id, exc.message)  # fmt: skip
                continue
            self._remember(key, ref, replica.replica_id)
            return answer
        raise error

    async def _find(self, spec, key, ref, order, request, options, work) -> Answer:
        unreachable = []
        for replica in order:
            try:
                answer = await self._send(key, replica, request, options, work)
            except AIWorksError as exc:
                if exc.status is Status.FAILED_PRECONDITION:
                    continue  # not there: no state was touched
                if exc.status is Status.UNAVAILABLE:
                    unreachable.append(replica.replica_id)
                    continue
                raise
            self._remember(key, ref, replica.replica_id)
            return answer
        if unreachable:
            raise sequence_lost(ref, key, unreachable[0], "could not be reached")
        window_s = max(LOST_WINDOW_S, spec.sequence.max_idle_us / 1e6 if spec.sequence else 0.0)
        departed = self.mirror.departed_holders(key, window_s)
        if departed:
            raise sequence_lost(ref, key, departed[0], "left the routing table")
        raise not_started(ref, key)
