"""The retry budget: how many batches may be re-sent at once (Envoy's ``retry_budget``).

A fixed retry count per batch multiplies load exactly when replicas are
failing. Envoy bounds retries instead by a budget: concurrent retries may not
exceed ``budget_percent`` of the requests active at the time, but
``min_concurrency`` retries are always allowed so that a quiet system can
still retry. Here the active requests are the batches being sent, and each
retry attempt holds one unit of the budget while it runs. The per-batch cap
(``max_retries``, Envoy's ``num_retries``) still applies on top.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RetryBudget:
    """Counts active batches and active retries; decides whether one more retry may start."""

    budget_percent: float = 20.0
    min_concurrency: int = 3
    active: int = 0
    active_retries: int = 0
    allowed: int = 0
    denied: int = 0

    def limit(self) -> int:
        return max(self.min_concurrency, int(self.active * self.budget_percent / 100))

    def begin(self) -> None:
        """A batch starts being sent."""
        self.active += 1

    def end(self) -> None:
        self.active -= 1

    def try_retry(self) -> bool:
        """Start a retry if the budget has room; release it with :meth:`retry_done`."""
        if self.active_retries >= self.limit():
            self.denied += 1
            return False
        self.active_retries += 1
        self.allowed += 1
        return True

    def retry_done(self) -> None:
        self.active_retries -= 1
