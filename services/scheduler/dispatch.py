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
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from aiworks.core import metrics
from aiworks.core.datatypes import Tensor
from aiworks.core.errors import AIWorksError, DeadlineExceeded, Status, Unavailable
from aiworks.scheduler.qos import Priority
from aiworks.scheduler.registry import Key, Replica
from aiworks.scheduler.retry_state import RetryBudget
from aiworks.scheduler.router import Router

log = logging.getLogger(__name__)

# (replica, model, version, inputs, outputs, timeout_s) -> outputs
Runner = Callable[[Replica, str, str, list[Tensor], list[str], float], Awaitable[list[Tensor]]]

_REPLICA_FAULTS = (Status.UNAVAILABLE, Status.INTERNAL)


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
    ) -> list[Tensor]:
        """Run the batch, starting on ``replica`` (already reserved for ``rows``); always releases it."""
        tried: set[str] = set()
        attempt = 0
        holds_retry = False
        self.budget.begin()
        try:
            while True:
                try:
                    return await self._try(key, replica, rows, inputs, outputs, deadline_s)
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

    async def _try(self, key, replica, rows, inputs, outputs, deadline_s) -> list[Tensor]:
        timeout_s = self.per_try_timeout_s
        per_try_binds = True
        if deadline_s is not None:
            remaining = deadline_s - self._clock()
            if remaining <= 0:
                raise DeadlineExceeded("the deadline passed before the batch reached a replica")
            if remaining < timeout_s:
                timeout_s, per_try_binds = remaining, False
        started = self._clock()
        try:
            async with asyncio.timeout(timeout_s):
                result = await self._runner(replica, key[0], key[1], inputs, outputs, timeout_s)
        except TimeoutError:
            if not per_try_binds:
                raise DeadlineExceeded("the deadline passed while the batch ran") from None
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
            raise
        self.router.succeeded(replica, key, self._clock() - started, rows)
        return result


class _Retryable(Exception):
    """A try failed in a way another replica may not: carries the error to give if no retry happens."""

    def __init__(self, error: AIWorksError):
        super().__init__(error.message)
        self.error = error
