"""Result streams in Redis: names, records, the publisher and the readers (docs/tiers.md, "Result streams").

A tenant's stream ``<name>`` is the Redis Stream ``aiworks:stream:<tenant>:<name>``: the tenant is
part of the key, so no tenant can name another's stream. Each entry has one field, ``r``, the record
as compact JSON: ``{"model", "version", "id", "time", "outputs": [{"name", "datatype", "shape",
"data"}]}`` (``time``: epoch seconds when the gateway answered). Streams are trimmed at every
append (``MAXLEN ~``), so a stream nobody reads never holds much more than ``max_len`` entries.

Publication never waits on Redis: :meth:`Publisher.publish` puts the record on a bounded queue that
one task drains in pipelined batches; a full queue drops the record and counts it. The same task
applies the tenant's rules (:class:`StreamRule`) to each record and appends the events they fire.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass

import orjson
import redis.asyncio as redis
from redis.exceptions import RedisError, ResponseError

from aiworks.core import metrics
from aiworks.core.errors import InvalidArgument, PayloadTooLarge
from aiworks.core.inference import InferResponse

log = logging.getLogger(__name__)

PREFIX = "aiworks:stream:"
FIELD = b"r"
NAME_RULE = "1 to 64 characters of letters, digits, '_', '-' and '.', starting with a letter or digit"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_ENTRY_ID = re.compile(r"[0-9]{1,20}(-[0-9]{1,20})?")
_OPS = {
    ">": lambda a, b: a > b, ">=": lambda a, b: a >= b, "<": lambda a, b: a < b, "<=": lambda a, b: a <= b,
    "==": lambda a, b: a == b, "!=": lambda a, b: a != b,
}  # fmt: skip
OPS = tuple(_OPS)


def check_name(name: object, what: str = "stream name") -> str:
    """``name`` if it is a valid stream (or group, or consumer) name; 400 naming it otherwise."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        shown = name[:64] if isinstance(name, str) else type(name).__name__
        raise InvalidArgument(f"{what} '{shown}' is not valid: names are {NAME_RULE}")
    return name


def is_stream_name(name: object) -> bool:
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def check_entry_id(value: str) -> str:
    """A Redis Stream entry id (``ms`` or ``ms-seq``) a subscriber resumes after; 400 otherwise."""
    if not _ENTRY_ID.fullmatch(value):
        raise InvalidArgument(f"'{value[:64]}' is not a stream entry id (Last-Event-ID, from= or from_id): ms or ms-seq")
    return value


def stream_key(tenant: str, name: str) -> str:
    return f"{PREFIX}{tenant}:{name}"


def _tensor_json(tensor) -> dict:
    array = tensor.to_numpy()
    if tensor.datatype == "BYTES":
        data = [v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v) for v in array.reshape(-1)]
    else:
        data = array.reshape(-1).tolist()
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape), "data": data}


def result_record(response: InferResponse, stream: str, max_bytes: int) -> dict:
    """The record published for ``response``; 413 when its outputs exceed ``max_bytes``.

    The raw size is checked before anything is decoded (a large answer costs
    nothing more), then the JSON size.
    """
    raw = sum(len(t.raw) for t in response.outputs)
    if raw > max_bytes:
        raise PayloadTooLarge(
            f"the outputs ({raw} bytes) are too large to publish to stream '{stream}': at most {max_bytes} bytes"
        )
    return {
        "model": response.model, "version": response.version, "id": response.id, "time": time.time(),
        "outputs": [_tensor_json(t) for t in response.outputs],
    }  # fmt: skip


@dataclass(frozen=True)
class StreamRule:
    """``output[index] op value`` on the records of ``stream``: a match appends an event to ``event_stream``."""

    stream: str
    output: str
    index: int
    op: str
    value: float
    event_stream: str

    def __post_init__(self) -> None:  # also what the tenants file's validation runs
        for what in ("stream", "event_stream"):
            if not _NAME.fullmatch(getattr(self, what)):
                raise ValueError(f"rule {what} '{getattr(self, what)[:64]}' is not valid: names are {NAME_RULE}")
        if self.op not in _OPS:
            raise ValueError(f"rule op '{self.op[:8]}' is not one of {', '.join(OPS)}")
        if self.index < 0:
            raise ValueError(f"rule index {self.index} is negative (it counts the output's elements, row-major)")
        if self.event_stream == self.stream:
            raise ValueError(f"rule on stream '{self.stream}' sends its events to the same stream")

    def match(self, record: dict) -> dict | None:
        """The event this rule fires for ``record``, or None."""
        for out in record["outputs"]:
            if out["name"] == self.output:
                data = out["data"]
                if not 0 <= self.index < len(data) or not isinstance(data[self.index], (int, float)):
                    return None
                seen = data[self.index]
                if not _OPS[self.op](seen, self.value):
                    return None
                return {
                    "rule": f"{self.output}[{self.index}] {self.op} {self.value}", "stream": self.stream,
                    "model": record["model"], "version": record["version"], "id": record["id"],
                    "output": self.output, "index": self.index, "value": seen, "time": record["time"],
                }  # fmt: skip
        return None


