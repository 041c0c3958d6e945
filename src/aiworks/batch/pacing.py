"""How many requests a batch runner keeps in flight: slow start, then additive increase, multiplicative decrease (AIMD).

The runner is a plain client of the gateway and sees only its own requests,
so it paces itself on what comes back, as TCP's congestion control does on
its acknowledgements.

**Slow start.** The limit starts at a quarter of ``ceiling`` and, until the
first cut, each answer that grows it adds one request: the limit doubles
each round (``limit`` answers), so a job reaches the ceiling within two
rounds instead of spending its first thousands of answers below it. The
first cut ends slow start for the pacer's life; from then on growth is
additive.

**The runtime's signal.** A runtime marks each ``batch``-class answer with the
response parameter ``online_load`` (:data:`aiworks.core.options.ONLINE_LOAD`):
whether online requests were queued on the model version, or one arrived
within its online window, when the answer's batch ended. The gateway passes
it through. That is the congestion signal: on ``true`` the job yields at
once, the limit dropping to ``floor``; on ``false`` it grows (by one in slow
start, else by 1 / limit: about one request per round of answers; by one
an answer under one), up to ``ceiling``. Halving per round instead took a
job at 64 packed requests in flight seven rounds to get out of the way of
online traffic that had just arrived, and held the online p99 of that
first second at 120 ms (against 16 ms; ``bench/tiers.py``'s ``first_2_s``).
The job's own load does not count:
the latency it causes itself (a busy gateway, a busy runner) never cuts the
limit, so with no online traffic the job keeps ``ceiling`` requests in
flight.

**A 429 or 503 answer** (a full queue, a quota, a replica not ready) cuts it
to ``decrease`` × itself, at most once per round (below).

**Without the signal** (an answer with no ``online_load``: a runtime that
does not send it, a cache hit), the answer's latency decides instead:

- the latency of each answered request, smoothed, against the lowest
  smoothed latency seen so far (the latency of a quiet suite; the minimum of
  the average, not of single answers, so one lucky answer does not set a
  baseline nothing can meet again). When the smoothed latency goes above
  ``tolerance`` × that minimum, the suite is busy, with online traffic or
  with this job: the limit is cut;
- otherwise the answer grows it as a ``false`` signal does. This rule
  cannot tell online load from the job's own, so it stops the job where
  its latency reaches ``tolerance`` × the quiet one.

A cut happens at most once per round (as many answers as the limit was
right after the last cut, or at the start: slow start's growth does not
put off the first cut),
and the smoothed latency starts afresh after it: the answers of requests
sent before a cut describe the load before it, and a stale average would
cut again and again on one burst.

**Under one request.** The limit never goes under ``floor``, so a job always
goes on. A floor under one (the runner's default is 0.25) is a share of one
request's time, as a pacing TCP sender's window under one packet: one request
at a time, and after each answer the gate stays shut for (1 / limit - 1) ×
that request's latency (at most :data:`MAX_PAUSE_S`). At 0.25 the job holds the suite a quarter of the
time, so it can send many rows a request (packing) while online traffic
keeps three quarters of what one request in flight would take from it.
Measured beside online load at half capacity (docs/benchmarks.md, "Tiers"):
one 8-row request always in flight put the online p99 at 1.34× and the p50
at 1.13×; 32-row requests a quarter of the time, at 1.12× and 1.05×, for
two thirds of the rows.

:class:`Pacer` is the arithmetic, with no clock and no I/O;
:class:`PacedGate` holds requests back to the pacer's limit.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque

_WARMUP = 5  # answers the average needs (after a start or a cut) before it is compared or kept as the minimum
MAX_PAUSE_S = 1.0  # the longest pause under one request: an answer slowed by a stall must not idle the job long


class Pacer:
    """The AIMD limit of requests in flight, fed with each request's outcome."""

    def __init__(self, ceiling: int, *, initial: int | None = None, tolerance: float = 2.0, decrease: float = 0.5,
                 smoothing: float = 0.2, adaptive: bool = True, floor: float = 1.0):  # fmt: skip
        if ceiling < 1 or tolerance <= 1.0 or not 0.0 < decrease < 1.0 or not 0.0 < smoothing <= 1.0:
            raise ValueError("pacer needs ceiling >= 1, tolerance > 1, 0 < decrease < 1, 0 < smoothing <= 1")
        if not 0.0 < floor <= ceiling:
            raise ValueError("pacer needs 0 < floor <= ceiling")
        self.ceiling = ceiling
        self.floor = floor
        self.tolerance = tolerance
        self.decrease = decrease
        self.smoothing = smoothing
        self.adaptive = adaptive  # False: the limit stays at the ceiling, whatever comes back
        start = initial if initial is not None else math.ceil(ceiling / 4)
        self.limit = float(min(ceiling, max(1, start))) if adaptive else float(ceiling)
        self.min_latency_s = math.inf
        self.smoothed_s = 0.0
        self.cuts = 0
        self.slow_start = True  # until the first cut: +1 per answer (doubling per round), then +1/limit
        self.signalled = 0  # answers that carried the runtime's signal
        self._since_cut = 0
        self._round = self.allowed  # answers between two cuts: the limit at the start or right after a cut
        self._averaged = 0  # answers in the smoothed latency since it started afresh

    @property
    def allowed(self) -> int:
        """Requests that may be in flight now (at least one)."""
        return max(1, int(self.limit))

    def pause_s(self, busy_s: float) -> float:
        """How long the gate stays shut after a request that took ``busy_s``: 0 unless the limit is under one."""
        limit = self.limit
        return 0.0 if limit >= 1.0 else min(MAX_PAUSE_S, busy_s * (1.0 / limit - 1.0))

    def answered(self, latency_s: float, online: bool | None = None) -> None:
        """A request was answered (200) after ``latency_s``; ``online``: its ``online_load`` (None: not given)."""
        if not self.adaptive:
            return
        if online is not None:
            self.signalled += 1
            self._since_cut += 1
            if online:
                self._yield()
            else:
                self._grow()
            return
        smoothed = self.smoothed_s
        self.smoothed_s = smoothed = latency_s if not smoothed else smoothed + self.smoothing * (latency_s - smoothed)
        self._since_cut += 1
        self._averaged += 1
        if self._averaged < _WARMUP:
            return
        if smoothed < self.min_latency_s:
            self.min_latency_s = smoothed
        if smoothed > self.tolerance * self.min_latency_s:
            self._cut()
        else:
            self._grow()

    def refused(self) -> None:
        """A request was refused for load (429 or 503)."""
        if not self.adaptive:
            return
        self._since_cut += 1
        self._cut()

    def _grow(self) -> None:
        if self.limit < self.ceiling:
            step = 1.0 if self.slow_start else 1.0 / max(1.0, self.limit)
            self.limit = min(float(self.ceiling), self.limit + step)

    def _yield(self) -> None:
        """Online traffic is about: down to the floor at once (nothing to do when there already)."""
        if self.limit > self.floor:
            self.limit = self.floor
            self._after_cut()

    def _cut(self) -> None:
        if self._since_cut < self._round:
            return
        self.limit = max(self.floor, self.limit * self.decrease)
        self._after_cut()

    def _after_cut(self) -> None:
        self.slow_start = False
        self._since_cut = 0
        self._round = self.allowed
        self.smoothed_s = 0.0
        self._averaged = 0
        self.cuts += 1


