"""Sends one batch to a replica, and to another when the first fails.

- Each try has a timeout: the per-try timeout (``runtime_timeout_s``) or the
  time left until the batch's deadline, whichever is shorter; the runtime is
  told the time left as well.
- A try fails by the replica's fault when the replica is unreachable or its
  stream broke (UNAVAILABLE), when it raises INTERNAL, or when the per-try
  timeout (not the request's deadline) expires. Such failures count towards
  outlier ejection; unreachable replicas are also marked down until their next
  heartbeat.
- UNAVAILABLE and per-try timeouts are retried on a replica not tried yet, at
  most ``max_retries`` times per batch and only while the retry budget allows.
  Other errors (the model rejected the batch, the deadline passed) are final.
- A batch whose deadline passes while it runs is not cut short: the runtime
  goes on computing it anyway, so the scheduler waits for it (within the
  per-try timeout) to learn what it cost. Its requests' waiters answer at
  their deadline (aiworks.scheduler.batcher); no retry starts after it.
- What the batch cost is added to a :class:`Charge`: the runtime's compute
  time of a try that answered, the wall time of a try that timed out or that
  the model refused (the replica worked on it until then), nothing for a
  replica that could not be reached.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiworks.core import metrics
from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, DeadlineExceeded, Status, Unavailable
from aiworks.scheduler.qos import Priority
from aiworks.scheduler.registry import Key, Replica
from aiworks.scheduler.retry_state import RetryBudget
from aiworks.scheduler.router import Router

log = logging.getLogger(__name__)

# (replica, model, version, inputs, outputs, timeout_s) -> (outputs, the runtime's compute time in ns)
Runner = Callable[[Replica, str, str, list[Tensor], list[str], float], Awaitable[tuple[list[Tensor], int]]]

_REPLICA_FAULTS = (Status.UNAVAILABLE, Status.INTERNAL)


@dataclass(slots=True, eq=False)
class Charge:
    """Runtime time spent on behalf of something (a batch, or one request's share of its batches)."""

    compute_ns: int = 0

    @property
    def compute_us(self) -> int:
        return self.compute_ns // 1000


class BatchSender:
    """Runs batches on replicas through the router, within the retry budget."""

    def __init__(
        self,
        router: Router,
        runner: Runner,
        budget: RetryBudget,
        *,
        max_retries: int,
        per_try_timeout_s: float,
        clock: Callable[[], float],
    ):
        self.router = router
        self._runner = runner
        self.budget = budget
        self.max_retries = max_retries
        self.per_try_timeout_s = per_try_timeout_s
        self._clock = clock
        self.retries: dict[Key, int] = {}

    async def send(
        self,
        key: Key,
        replica: Replica,
        rows: int,
        inputs: list[Tensor],
        outputs: list[str],
        *,
        priority: Priority,
        deadline_s: float | None,
        charge: Charge | None = None,
    ) -> list[Tensor]:
        """Run the batch, starting on ``replica`` (already reserved for ``rows``); always releases it.

        What every try cost is added to ``charge``, whether the batch succeeds or not.
        """
        charge = charge if charge is not None else Charge()
        tried: set[str] = set()
        attempt = 0
        holds_retry = False
        self.budget.begin()
        try:
            while True:
                try:
                    return await self._try(key, replica, rows, inputs, outputs, deadline_s, charge)
                except _Retryable as failed:
                    error = failed.error
                finally:
                    if holds_retry:
                        self.budget.retry_done()
                        holds_retry = False
                tried.add(replica.replica_id)
                await self.router.release(replica, key, rows)
                replica = None
                if attempt >= self.max_retries:
                    raise error
                if not self.budget.try_retry():
                    raise Unavailable(f"{error.message} (not retried: the retry budget is spent)")
                holds_retry = True
                log.warning("batch of %d rows for %s/%s failed (%s); retrying", rows, *key, error.message)
                self.retries[key] = self.retries.get(key, 0) + 1
                metrics.SCHEDULER_RETRIES.labels(*key).inc()
                attempt += 1
                replica = await self.router.acquire(key, priority, exclude=tried)
                self.router.add_rows(replica, rows)
        finally:
            if holds_retry:
                self.budget.retry_done()
            self.budget.end()
            if replica is not None:
                await self.router.release(replica, key, rows)

    async def _try(self, key, replica, rows, inputs, outputs, deadline_s, charge: Charge) -> list[Tensor]:
        timeout_s = told_s = self.per_try_timeout_s
        if deadline_s is not None:
            remaining = deadline_s - self._clock()
            if remaining <= 0:
                raise DeadlineExceeded("the deadline passed before the batch reached a replica")
            told_s = min(told_s, remaining)  # the runtime is told the time left...
        started = self._clock()
        try:
            async with asyncio.timeout(timeout_s):  # ...but a running try is bounded by the per-try timeout only
                result, compute_ns = await self._runner(replica, key[0], key[1], inputs, outputs, told_s)
        except TimeoutError:
            charge.compute_ns += int((self._clock() - started) * 1e9)
            exc = DeadlineExceeded(
                f"replica {replica.replica_id} did not answer within the per-try timeout of {timeout_s:g} s"
            )
            self.router.failed(replica, exc, key, self._clock() - started)
            raise _Retryable(exc) from None
        except AIWorksError as exc:
            if exc.status in _REPLICA_FAULTS:
                self.router.failed(replica, exc)
            if exc.status is Status.UNAVAILABLE:
                raise _Retryable(exc) from None
            charge.compute_ns += int((self._clock() - started) * 1e9)
            raise
        charge.compute_ns += compute_ns
        self.router.succeeded(replica, key, self._clock() - started, rows)
        return result


class _Retryable(Exception):
    """A try failed in a way another replica may not: carries the error to give if no retry happens."""

    def __init__(self, error: AIWorksError):
        super().__init__(error.message)
        self.error = error