@dataclass
class _Pending:
    tenant: str
    name: str
    record: dict
    rules: tuple[StreamRule, ...]


class Publisher:
    """Appends records to tenants' streams from a bounded queue, off the request path."""

    def __init__(self, client: redis.Redis, *, max_len: int = 10_000, queue_size: int = 10_000, batch: int = 256,
                 max_record_bytes: int = 64 * 1024):  # fmt: skip
        self.redis = client
        self.max_record_bytes = max_record_bytes
        self.max_len = max_len
        self.batch = batch
        self.queue: asyncio.Queue[_Pending] = asyncio.Queue(maxsize=queue_size)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="stream-publisher")

    async def close(self) -> None:
        """Append what is queued (a few seconds at most), then stop."""
        if self._task is not None:
            try:
                await asyncio.wait_for(self.queue.join(), 5.0)
            except TimeoutError:
                log.warning("result streams: %d records not published at shutdown", self.queue.qsize())
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def publish(self, tenant: str, name: str, record: dict, rules: tuple[StreamRule, ...] = ()) -> bool:
        """Queue ``record`` for ``tenant``'s stream ``name``; False (counted) when the queue is full."""
        try:
            self.queue.put_nowait(_Pending(tenant, name, record, rules))
        except asyncio.QueueFull:
            metrics.STREAM_PUBLISH_DROPPED.labels("queue_full").inc()
            return False
        return True

    async def _run(self) -> None:
        while True:
            items = [await self.queue.get()]
            while len(items) < self.batch and not self.queue.empty():
                items.append(self.queue.get_nowait())
            try:
                await self._append(items)
            except (RedisError, OSError) as exc:
                metrics.STREAM_PUBLISH_DROPPED.labels("redis_error").inc(len(items))
                log.warning("result streams: %d records lost, Redis failed: %s", len(items), exc)
                await asyncio.sleep(0.1)
            except Exception:  # noqa: BLE001 - the publisher must outlive one bad batch
                metrics.STREAM_PUBLISH_DROPPED.labels("error").inc(len(items))
                log.exception("result streams: %d records lost", len(items))
            finally:
                for _ in items:
                    self.queue.task_done()

    async def _append(self, items: list[_Pending]) -> None:
        events = 0
        async with self.redis.pipeline(transaction=False) as pipe:
            for item in items:
                pipe.xadd(stream_key(item.tenant, item.name), {FIELD: orjson.dumps(item.record)},
                          maxlen=self.max_len, approximate=True)  # fmt: skip
                for rule in item.rules:
                    if rule.stream == item.name and (event := rule.match(item.record)) is not None:
                        pipe.xadd(stream_key(item.tenant, rule.event_stream), {FIELD: orjson.dumps(event)},
                                  maxlen=self.max_len, approximate=True)  # fmt: skip
                        events += 1
            await pipe.execute()
        metrics.STREAM_PUBLISHED.inc(len(items))
        if events:
            metrics.STREAM_RULE_EVENTS.inc(events)