class PacedGate:
    """Lets requests through while fewer than the pacer allows are in flight; the rest wait, first come first out.

    A place freed goes straight to the first waiter (the releaser counts it
    as taken for it), so a waiter is woken only when it may go: no waiter is
    woken to find the place taken and queue again at the back. Under a limit
    of one, a release shuts the gate for :meth:`Pacer.pause_s` of the
    request's time (``busy_s``) and a timer opens it again.
    """

    def __init__(self, pacer: Pacer):
        self.pacer = pacer
        self.in_flight = 0
        self._waiters: deque[asyncio.Future] = deque()
        self._shut_until = 0.0  # loop time before which nothing goes through (a pause under one request)

    async def acquire(self) -> None:
        if not self._waiters and self.in_flight < self.pacer.allowed and self._open():
            self.in_flight += 1
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter  # its place is counted in in_flight when it is woken
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()  # it was given a place: hand it on
            else:
                self._remove(waiter)
            raise

    def release(self, busy_s: float = 0.0) -> None:
        """A request is done; it held the suite ``busy_s`` (from being let through to its answer)."""
        self.in_flight -= 1
        pause = self.pacer.pause_s(busy_s)
        if pause > 0.0:
            loop = asyncio.get_running_loop()
            self._shut_until = max(self._shut_until, loop.time() + pause)
            loop.call_at(self._shut_until, self._wake)
        self._wake()

    def _open(self) -> bool:
        return not self._shut_until or asyncio.get_running_loop().time() >= self._shut_until

    def _remove(self, waiter: asyncio.Future) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    def _wake(self) -> None:
        allowed = self.pacer.allowed
        if not self._open():
            return  # the timer set at the release wakes the next
        while self.in_flight < allowed and self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)
