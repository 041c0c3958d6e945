"""Usage metering per tenant and model: requests, rows, compute seconds, cache hits and generated tokens.

Recording is a few dict additions and Prometheus increments, with no I/O on
the request path. A background task sends what accumulated to Redis every
``flush_interval_s`` as one MULTI/EXEC pipeline, so usage from every gateway
replica adds up in one place. Usage is bucketed in windows of ``window_s``
(aligned to multiples of it since the epoch), one Redis hash per window::

    <prefix><window start, epoch seconds>   field "<tenant>|<model>|<counter>"  (kept retention_s)

Tenant ids and model names cannot contain ``|`` (see ``tenancy.py`` and
``model_config.py``), so fields split back unambiguously.

When Redis is unreachable the deltas stay in memory and go with the next
flush that succeeds (logged once each way); a flush that times out after
Redis applied it may count its deltas twice, so an outage errs towards
billing a little more, never less. Without Redis (the embedded default) the
meter is this process's alone.

:meth:`UsageMeter.report` answers the ``aiworks usage`` command and the
gateway's usage endpoint: a billing-friendly list of (tenant, model, window)
rows plus per tenant and model totals. It flushes first, so it includes
everything this replica recorded.

Prometheus counters (declared in :mod:`aiworks.core.metrics`; ``tenant`` is
``""`` in demo mode): ``aiworks_tenant_requests_total``, ``aiworks_tenant_rows_total``,
``aiworks_tenant_compute_seconds_total``, ``aiworks_tenant_cache_hits_total``,
``aiworks_tenant_tokens_total`` (label ``kind``: ``prompt`` or ``completion``).

Generations (the ``llm`` backend, on every front end: the OpenAI routes,
generate and generate_stream, gRPC ModelStreamInfer) also count their
``prompt_tokens`` and ``completion_tokens`` as the model counted them;
``/v1/embeddings`` counts its input tokens as ``prompt_tokens``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime

import redis.asyncio as redis
from redis.exceptions import RedisError

from aiworks.core import metrics
from aiworks.core.errors import InvalidArgument
from aiworks.core.redis_client import fail_fast_redis

log = logging.getLogger(__name__)

COUNTERS = ("requests", "rows", "compute_seconds", "cache_hits", "prompt_tokens", "completion_tokens")
MAX_REPORT_WINDOWS = 10_000


DEFAULT_USAGE_SPAN_S = 86400.0  # a report without a start covers the last day


def _iso(epoch_s: float) -> str:
    return datetime.fromtimestamp(epoch_s, UTC).isoformat().replace("+00:00", "Z")


# The times a report can name: from the epoch (before it there is no usage) to the year 9000, leaving the
# report's windows room below datetime's year 9999.
MAX_EPOCH_S = 221845392000.0  # 9000-01-01T00:00:00Z


def parse_time(text: str, name: str = "time") -> float:
    """Epoch seconds from epoch seconds or ISO 8601 (``2026-01-01T00:00:00Z``; no zone means UTC)."""
    value = text.strip()
    try:
        epoch = float(value)
    except ValueError:
        pass
    else:
        if not math.isfinite(epoch) or not 0 <= epoch <= MAX_EPOCH_S:
            raise InvalidArgument(f"'{name}' is {value[:40]!r}: not a time between 1970 and 9000 (epoch seconds)")
        return epoch
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidArgument(
            f"'{name}' is {value[:40]!r}: use epoch seconds or ISO 8601, e.g. 2026-01-01T00:00:00Z"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    epoch = when.timestamp()
    if not 0 <= epoch <= MAX_EPOCH_S:
        raise InvalidArgument(f"'{name}' is {value[:40]!r}: not a time between 1970 and 9000")
    return epoch


@dataclass(slots=True)
class UsageRecord:
    """Usage of one tenant on one model in one window (``window_end`` exclusive), or a total over the report."""

    tenant: str
    model: str
    window_start: float
    window_end: float
    requests: int = 0
    rows: int = 0
    compute_seconds: float = 0.0
    cache_hits: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, requests: int, rows: int, compute_seconds: float, cache_hits: int, prompt_tokens: int = 0,
            completion_tokens: int = 0) -> None:  # fmt: skip
        self.requests += requests
        self.rows += rows
        self.compute_seconds += compute_seconds
        self.cache_hits += cache_hits
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    def to_dict(self) -> dict:
        out = asdict(self)
        out["window_start"] = _iso(self.window_start)
        out["window_end"] = _iso(self.window_end)
        out["compute_seconds"] = round(self.compute_seconds, 6)
        return out


@dataclass(slots=True)
class UsageReport:
    """Usage between ``start`` and ``end``, in whole windows. ``source`` says where it was read:
    ``redis`` (all replicas) or ``local`` (this replica only: no Redis configured, or unreachable)."""

    start: float
    end: float
    window_s: float
    source: str
    windows: list[UsageRecord] = field(default_factory=list)
    totals: list[UsageRecord] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {
            "start": _iso(self.start),
            "end": _iso(self.end),
            "window_s": self.window_s,
            "source": self.source,
            "usage": [r.to_dict() for r in self.windows],
            "totals": [r.to_dict() for r in self.totals],
        }


# Deltas per (window start, tenant, model): [requests, rows, compute seconds, cache hits, prompt tokens,
# completion tokens].
_Deltas = dict[tuple[int, str, str], list]


def _merge(into: _Deltas, deltas: _Deltas) -> None:
    for key, values in deltas.items():
        acc = into.get(key)
        if acc is None:
            into[key] = list(values)
        else:
            for i, v in enumerate(values):
                acc[i] += v


class UsageMeter:
    """Records usage per request and reports it per tenant, model and window."""

    def __init__(
        self,
        redis_url: str | None = None,
        *,
        window_s: int = 3600,
        flush_interval_s: float = 0.1,
        timeout_s: float = 0.05,
        retention_s: float = 35 * 86400,
        prefix: str = "aiworks:usage:v1:",
        clock: Callable[[], float] = time.time,
    ):
        if window_s < 1:
            raise InvalidArgument(f"usage window must be at least 1 s, not {window_s}")
        self.window_s = int(window_s)
        self.flush_interval_s = flush_interval_s
        self.timeout_s = timeout_s
        self.retention_s = retention_s
        self.prefix = prefix
        self._clock = clock
        # Label children cached by (tenant, model): tenants come from the config, models are served ones.
        self._requests = metrics.Children(metrics.TENANT_REQUESTS)
        self._rows = metrics.Children(metrics.TENANT_ROWS)
        self._compute = metrics.Children(metrics.TENANT_COMPUTE_SECONDS)
        self._hits = metrics.Children(metrics.TENANT_CACHE_HITS)
        self._tokens = metrics.Children(metrics.TENANT_TOKENS)
        self._pending: _Deltas = {}
        self._local: _Deltas = {}  # this replica's totals: the report when Redis is absent or away
        self._failing = False
        self._flusher: asyncio.Task | None = None
        self._flush_lock = asyncio.Lock()
        self._redis: redis.Redis | None = None
        if redis_url:
            self._redis = fail_fast_redis(
                redis_url, max_connections=4, timeout_s=max(timeout_s, 0.5), decode_responses=True
            )

    def record(
        self,
        tenant: str,
        model: str,
        *,
        rows: int = 1,
        compute_s: float = 0.0,
        cache_hit: bool = False,
        requests: int = 1,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
    ) -> None:
        """Count one answered request (``requests=0, rows=0``: only the compute of one that failed). No I/O.

        ``prompt_tokens`` and ``completion_tokens``: a generation's (or an embedding's input) tokens.
        """
        window = int(self._clock() // self.window_s) * self.window_s
        key = (window, tenant, model)
        prompt_tokens, completion_tokens = max(0, int(prompt_tokens)), max(0, int(completion_tokens))
        values = (requests, rows, max(0.0, compute_s), int(cache_hit), prompt_tokens, completion_tokens)
        for table in (self._pending, self._local):
            acc = table.get(key)
            if acc is None:
                table[key] = list(values)
            else:
                for i, v in enumerate(values):
                    acc[i] += v
        if requests:
            self._requests(tenant, model).inc(requests)
            self._rows(tenant, model).inc(rows)
        if compute_s > 0:
            self._compute(tenant, model).inc(compute_s)
        if cache_hit:
            self._hits(tenant, model).inc()
        if prompt_tokens:
            self._tokens(tenant, model, "prompt").inc(prompt_tokens)
        if completion_tokens:
            self._tokens(tenant, model, "completion").inc(completion_tokens)

    # ---- flushing ----------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._redis is not None and self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_loop())

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
            await asyncio.gather(self._flusher, return_exceptions=True)
            self._flusher = None
        if self._redis is not None:
            await self.flush()
            await self._redis.aclose()
            await self._redis.connection_pool.disconnect()

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.flush_interval_s)
            await self.flush()

    async def flush(self) -> bool:
        """Send pending usage to Redis; False (deltas kept for the next try) when it fails."""
        if self._redis is None:
            return True
        async with self._flush_lock:
            self._prune()
            if not self._pending:
                return True
            batch, self._pending = self._pending, {}
            ttl = int(self.retention_s)
            try:
                async with asyncio.timeout(self.timeout_s):
                    async with self._redis.pipeline(transaction=True) as pipe:
                        windows = set()
                        for (window, tenant, model), (requests, rows, compute, hits, ptok, ctok) in batch.items():
                            key = f"{self.prefix}{window}"
                            base = f"{tenant}|{model}|"
                            pipe.hincrby(key, base + "requests", requests)
                            pipe.hincrby(key, base + "rows", rows)
                            if compute:
                                pipe.hincrbyfloat(key, base + "compute_seconds", compute)
                            if hits:
                                pipe.hincrby(key, base + "cache_hits", hits)
                            if ptok:
                                pipe.hincrby(key, base + "prompt_tokens", ptok)
                            if ctok:
                                pipe.hincrby(key, base + "completion_tokens", ctok)
                            windows.add(key)
                        for key in windows:
                            pipe.expire(key, ttl)
                        await pipe.execute()
            except (RedisError, OSError, TimeoutError) as exc:
                _merge(self._pending, batch)
                if not self._failing:
                    self._failing = True
                    log.warning("metering: Redis unreachable (%s); usage is kept in memory until it answers", exc)
                return False
            if self._failing:
                self._failing = False
                log.warning("metering: Redis answers again; pending usage sent")
            return True

    def _prune(self) -> None:
        oldest = self._clock() - self.retention_s
        for table in (self._local, self._pending):
            for key in [k for k in table if k[0] + self.window_s < oldest]:
                del table[key]

    # ---- reporting ---------------------------------------------------------------------------------

    def _windows(self, start: float, end: float) -> list[int]:
        if end <= start:
            raise InvalidArgument(f"usage report: end ({_iso(end)}) must be after start ({_iso(start)})")
        first = int(start // self.window_s) * self.window_s
        count = math.ceil((end - first) / self.window_s)
        if count > MAX_REPORT_WINDOWS:
            raise InvalidArgument(
                f"usage report spans {count} windows of {self.window_s} s; at most {MAX_REPORT_WINDOWS} at once"
            )
        return [first + i * self.window_s for i in range(count)]

    async def report(
        self, start: float, end: float | None = None, *, tenant: str | None = None, model: str | None = None
    ) -> UsageReport:
        """Usage in the windows overlapping [``start``, ``end``), optionally of one tenant and/or model."""
        end = self._clock() if end is None else end
        windows = self._windows(start, end)
        rows: _Deltas = {}
        source = "local"
        if self._redis is not None and await self.flush():
            try:
                async with asyncio.timeout(max(self.timeout_s, 1.0)):
                    async with self._redis.pipeline(transaction=False) as pipe:
                        for window in windows:
                            pipe.hgetall(f"{self.prefix}{window}")
                        hashes = await pipe.execute()
            except (RedisError, OSError, TimeoutError) as exc:
                log.warning("metering: usage report reads this replica only: Redis unreachable (%s)", exc)
            else:
                source = "redis"
                for window, fields in zip(windows, hashes):
                    for name, value in fields.items():
                        t, m, counter = name.rsplit("|", 2)
                        if counter not in COUNTERS:
                            continue  # a counter a newer gateway writes
                        acc = rows.setdefault((window, t, m), [0, 0, 0.0, 0, 0, 0])
                        acc[COUNTERS.index(counter)] += float(value) if counter == "compute_seconds" else int(value)
        if source == "local":
            wanted = set(windows)
            _merge(rows, {k: v for k, v in self._local.items() if k[0] in wanted})
        records: list[UsageRecord] = []
        totals: dict[tuple[str, str], UsageRecord] = {}
        for (window, t, m), values in sorted(rows.items()):
            if (tenant is not None and t != tenant) or (model is not None and m != model):
                continue
            records.append(UsageRecord(t, m, window, window + self.window_s, *values))
            total = totals.setdefault((t, m), UsageRecord(t, m, windows[0], windows[-1] + self.window_s))
            total.add(*values)
        return UsageReport(
            start=windows[0],
            end=windows[-1] + self.window_s,
            window_s=self.window_s,
            source=source,
            windows=records,
            totals=[totals[k] for k in sorted(totals)],
        )
