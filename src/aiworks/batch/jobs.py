"""Batch jobs and their checkpoints in Redis: the one place a job's state lives.

Keys (prefix ``aiworks:batch:``):

- ``job:{id}``: hash, the job (:class:`Job`);
- ``chunks:{id}``: hash, ``o:{i}``: where finished chunk ``i``'s output and error lines are, a part name
  (:func:`part_name`; the lines themselves are in the job's storage, next to its output file, so a job of
  millions of lines holds Redis to a few bytes a chunk);
- ``lease:{id}``: which runner holds the job, with a TTL the runner renews;
- ``secret:{id}``: the job's work token (:mod:`aiworks.security.work_tokens`), sent with its requests,
  sealed under the installation's credential key (:mod:`aiworks.security.sealing`) where the store has one;
  deleted when the job ends;
- ``ended`` and ``ended:until``: sorted sets of ended jobs, by when each ended and by when its work token
  expires; gateways read the first to refuse those tokens (:meth:`JobStore.ended_since`), and a job leaves
  both once its token would have expired anyway;
- ``sweep``: set of ended jobs whose parts may still be in storage (a runner that dies right after ending a
  job leaves them; an idle runner removes them);
- ``active``: set of jobs not yet ended (``tenant:{t}:active``: a tenant's); ``tenant:{t}:jobs``: a tenant's
  jobs by creation time;
- ``file:{id}`` and ``tenant:{t}:files``: files of the Batch API (:class:`FileRecord`);
- ``turns``: hash, tenant -> when a runner last took one of its jobs: a runner takes the waiting job whose
  tenant had a turn least recently (:meth:`JobStore.took_turn`; the job's own ``turn_at`` breaks ties).

A chunk is recorded at most once, and only by the runner holding the lease
(a Lua script checks both), so a runner that lost its lease, or a chunk run
again after a crash, never counts a line twice.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import asdict, dataclass, field, fields

import orjson
import redis.asyncio as redis

from aiworks.security.sealing import Sealer, seal, unseal

PREFIX = "aiworks:batch:"
TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})
TOKEN_GRACE_S = 900  # a job's work token lives its completion window and this: a quarter hour for its last chunk
CANCELLABLE = ("validating", "in_progress")

_RECORD = """
if redis.call('GET', KEYS[3]) ~= ARGV[1] then return -1 end
if redis.call('HEXISTS', KEYS[2], 'o:' .. ARGV[2]) == 1 then return 0 end
redis.call('HSET', KEYS[2], 'o:' .. ARGV[2], ARGV[3])
redis.call('HINCRBY', KEYS[1], 'completed', ARGV[4])
redis.call('HINCRBY', KEYS[1], 'failed', ARGV[5])
redis.call('HINCRBY', KEYS[1], 'chunks_done', 1)
return 1
"""
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_PRUNE_ENDED = """
local gone = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, 1000)
if #gone > 0 then
  redis.call('ZREM', KEYS[1], unpack(gone))
  redis.call('ZREM', KEYS[2], unpack(gone))
end
return #gone
"""
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if status == 'validating' or status == 'in_progress' then
  redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[1])
  return 'cancelling'
end
return status or ''
"""


_JSON_FIELDS = ("metadata", "input_columns")


_PART = re.compile(r"\d{8}\.[^/]+\.o?e?")  # a part's name (an inline chunk's lines are JSON lines, or empty)


def part_name(index: int, runner: str, has_output: bool, has_errors: bool) -> str:
    """A recorded chunk's part: its index and the runner that wrote it (a runner that lost its lease may
    still write the same chunk; only the recorded runner's files are read), and which of its two files
    exist (``o`` output lines, ``e`` error lines; an empty one is not written)."""
    return f"{index:08d}.{runner}.{'o' if has_output else ''}{'e' if has_errors else ''}"


def new_id(kind: str) -> str:
    """A new id, spelt as OpenAI's are: ``file-…`` for files, ``batch_…`` for jobs (clients treat them as opaque;
    files uploaded before this spelling keep their ``file_…`` ids)."""
    return f"{kind}{'-' if kind == 'file' else '_'}{secrets.token_hex(12)}"


