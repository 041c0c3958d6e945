"""Admission and ordering of one model version's queue: a state machine with no I/O.

**Order.** Three FIFO lanes, one per class. The next request is the lane head
with the smallest *rank*, where rank = arrival time + class rank × aging step.
A ``batch`` request that arrived at *t* therefore competes like a ``realtime``
request that arrived at *t* + 2 steps: higher classes go first under
contention, and since later arrivals always rank later, every request
eventually becomes the first — no class starves, and a lower class waits at
most its distance × the aging step behind newer, higher ones (plus the work
ahead of it). This is aging, not weights: a class's share is not fixed, its
extra wait is bounded.

**Batches.** A batch starts with the best head; more heads join, best first,
while they have the same signature (non-batch shapes and requested outputs)
and fit in ``max_rows``. Requests whose deadline has passed are dropped as
they reach a head, never run.

**Bounds.** At most ``max_requests`` requests and ``max_bytes`` input bytes
are queued. A request that does not fit sheds the youngest requests of lower
classes when that makes room; otherwise it is refused.

**Online first.** Aging orders the queue, but a batch of ``batch`` requests
that already runs still holds the model while an online request waits. So
while online (``realtime`` or ``standard``) requests are queued, or one
arrived within ``online_window_s``, the batch class gets a bounded share:
:meth:`QueueState.batch_rows_cap` bounds its rows in one batch, and the
batcher (:mod:`aiworks.runtime.batcher`) bounds the execution slots its
batches hold. With no online traffic in the window, batch work uses
everything.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from aiworks.core.options import Priority


@dataclass(slots=True, eq=False)
class Entry:
    """One queued request as this state machine sees it; ``payload`` is the caller's."""

    payload: object
    priority: Priority
    rows: int
    nbytes: int
    signature: Hashable
    enqueued_s: float
    deadline_s: float | None = None
    rank_s: float = 0.0
    queued: bool = False

    def expired(self, now_s: float) -> bool:
        return self.deadline_s is not None and now_s >= self.deadline_s