class Reader:
    """What subscribers read: entries after an id, or through a consumer group (blocking reads)."""

    def __init__(self, client: redis.Redis, *, claim_idle_s: float = 30.0):
        self.redis = client
        self.claim_idle_s = claim_idle_s
        # The gap checks read XINFO STREAM and the entries at one instant: a script each (Redis >= 7.0
        # for the counts they compare; on an older one they never find a gap).
        self._after_checked = client.register_script(_AFTER_CHECKED) if client is not None else None
        self._group_position = client.register_script(_GROUP_POSITION) if client is not None else None

    async def exists(self, key: str) -> bool:
        return bool(await self.redis.exists(key))

    async def after(self, key: str, last_id: str, count: int, block_ms: int) -> list[tuple[str, bytes]]:
        """Up to ``count`` entries after ``last_id`` (``$``: only new ones), waiting up to ``block_ms``."""
        reply = await self.redis.xread({key: last_id}, count=count, block=block_ms)
        return [(entry.decode(), fields.get(FIELD, b"null")) for _, entries in reply or [] for entry, fields in entries]

    async def after_checked(self, key: str, last_id: str, count: int) -> tuple[str | None, list[tuple[str, bytes]]]:
        """What :meth:`after` reads (without waiting) and, seen at the same instant (one script), whether
        entries after ``last_id`` were trimmed before they were read: the first kept id if so, else None."""
        try:
            ids, entries = await self._after_checked(keys=[key], args=[last_id, count])
        except ResponseError:  # the stream is gone (XINFO on no key): nothing to read, no gap to tell
            return None, []
        found = [(entry.decode(), dict(_pairs(fields)).get(FIELD, b"null")) for entry, fields in entries]
        return _trimmed_after(ids, last_id), found

    async def group_gap(self, key: str, group: str) -> dict | None:
        """``{"after", "first"}`` when entries after ``group``'s position were trimmed before it read them."""
        try:
            found = await self._group_position(keys=[key], args=[group])
        except ResponseError:
            return None
        if not found:
            return None
        ids, position = found
        first_kept = _trimmed_after(ids, _text(position))
        return None if first_kept is None else {"after": _text(position), "first": first_kept}

    async def last_id(self, key: str) -> str:
        """The id of the stream's newest entry (``0-0`` when empty): where ``$`` stands now."""
        newest = await self.redis.xrevrange(key, count=1)
        return newest[0][0].decode() if newest else "0-0"

    async def join(self, key: str, group: str, start: str) -> None:
        """Create ``group`` on ``key`` at ``start`` unless it exists."""
        try:
            await self.redis.xgroup_create(key, group, id=start)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def take(self, key: str, group: str, consumer: str, count: int, block_ms: int) -> list[tuple[str, bytes]]:
        """Entries for ``consumer``: first those another left unacknowledged ``claim_idle_s``, then new ones."""
        _, claimed, *_ = await self.redis.xautoclaim(
            key, group, consumer, min_idle_time=int(self.claim_idle_s * 1000), start_id="0-0", count=count
        )
        taken = [(e, f) for e, f in claimed if f]
        if not taken:
            reply = await self.redis.xreadgroup(group, consumer, {key: ">"}, count=count, block=block_ms)
            taken = [(e, f) for _, entries in reply or [] for e, f in entries]
        return [(e.decode(), f.get(FIELD, b"null")) for e, f in taken]

    async def ack(self, key: str, group: str, ids: list[str]) -> None:
        if ids:
            await self.redis.xack(key, group, *ids)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _pairs(flat: list) -> list[tuple]:
    return list(zip(flat[::2], flat[1::2], strict=True))


def _trimmed_after(ids: list, position: str) -> str | None:
    """The stream's first kept id when entries after ``position`` were removed before they were read.

    ``ids``: what the scripts below return first, ``[first, removed, max_deleted]``. Trimming
    removes the oldest entries (and does not move XINFO's ``max-deleted-entry-id`` in Redis 7.0;
    XDEL does), so entries were lost after ``position`` when some were ever removed and the first
    kept one is after ``position`` (or when a deleted entry is). A position that is exactly the
    last entry trimmed cannot be told apart from an older one: it gets a gap event too.
    """
    first, removed, deleted = _text(ids[0]) if ids[0] else None, int(ids[1]), _text(ids[2]) if ids[2] else "0-0"
    at = _id_key(position)
    if (removed and first is not None and at < _id_key(first)) or at < _id_key(deleted):
        return first or deleted
    return None


# The stream's first kept id, how many entries were ever removed, its max-deleted-entry-id.
_POSITION_FACTS = """
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local facts = {}
for i = 1, #info, 2 do facts[info[i]] = info[i + 1] end
local first = facts['first-entry'] and facts['first-entry'][1] or facts['last-generated-id']
local ids = {first, (facts['entries-added'] or facts['length']) - facts['length'], facts['max-deleted-entry-id'] or '0-0'}
"""

# Those facts, and up to ARGV[2] entries after ARGV[1], at one instant.
_AFTER_CHECKED = _POSITION_FACTS + """
return {ids, redis.call('XRANGE', KEYS[1], '(' .. ARGV[1], '+', 'COUNT', ARGV[2])}
"""

# Those facts, and the last-delivered-id of the group ARGV[1] (nil without that group).
_GROUP_POSITION = _POSITION_FACTS + """
for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
  local fields = {}
  for i = 1, #group, 2 do fields[group[i]] = group[i + 1] end
  if fields['name'] == ARGV[1] then return {ids, fields['last-delivered-id']} end
end
return false
"""