@dataclass
class Job:
    """One batch job; the field names and statuses are OpenAI's Batch object's where they exist."""

    id: str
    tenant: str
    model: str
    input_url: str
    output_url: str
    error_url: str
    version: str = ""
    chunk_size: int = 100
    status: str = "validating"
    completion_window: str = "24h"
    input_file_id: str = ""
    output_file_id: str = ""
    error_file_id: str = ""
    metadata: dict = field(default_factory=dict)
    format: str = "jsonl"  # of the input and output files; the error file is always JSONL
    input_columns: dict = field(default_factory=dict)  # Parquet: input name -> column names (aiworks.batch.tables)
    total: int = 0
    completed: int = 0
    failed: int = 0
    chunks_total: int = 0
    chunks_done: int = 0
    error: str = ""
    created_at: float = 0.0
    in_progress_at: float = 0.0
    finalizing_at: float = 0.0
    completed_at: float = 0.0
    failed_at: float = 0.0
    cancelling_at: float = 0.0
    cancelled_at: float = 0.0
    expired_at: float = 0.0
    turn_at: float = 0.0  # when a runner last took it (Unix time; 0: never): turns go to the least recent

    @property
    def infer_path(self) -> str:
        version = f"/versions/{self.version}" if self.version else ""
        return f"/v2/models/{self.model}{version}/infer"

    @property
    def expires_at(self) -> float:
        """The end of the job's completion window (Unix time): OpenAI's ``expires_at``."""
        return self.created_at + window_seconds(self.completion_window)

    def to_hash(self) -> dict[str, str]:
        doc = asdict(self)
        for name in _JSON_FIELDS:
            doc[name] = orjson.dumps(doc[name]).decode()
        return {k: str(v) for k, v in doc.items()}

    @classmethod
    def from_hash(cls, doc: dict[str, str]) -> Job:
        values: dict = {}
        for f in fields(cls):
            if f.name not in doc:
                continue
            raw = doc[f.name]
            if f.name in _JSON_FIELDS:
                values[f.name] = orjson.loads(raw) if raw else {}
            elif f.type == "int":
                values[f.name] = int(raw)
            elif f.type == "float":
                values[f.name] = float(raw)
            else:
                values[f.name] = raw
        return cls(**values)


def window_seconds(window: str) -> int:
    """A completion window (``"24h"``, checked by the Batch API at submission) in seconds."""
    return int(window[:-1]) * 3600


@dataclass
class FileRecord:
    """A file of the Batch API: what a tenant uploaded, or a job's output or error file."""

    id: str
    tenant: str
    filename: str
    purpose: str
    url: str
    bytes: int = 0
    created_at: float = 0.0
    lines: int = -1  # an upload's JSONL lines, counted as it arrived (-1: not known; read the file to count)

    def public(self) -> dict:
        """OpenAI's File object; the storage location stays inside."""
        return {"id": self.id, "object": "file", "bytes": self.bytes, "created_at": int(self.created_at),
                "filename": self.filename, "purpose": self.purpose}  # fmt: skip