class QueueState:
    """Bounded three-class queue of one model version."""

    def __init__(self, *, max_requests: int, max_bytes: int, aging_s: float, batch_share: float = 1.0,
                 online_window_s: float = 0.0):  # fmt: skip
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.aging_s = aging_s
        self.batch_share = batch_share
        self.online_window_s = online_window_s
        self.online_seen_s = float("-inf")  # when the last online request was queued
        self._lanes: dict[Priority, deque[Entry]] = {p: deque() for p in Priority}
        self.counts: dict[Priority, int] = {p: 0 for p in Priority}
        self.requests = 0
        self.rows = 0
        self.batch_rows = 0  # of them, batch-class rows
        self.nbytes = 0
        self._stale = 0  # entries left in lanes after removal, dropped lazily

    # ---- admission -----------------------------------------------------------------------

    def admit(self, entry: Entry) -> list[object] | None:
        """Queue ``entry``; return the payloads shed to make room, or None if refused."""
        entry.rank_s = entry.enqueued_s + int(entry.priority) * self.aging_s
        if entry.priority is not Priority.BATCH:
            self.online_seen_s = entry.enqueued_s
        over_requests = self.requests + 1 - self.max_requests
        over_bytes = self.nbytes + entry.nbytes - self.max_bytes
        victims: list[Entry] = []
        if over_requests > 0 or over_bytes > 0:
            for lower in sorted(Priority, reverse=True):
                if lower <= entry.priority:
                    break
                for queued in reversed(self._lanes[lower]):
                    if over_requests <= 0 and over_bytes <= 0:
                        break
                    if queued.queued:
                        victims.append(queued)
                        over_requests -= 1
                        over_bytes -= queued.nbytes
            if over_requests > 0 or over_bytes > 0:
                return None
        shed = [self._drop(v) for v in victims]
        entry.queued = True
        self._lanes[entry.priority].append(entry)
        self._count(entry, +1)
        return shed

    def remove(self, entry: Entry) -> bool:
        """Take ``entry`` out (its caller gave up); False if it already left."""
        if not entry.queued:
            return False
        self._drop(entry)
        return True

    # ---- order ---------------------------------------------------------------------------

    def peek(self) -> Entry | None:
        """The request that goes next."""
        best = None
        for p in Priority:
            head = self._head(p)
            if head is not None and (best is None or head.rank_s < best.rank_s):
                best = head
        return best

    def take(self, max_rows: int, now_s: float, batch_rows: int | None = None, *, online: bool = True
             ) -> tuple[list[Entry], list[Entry]]:  # fmt: skip
        """The next batch (one request when ``max_rows`` is 0), and the expired requests met on the way.

        ``batch_rows`` bounds the rows of ``batch``-class requests in it (None:
        no bound; 0: none at all). A batch that starts with a ``batch``
        request takes it whole even when it has more rows. ``online`` False
        takes ``batch``-class requests only (the batch lane's).
        """
        expired: list[Entry] = []
        batch: list[Entry] = []
        rows = 0
        low_rows = 0  # rows of batch-class requests taken
        signature = None
        while True:
            best = None
            for p in Priority if online else (Priority.BATCH,):
                head = self._head(p)
                while head is not None and head.expired(now_s):
                    expired.append(self._pop(p))
                    head = self._head(p)
                if head is None:
                    continue
                if batch and (head.signature != signature or rows + head.rows > max_rows):
                    continue
                if (
                    batch_rows is not None and p is Priority.BATCH
                    and (batch_rows <= 0 or (batch and low_rows + head.rows > batch_rows))
                ):  # fmt: skip
                    continue
                if best is None or head.rank_s < best.rank_s:
                    best = head
            if best is None:
                break
            batch.append(self._pop(best.priority))
            rows += best.rows
            if best.priority is Priority.BATCH:
                low_rows += best.rows
            signature = best.signature
            if max_rows <= 0:
                break
        return batch, expired

    # ---- the batch class's share while online traffic is about ----------------------------

    @property
    def online_queued(self) -> bool:
        return self.counts[Priority.REALTIME] > 0 or self.counts[Priority.STANDARD] > 0

    def online_active(self, now_s: float) -> bool:
        """Whether online requests are queued or one arrived within ``online_window_s``."""
        return self.online_queued or now_s - self.online_seen_s < self.online_window_s

    def online_quiet_in(self, now_s: float) -> float:
        """Seconds until the online window ends with no new online request (0: it has)."""
        return max(0.0, self.online_seen_s + self.online_window_s - now_s)

    def batch_rows_cap(self, max_rows: int, now_s: float) -> int | None:
        """Most batch-class rows in the next batch of ``max_rows`` (None: no bound): the share while online is about."""
        if self.batch_share >= 1.0 or not self.online_active(now_s):
            return None
        return max(1, int(self.batch_share * max_rows))

    def drain(self) -> list[object]:
        """Remove everything; return the payloads."""
        out = [e.payload for lane in self._lanes.values() for e in lane if e.queued]
        for lane in self._lanes.values():
            for e in lane:
                e.queued = False
            lane.clear()
        self.counts = {p: 0 for p in Priority}
        self.requests = self.rows = self.batch_rows = self.nbytes = self._stale = 0
        return out

    # ---- internals -----------------------------------------------------------------------

    def _head(self, p: Priority) -> Entry | None:
        lane = self._lanes[p]
        while lane and not lane[0].queued:
            lane.popleft()
            self._stale -= 1
        return lane[0] if lane else None

    def _pop(self, p: Priority) -> Entry:
        entry = self._lanes[p].popleft()
        entry.queued = False
        self._count(entry, -1)
        return entry

    def _drop(self, entry: Entry) -> object:
        entry.queued = False
        self._count(entry, -1)
        payload, entry.payload = entry.payload, None  # the lane may hold the entry a while; not its tensors
        self._stale += 1
        if self._stale > self.requests + 64:
            for p, lane in self._lanes.items():
                self._lanes[p] = deque(e for e in lane if e.queued)
            self._stale = 0
        return payload

    def _count(self, entry: Entry, sign: int) -> None:
        self.counts[entry.priority] += sign
        self.requests += sign
        self.rows += sign * entry.rows
        if entry.priority is Priority.BATCH:
            self.batch_rows += sign * entry.rows
        self.nbytes += sign * entry.nbytes
