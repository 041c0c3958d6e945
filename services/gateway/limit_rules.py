"""The limits' rules in one process: what a 429 says, what an admission holds, and the in-process
counters (:class:`LocalLimits`) a gateway uses without Redis, or while Redis is unreachable, each limit divided
by the expected replica count. :mod:`aiworks.gateway.limits` applies the same rules across replicas through
Redis and falls back to these (its docstring has the rules)."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from aiworks.core.errors import ResourceExhausted
from aiworks.gateway.tenancy import Tenant

CONCURRENCY_RETRY_AFTER_S = 1.0


def resource_exhausted(message: str, retry_after_s: float | None) -> ResourceExhausted:
    return ResourceExhausted(message, retry_after_s=retry_after_s)


def rate_message(tenant: Tenant, retry_after_s: float, note: str) -> str:
    return (
        f"tenant '{tenant.id}' exceeded its rate limit of {tenant.requests_per_second:g} requests/s "
        f"(burst {tenant.bucket_size}){note}; retry after {retry_after_s:.2f} s"
    )


def concurrency_message(tenant: Tenant, active: int, note: str) -> str:
    return (
        f"tenant '{tenant.id}' has {active} requests in flight, its limit of "
        f"{tenant.max_concurrent_requests} concurrent requests{note}"
    )


def quota_message(tenant: Tenant, used: float, reset_s: float, note: str) -> str:
    quota = tenant.compute_quota
    return (
        f"tenant '{tenant.id}' used its compute quota of {quota.seconds:g} runtime-seconds per "
        f"{quota.window_s:g} s window ({used:.3f} s used){note}; it resets in {reset_s:.1f} s"
    )


# What a reserve is made of, by kind, in the 429's words.
RESERVES = {
    "generation": "this generation reserves {n} tokens (prompt and max_tokens)",
    "text": "this request reserves {n} tokens (an estimate of its input text's)",
}


def tokens_message(tenant: Tenant, reserve: int, left: float, retry_after_s: float, note: str,
                    kind: str = "generation") -> str:  # fmt: skip
    return (
        f"tenant '{tenant.id}' exceeded its limit of {tenant.max_tokens_per_minute} tokens per minute "
        f"(rule max_tokens_per_minute): {RESERVES[kind].format(n=reserve)} and "
        f"{max(0, math.floor(left))} are left{note}; retry after {retry_after_s:.2f} s"
    )


@dataclass(slots=True, eq=False)
class Admission:
    """A request let in: hand it back to :meth:`TenantLimiter.release` exactly once."""

    tenant: Tenant
    backend: str  # "none" (unlimited tenant), "redis" or "local"
    lease: str = ""
    compute_s: float = 0.0  # set by the caller before leaving :meth:`TenantLimiter.hold`
    released: bool = False
    reserved_tokens: int = 0  # taken from the tokens-per-minute bucket at admission
    used_tokens: int | None = None  # set by the caller before release: the reserve is settled to it

    @property
    def token_refund(self) -> int:
        """Tokens to give back at release (below 0: to take): the reserve less what was used."""
        if not self.reserved_tokens or self.used_tokens is None or not self.tenant.max_tokens_per_minute:
            return 0
        return self.reserved_tokens - max(0, self.used_tokens)


# ---- in-process limits (no Redis, or Redis unreachable) --------------------------------------------------


@dataclass(slots=True)
class _LocalState:
    tokens: float = -1.0
    refilled: float = 0.0
    active: int = 0
    window: int = -1
    used: float = 0.0
    gen_left: float | None = None  # tokens-per-minute bucket
    gen_refilled: float = 0.0


class LocalLimits:
    """The same three limits in this process, each divided by ``share`` (the expected replica count)."""

    def __init__(
        self,
        share: int = 1,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ):
        self.share = max(1, share)
        self._clock = clock
        self._wall = wall_clock
        self._states: dict[str, _LocalState] = defaultdict(_LocalState)

    def _note(self) -> str:
        return f" (this replica's 1/{self.share} share while Redis is unreachable)" if self.share > 1 else ""

    def _window(self, tenant: Tenant, state: _LocalState) -> tuple[int, float]:
        window_s = tenant.compute_quota.window_s
        now = self._wall()
        window = int(now // window_s)
        if state.window != window:
            state.window, state.used = window, 0.0
        return window, (window + 1) * window_s - now

    def _gen_refill(self, tenant: Tenant, state: _LocalState) -> float:
        """The tokens-per-minute bucket (this replica's share) refilled to now."""
        size = tenant.max_tokens_per_minute / self.share
        now = self._clock()
        if state.gen_left is None:
            state.gen_left, state.gen_refilled = size, now
        state.gen_left = min(size, state.gen_left + (now - state.gen_refilled) * size / 60)
        state.gen_refilled = now
        return size

    def admit(self, tenant: Tenant, reserve: int = 0, kind: str = "generation") -> Admission:
        state = self._states[tenant.id]
        if tenant.compute_quota is not None:
            _, reset_s = self._window(tenant, state)
            if state.used >= tenant.compute_quota.seconds / self.share:
                raise resource_exhausted(quota_message(tenant, state.used, reset_s, self._note()), reset_s)
        if tenant.max_concurrent_requests is not None:
            limit = max(1, math.ceil(tenant.max_concurrent_requests / self.share))
            if state.active >= limit:
                raise resource_exhausted(
                    concurrency_message(tenant, state.active, self._note()), CONCURRENCY_RETRY_AFTER_S
                )
        if tenant.requests_per_second is not None:
            rate = tenant.requests_per_second / self.share
            burst = max(1.0, tenant.bucket_size / self.share)
            now = self._clock()
            if state.tokens < 0:
                state.tokens, state.refilled = burst, now
            state.tokens = min(burst, state.tokens + (now - state.refilled) * rate)
            state.refilled = now
            if state.tokens < 1:
                retry = (1 - state.tokens) / rate
                raise resource_exhausted(rate_message(tenant, retry, self._note()), retry)
        if tenant.max_tokens_per_minute is not None and reserve > 0:
            size = self._gen_refill(tenant, state)
            need = min(reserve, size)
            if state.gen_left < need:
                retry = (need - state.gen_left) * 60 / size
                message = tokens_message(tenant, reserve, state.gen_left, retry, self._note(), kind)
                raise resource_exhausted(message, retry)
            state.gen_left -= reserve
        if tenant.requests_per_second is not None:
            state.tokens -= 1
        if tenant.max_concurrent_requests is not None:
            state.active += 1
        return Admission(tenant, "local", reserved_tokens=reserve if tenant.max_tokens_per_minute else 0)

    def release(self, admission: Admission, compute_s: float) -> None:
        tenant = admission.tenant
        state = self._states[tenant.id]
        if tenant.max_concurrent_requests is not None and state.active > 0:
            state.active -= 1
        self.charge(tenant, compute_s)
        self.settle_tokens(tenant, admission.token_refund)

    def settle_tokens(self, tenant: Tenant, refund: int) -> None:
        """Give ``refund`` tokens back to the tokens-per-minute bucket (below 0: take them)."""
        if tenant.max_tokens_per_minute is not None and refund:
            state = self._states[tenant.id]
            size = self._gen_refill(tenant, state)
            state.gen_left = min(size, state.gen_left + refund)

    def charge(self, tenant: Tenant, compute_s: float) -> None:
        if tenant.compute_quota is not None and compute_s > 0:
            state = self._states[tenant.id]
            self._window(tenant, state)
            state.used += compute_s


# ---- the limiter ---------------------------------------------------------------------------------------