class JobStore:
    """Jobs, chunks, leases and files in Redis (``redis.asyncio``, responses decoded)."""

    def __init__(self, client: redis.Redis, prefix: str = PREFIX, *, sealer: Sealer | None = None):
        self.redis = client
        self.prefix = prefix
        self.sealer = sealer  # seals credentials as jobs are created, opens them for the runner
        self._record = client.register_script(_RECORD)
        self._renew = client.register_script(_RENEW)
        self._cancel = client.register_script(_CANCEL)
        self._prune_ended = client.register_script(_PRUNE_ENDED)

    @classmethod
    def from_url(cls, url: str, *, sealer: Sealer | None = None) -> JobStore:
        client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=10, socket_connect_timeout=5)
        return cls(client, sealer=sealer)

    async def close(self) -> None:
        await self.redis.aclose()

    def _k(self, *parts: str) -> str:
        return self.prefix + ":".join(parts)

    # ---- jobs ----------------------------------------------------------------------------------

    async def create(self, job: Job, credential: str | None = None) -> Job:
        job.created_at = job.created_at or time.time()
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._k("job", job.id), mapping=job.to_hash())
            pipe.zadd(self._k("tenant", job.tenant, "jobs"), {job.id: job.created_at})
            pipe.sadd(self._k("active"), job.id)
            pipe.sadd(self._k("tenant", job.tenant, "active"), job.id)
            stored = seal(self.sealer, credential, f"batch job {job.id}")
            if stored:
                pipe.set(self._k("secret", job.id), stored)
            await pipe.execute()
        return job

    async def get(self, job_id: str) -> Job | None:
        doc = await self.redis.hgetall(self._k("job", job_id))
        return Job.from_hash(doc) if doc else None

    async def list(self, tenant: str, limit: int = 20, *, after: str | None = None) -> list[Job]:
        """Up to ``limit`` of ``tenant``'s jobs, newest first, starting after the job ``after`` (a cursor)."""
        ids = await self._page(self._k("tenant", tenant, "jobs"), limit, after, ascending=False)
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hgetall(self._k("job", job_id))
            docs = await pipe.execute()
        return [Job.from_hash(doc) for doc in docs if doc]

    async def _page(self, key: str, limit: int, after: str | None, *, ascending: bool) -> list[str]:
        """Up to ``limit`` members of the sorted set ``key`` by score, after the member ``after`` (one that is
        not there: from the start)."""
        start = 0
        if after:
            rank = await (self.redis.zrank(key, after) if ascending else self.redis.zrevrank(key, after))
            start = rank + 1 if rank is not None else 0
        return await (self.redis.zrange if ascending else self.redis.zrevrange)(key, start, start + limit - 1)

    async def active_count(self, tenant: str) -> int:
        """How many of ``tenant``'s jobs have not ended."""
        return int(await self.redis.scard(self._k("tenant", tenant, "active")))

    async def active_ids(self, tenant: str | None = None) -> list[str]:
        """Jobs not yet ended: every tenant's, or ``tenant``'s."""
        key = self._k("active") if tenant is None else self._k("tenant", tenant, "active")
        return sorted(await self.redis.smembers(key))

    async def credential(self, job_id: str) -> str | None:
        """The submitter's credential, opened (:class:`~aiworks.security.sealing.SealError` when it cannot be)."""
        return unseal(self.sealer, await self.redis.get(self._k("secret", job_id)), f"batch job {job_id}")

    async def update(self, job_id: str, **values) -> None:
        await self.redis.hset(self._k("job", job_id), mapping={k: str(v) for k, v in values.items()})

    async def request_cancel(self, job_id: str) -> str:
        """Ask the runner to stop; returns the job's status after the request."""
        return await self._cancel(keys=[self._k("job", job_id)], args=[str(time.time())])

    async def finish(self, job_id: str, status: str, **values) -> None:
        """End the job: its final status and fields; its chunks, lease and credential go."""
        stamp = {"completed": "completed_at", "failed": "failed_at", "cancelled": "cancelled_at",
                 "expired": "expired_at"}.get(status)  # fmt: skip
        if stamp:
            values[stamp] = time.time()
        tenant, created, window = await self.redis.hmget(self._k("job", job_id), "tenant", "created_at",
                                                         "completion_window")  # fmt: skip
        now = time.time()
        try:  # when its work token expires, as the gateway minted it (services/gateway/batch_routes.py)
            until = float(created) + window_seconds(window) + TOKEN_GRACE_S + 60
        except (TypeError, ValueError):
            until = now + window_seconds("24h") + TOKEN_GRACE_S
        async with self.redis.pipeline(transaction=True) as pipe:
            if tenant is not None:
                pipe.srem(self._k("tenant", tenant, "active"), job_id)
            pipe.hset(self._k("job", job_id), mapping={"status": status, **{k: str(v) for k, v in values.items()}})
            pipe.srem(self._k("active"), job_id)
            pipe.delete(self._k("chunks", job_id), self._k("secret", job_id), self._k("lease", job_id))
            pipe.sadd(self._k("sweep"), job_id)  # its parts are removed next, by whoever ends it or by any runner
            pipe.zadd(self._k("ended"), {job_id: now})  # gateways refuse its work token from their next read
            pipe.zadd(self._k("ended", "until"), {job_id: until})
            await pipe.execute()
        await self._prune_ended(keys=[self._k("ended"), self._k("ended", "until")], args=[now])

    ENDED_PAGE = 10_000

    async def ended_since(self, since: float) -> list[tuple[str, float, float]]:
        """Jobs ended at or after ``since`` (Unix time), oldest first, at most :attr:`ENDED_PAGE`: (id, when it
        ended, when its work token expires). Only jobs whose tokens have not yet expired are still recorded."""
        ended = await self.redis.zrangebyscore(self._k("ended"), since, "+inf", start=0, num=self.ENDED_PAGE,
                                               withscores=True)  # fmt: skip
        if not ended:
            return []
        until = await self.redis.zmscore(self._k("ended", "until"), [job_id for job_id, _ in ended])
        return [(job_id, at, float(u) if u is not None else at) for (job_id, at), u in zip(ended, until, strict=True)]

    async def swept(self, job_id: str) -> None:
        """The ended job's parts are gone."""
        await self.redis.srem(self._k("sweep"), job_id)

    async def to_sweep(self) -> str | None:
        """An ended job whose parts may still be there, taken off the list (put it back with :meth:`resweep`)."""
        return await self.redis.spop(self._k("sweep"))

    async def resweep(self, job_id: str) -> None:
        await self.redis.sadd(self._k("sweep"), job_id)

    # ---- leases and chunks --------------------------------------------------------------------

    async def claim(self, job_id: str, runner: str, ttl_s: float) -> bool:
        """Take the job if nobody holds it (or this runner already does)."""
        key = self._k("lease", job_id)
        if await self.redis.set(key, runner, nx=True, px=int(ttl_s * 1000)):
            return True
        return bool(await self._renew(keys=[key], args=[runner, int(ttl_s * 1000)]))

    async def renew(self, job_id: str, runner: str, ttl_s: float) -> bool:
        return bool(await self._renew(keys=[self._k("lease", job_id)], args=[runner, int(ttl_s * 1000)]))

    async def waiting(self, but: str) -> bool:
        """Whether a job not ended, other than ``but``, has no runner holding it (it waits for a turn)."""
        others = [job_id for job_id in await self.redis.smembers(self._k("active")) if job_id != but]
        if not others:
            return False
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in others:
                pipe.exists(self._k("lease", job_id))
            return not all(await pipe.execute())

    async def turns(self) -> dict[str, float]:
        """When each tenant's job last got a runner (Unix time), for :meth:`took_turn`'s order."""
        return {tenant: float(at) for tenant, at in (await self.redis.hgetall(self._k("turns"))).items()}

    async def took_turn(self, job: Job) -> None:
        """A runner takes ``job`` now: it and its tenant go to the back of the order of turns."""
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self._k("job", job.id), "turn_at", now)
            pipe.hset(self._k("turns"), job.tenant, now)
            await pipe.execute()

    async def release(self, job_id: str, runner: str) -> None:
        key = self._k("lease", job_id)
        if await self.redis.get(key) == runner:
            await self.redis.delete(key)

    async def done_chunks(self, job_id: str) -> set[int]:
        names = await self.redis.hkeys(self._k("chunks", job_id))
        return {int(n[2:]) for n in names if n.startswith("o:")}

    async def record_chunk(self, job_id: str, runner: str, index: int, part: str, ok: int, bad: int) -> int:
        """1: recorded; 0: already recorded (nothing counted); -1: this runner lost the lease.

        ``part``: where the chunk's lines were written (:func:`part_name`), before this call.
        """
        keys = [self._k("job", job_id), self._k("chunks", job_id), self._k("lease", job_id)]
        return int(await self._record(keys=keys, args=[runner, index, part, ok, bad]))

    async def inline_chunks(self, job_id: str) -> dict[int, tuple[bytes, bytes]]:
        """Chunks recorded with their lines in Redis, as runners did before parts: (output, error lines)."""
        doc = await self.redis.hgetall(self._k("chunks", job_id))
        return {int(name[2:]): (value.encode(), doc.get(f"e:{name[2:]}", "").encode())
                for name, value in doc.items() if name.startswith("o:") and not _PART.fullmatch(value)}  # fmt: skip

    async def replace_inline(self, job_id: str, index: int, part: str) -> None:
        """An inline chunk's lines now stand in ``part``: keep its name instead of them."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._k("chunks", job_id), f"o:{index}", part)
            pipe.hdel(self._k("chunks", job_id), f"e:{index}")
            await pipe.execute()

    async def chunk_parts(self, job_id: str) -> dict[int, str]:
        """Each recorded chunk's part name, by chunk index."""
        doc = await self.redis.hgetall(self._k("chunks", job_id))
        return {int(name[2:]): value for name, value in doc.items() if name.startswith("o:")}

    # ---- files ---------------------------------------------------------------------------------

    async def add_file(self, record: FileRecord) -> FileRecord:
        record.created_at = record.created_at or time.time()
        doc = {k: str(v) for k, v in asdict(record).items()}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._k("file", record.id), mapping=doc)
            pipe.zadd(self._k("tenant", record.tenant, "files"), {record.id: record.created_at})
            await pipe.execute()
        return record

    async def get_file(self, file_id: str) -> FileRecord | None:
        doc = await self.redis.hgetall(self._k("file", file_id))
        return _file_record(doc) if doc else None

    async def list_files(self, tenant: str, limit: int, *, after: str | None = None,
                         ascending: bool = False) -> list[FileRecord]:  # fmt: skip
        """Up to ``limit`` of ``tenant``'s files by creation time (newest first unless ``ascending``), starting
        after the file ``after`` (a cursor: an id from an earlier page; one not the tenant's starts at the top)."""
        ids = await self._page(self._k("tenant", tenant, "files"), limit, after, ascending=ascending)
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hgetall(self._k("file", file_id))
            docs = await pipe.execute()
        return [_file_record(doc) for doc in docs if doc]

    async def delete_file(self, record: FileRecord) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self._k("file", record.id))
            pipe.zrem(self._k("tenant", record.tenant, "files"), record.id)
            await pipe.execute()


def _file_record(doc: dict) -> FileRecord:
    return FileRecord(doc["id"], doc["tenant"], doc["filename"], doc["purpose"], doc["url"],
                      int(doc.get("bytes", 0)), float(doc.get("created_at", 0)), int(doc.get("lines", -1)))  # fmt: skip
