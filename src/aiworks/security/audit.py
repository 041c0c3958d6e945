"""A tamper-evident audit log: JSON lines chained by SHA-256.

Each line is one event (an inference answered, an admin action taken) with
``seq``, ``prev`` (the previous line's ``hash``) and ``hash``, the SHA-256 of
the line's canonical JSON without ``hash`` (sorted keys, no spaces, UTF-8).
Editing a line breaks its hash; removing, inserting or moving one breaks the
``seq`` run or the ``prev`` link of the line after it, so
:func:`verify_audit_log` names the first bad line. With a key, ``hash`` is an
HMAC-SHA256 instead, and someone who can rewrite the whole file still cannot
forge a chain that verifies. Cutting lines off the end is only visible against
a head (seq, hash) recorded elsewhere: verify prints it for that purpose.

Events carry metadata only, never tensors or prompts: ``details`` accepts a
few short scalars and refuses anything else.

:class:`AuditLog` is written from the event loop: ``record`` chains the line
in memory (microseconds) and a background task writes batches from a worker
thread, so a slow disk never blocks a request. One process writes one file
(an exclusive ``flock`` enforces it); a restarted writer continues the chain
from the file's last line.

Where the lines go is a sink: :class:`FileSink` (above) by default, or a Redis
Stream shared by several replicas (:mod:`aiworks.security.audit_redis`), one
chain per writer.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import errno
import fcntl
import hashlib
import hmac
import json
import logging
import os
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiworks.core.errors import AIWorksError, InvalidArgument, Status, Unavailable

log = logging.getLogger(__name__)

GENESIS = "0" * 64
KINDS = ("inference", "admin")
# Line order on disk; the hash does not depend on it (canonical JSON sorts keys).
FIELDS = (
    "seq", "time", "kind", "tenant", "model", "version", "status", "latency_ms",
    "request_id", "action", "actor", "details", "prev", "hash",
)  # fmt: skip
_TEXT_FIELDS = ("tenant", "model", "version", "status", "request_id", "action", "actor")
MAX_DETAILS = 32
MAX_TEXT = 512


class AuditChainError(AIWorksError):
    """The audit log on disk is broken and cannot be continued."""

    status = Status.FAILED_PRECONDITION


def canonical_json(record: Mapping[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def chain_hash(record: Mapping[str, Any], key: bytes | None = None) -> str:
    """The ``hash`` of a record: over every field but ``hash`` itself, ``prev`` included."""
    data = canonical_json({k: v for k, v in record.items() if k != "hash"})
    return hmac.new(key, data, hashlib.sha256).hexdigest() if key else hashlib.sha256(data).hexdigest()


def _check_text(name: str, value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InvalidArgument(f"audit field {name!r} must be text, got {type(value).__name__}")
    text = str(value)
    if len(text) > MAX_TEXT:
        raise InvalidArgument(f"audit field {name!r} is {len(text)} characters; the limit is {MAX_TEXT}")
    return text


def _check_details(details: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Short scalars only: the audit log records what happened, never the data it happened to."""
    if details is None:
        return None
    if not isinstance(details, Mapping):
        raise InvalidArgument(f"audit details must be a mapping, got {type(details).__name__}")
    if len(details) > MAX_DETAILS:
        raise InvalidArgument(f"audit details have {len(details)} entries; the limit is {MAX_DETAILS}")
    out: dict[str, Any] = {}
    for k, v in details.items():
        if not isinstance(k, str):
            raise InvalidArgument(f"audit detail keys must be text, got {k!r}")
        if v is None or isinstance(v, bool | int | float):
            out[k] = v
        elif isinstance(v, str):
            if len(v) > MAX_TEXT:
                raise InvalidArgument(
                    f"audit detail {k!r} is {len(v)} characters; the limit is {MAX_TEXT} (payloads are never logged)"
                )
            out[k] = v
        else:
            raise InvalidArgument(
                f"audit detail {k!r} is {type(v).__name__}; only short text and numbers are allowed (payloads are never logged)"
            )
    return out


def make_event(
    kind: str,
    *,
    tenant: str | None = None,
    model: str | None = None,
    version: str | int | None = None,
    status: str | None = None,
    latency_ms: float | None = None,
    request_id: str | None = None,
    action: str | None = None,
    actor: str | None = None,
    details: Mapping[str, Any] | None = None,
    time: dt.datetime | None = None,
) -> dict[str, Any]:
    """An unchained event with every field present (``None`` where it does not apply)."""
    if kind not in KINDS:
        raise InvalidArgument(f"audit kind must be one of {KINDS}, got {kind!r}")
    if latency_ms is not None and (isinstance(latency_ms, bool) or not isinstance(latency_ms, int | float)):
        raise InvalidArgument(f"audit latency_ms must be a number, got {type(latency_ms).__name__}")
    when = (time or dt.datetime.now(dt.UTC)).astimezone(dt.UTC)
    event: dict[str, Any] = {"time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"), "kind": kind}
    texts = dict(
        tenant=tenant, model=model, version=version, status=status, request_id=request_id, action=action, actor=actor
    )
    for name in _TEXT_FIELDS:
        event[name] = _check_text(name, texts[name])
    event["latency_ms"] = None if latency_ms is None else round(float(latency_ms), 3)
    event["details"] = _check_details(details)
    return event


# ---- writing ------------------------------------------------------------------------------------


def _read_tail(fd: int, path: Path) -> bytes | None:
    """The file's last line without its newline; ``None`` for an empty file."""
    size = os.fstat(fd).st_size
    if size == 0:
        return None
    if os.pread(fd, 1, size - 1) != b"\n":
        raise AuditChainError(
            f"audit log {path} ends with an incomplete line (a writer stopped mid-line?); "
            f"check it with `aiworks audit verify {path}` and move it aside before writing again"
        )
    end, chunk, buf = size - 1, 64 * 1024, b""
    while end > 0:
        start = max(0, end - chunk)
        buf = os.pread(fd, end - start, start) + buf
        end = start
        nl = buf.rfind(b"\n")
        if nl >= 0:
            return buf[nl + 1 :]
    return buf


class AuditWriteError(OSError):
    """A sink took only the first ``written`` bytes of a batch; the rest is written again later."""

    def __init__(self, message: str, written: int = 0):
        super().__init__(message)
        self.written = written


class FileSink:
    """Lines appended to one file that this process holds an exclusive ``flock`` on."""

    def __init__(self, path: Path | str, *, fsync: bool = True):
        self.path = Path(path)
        self.name = str(self.path)
        self._fsync = fsync
        self._fd: int | None = None

    @property
    def is_open(self) -> bool:
        return self._fd is not None

    def open(self, key: bytes | None) -> tuple[int, str]:
        """Open and lock the file; the (seq, hash) its chain continues from."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o640)
        head = (0, GENESIS)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise Unavailable(
                        f"audit log {self.path} is already open for writing (in this or another process); give each process its own file"
                    ) from None
                raise
            tail = _read_tail(fd, self.path)
            if tail is not None:
                head = check_head_record(tail, key, where=f"the last line of audit log {self.path}",
                                         verify_hint=f"aiworks audit verify {self.path}")  # fmt: skip
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        return head

    def write(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
            if self._fsync:
                os.fsync(self._fd)
        except OSError as exc:
            raise AuditWriteError(f"writing audit log {self.path}: {exc}", len(data) - len(view)) from exc

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # releases the flock
            self._fd = None


def check_head_record(raw: bytes, key: bytes | None, *, where: str, verify_hint: str) -> tuple[int, str]:
    """(seq, hash) of the record a chain continues from, after checking it is one and is intact."""
    try:
        last = json.loads(raw)
        seq, stored = int(last["seq"]), str(last["hash"])
    except (ValueError, KeyError, TypeError) as exc:
        raise AuditChainError(f"{where} is not an audit record ({exc}); check it with `{verify_hint}`") from None
    if chain_hash(last, key) != stored:
        raise AuditChainError(
            f"{where} does not match its hash (edited, or written with another audit key); "
            f"check it with `{verify_hint}`"
        )
    return seq, stored


class AuditLog:
    """An append-only, hash-chained audit file, safe to call from the event loop and from threads.

    ``await start()`` opens the file (taking an exclusive lock) and resumes the
    chain; ``record`` returns the chained line at once; lines reach the disk
    within ``flush_interval_s``, or at ``await flush()`` / ``await close()``.
    """

    def __init__(
        self,
        path: Path | str | None = None,
        *,
        key: bytes | None = None,
        flush_interval_s: float = 0.05,
        fsync: bool = True,
        sink: FileSink | Any = None,
    ):
        if (path is None) == (sink is None):
            raise ValueError("an audit log needs a path or a sink, not both")
        self._sink = sink if sink is not None else FileSink(path, fsync=fsync)
        self.name = self._sink.name
        self._key = key
        self._flush_interval_s = flush_interval_s
        self._lock = threading.Lock()  # seq, prev and the buffer change together
        self._buffer: list[bytes] = []
        self._unwritten = b""  # the tail of a batch a failed write left behind
        self._seq = 0
        self._prev = GENESIS
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._write_lock = threading.Lock()  # one batch on its way to the disk at a time, in chain order
        self._closing = False
        self._task: asyncio.Task | None = None

    @property
    def path(self) -> Path | None:
        """The file written, when the sink is a file."""
        return getattr(self._sink, "path", None)

    @property
    def head(self) -> tuple[int, str]:
        """(seq, hash) of the last line chained, written or not."""
        with self._lock:
            return self._seq, self._prev

    # -- life cycle

    def open(self) -> None:
        """Open the sink and continue its chain (blocking; :meth:`start` runs it in a thread)."""
        self._seq, self._prev = self._sink.open(self._key)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        await asyncio.to_thread(self.open)
        self._task = asyncio.create_task(self._flusher(), name="audit-flusher")

    async def close(self) -> None:
        """Stop the background writer after a last batch, write what is left, and close the file."""
        if self._task is not None and self._wake is not None:
            # No cancel: a batch already handed to a worker thread must finish before the file closes.
            self._closing = True
            self._wake.set()
            await self._task
            self._task = None
        await asyncio.to_thread(self.close_sync)

    def close_sync(self) -> None:
        """Write what is buffered and close, without an event loop."""
        with self._write_lock:
            if not self._sink.is_open:
                return
            try:
                self._write(self._take())
            finally:
                self._sink.close()

    async def __aenter__(self) -> AuditLog:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- recording

    def record(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Chain one event (see :func:`make_event` for the fields) and queue it for writing."""
        event = make_event(kind, **fields)
        with self._lock:
            if not self._sink.is_open:
                raise AIWorksError(f"audit log {self.name} is not open; call start() first")
            record = {"seq": self._seq + 1, **event, "prev": self._prev}
            record["hash"] = chain_hash(record, self._key)
            ordered = {k: record[k] for k in FIELDS}
            self._buffer.append(json.dumps(ordered, ensure_ascii=False, separators=(",", ":")).encode() + b"\n")
            self._seq, self._prev = record["seq"], record["hash"]
            first = len(self._buffer) == 1
        if first and self._wake is not None and self._loop is not None:
            try:
                same_loop = asyncio.get_running_loop() is self._loop
            except RuntimeError:
                same_loop = False
            if same_loop:
                self._wake.set()
            elif not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._wake.set)
        return ordered

    def inference(
        self,
        *,
        tenant: str | None,
        model: str,
        version: str | int | None,
        status: str,
        latency_ms: float,
        request_id: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        return self.record(
            "inference", tenant=tenant, model=model, version=version, status=status,
            latency_ms=latency_ms, request_id=request_id, details=details,
        )  # fmt: skip

    def admin(
        self,
        *,
        actor: str,
        action: str,
        status: str = "ok",
        tenant: str | None = None,
        model: str | None = None,
        version: str | int | None = None,
        request_id: str | None = None,
        details: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        return self.record(
            "admin", actor=actor, action=action, status=status, tenant=tenant, model=model,
            version=version, request_id=request_id, details=details,
        )  # fmt: skip

    # -- writing

    def _take(self) -> bytes:
        with self._lock:
            data = self._unwritten + b"".join(self._buffer)
            self._buffer.clear()
            self._unwritten = b""
        return data

    def _write(self, data: bytes) -> None:
        if not data:
            return
        try:
            self._sink.write(data)
        except AuditWriteError as exc:
            with self._lock:  # keep the rest, in order, ahead of newer lines
                self._unwritten = data[exc.written :] + self._unwritten
            raise
        except BaseException:
            with self._lock:
                self._unwritten = data + self._unwritten
            raise

    def flush_sync(self) -> None:
        """Write every line recorded so far, blocking (for callers without an event loop)."""
        with self._write_lock:
            if self._sink.is_open:
                self._write(self._take())

    async def flush(self) -> None:
        """Write every line recorded so far (from a worker thread)."""
        if self._sink.is_open:
            await asyncio.to_thread(self.flush_sync)

    async def _flusher(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._closing:
                await asyncio.sleep(self._flush_interval_s)  # gather a batch
            try:
                await self.flush()
            except (OSError, AIWorksError):  # the disk, Redis away, or a chain another writer moved
                log.exception("writing audit log %s failed; the lines stay buffered", self.name)
                if not self._closing:
                    await asyncio.sleep(max(self._flush_interval_s, 1.0))
                    self._wake.set()
            if self._closing:
                return


# ---- verifying ----------------------------------------------------------------------------------


@dataclass
class VerifyResult:
    """The outcome of :func:`verify_audit_log`: the chain's head, or the first bad line and why."""

    ok: bool
    records: int
    head_seq: int
    head_hash: str
    file: Path | None = None
    bad_line: int | None = None
    reason: str | None = None

    def summary(self) -> str:
        if self.ok:
            return f"ok: {self.records} records, head seq {self.head_seq} hash {self.head_hash}"
        return f"FAILED: {self.file}, line {self.bad_line}: {self.reason}"


def check_line(raw: bytes, expected_seq: int, expected_prev: str, key: bytes | None) -> tuple[dict | None, str | None]:
    if not raw.strip():
        return None, "blank line inside the log"
    try:
        record = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        return None, f"not valid JSON ({exc})"
    if not isinstance(record, dict):
        return None, "not a JSON object"
    missing = [f for f in FIELDS if f not in record]
    if missing:
        return None, f"missing field(s) {', '.join(missing)}"
    extra = sorted(set(record) - set(FIELDS))
    if extra:
        return None, f"unexpected field(s) {', '.join(extra)}"
    if chain_hash(record, key) != record["hash"]:
        why = "edited, or the log was written with another key" if key else "edited"
        return None, f"hash does not match the line's contents (seq {record['seq']}): the line was {why}"
    seq = record["seq"]
    if not isinstance(seq, int) or isinstance(seq, bool):
        return None, f"seq {seq!r} is not an integer"
    if seq > expected_seq:
        return None, (
            f"seq {seq} where {expected_seq} was expected: "
            f"{'a line is' if seq == expected_seq + 1 else f'{seq - expected_seq} lines are'} missing before it, "
            "or lines were moved"
        )
    if seq < expected_seq:
        return None, f"seq {seq} where {expected_seq} was expected: this line was inserted, duplicated or moved"
    if record["prev"] != expected_prev:
        return None, "prev does not match the previous line's hash: a line before it was replaced or inserted"
    return record, None


def verify_audit_log(paths: Path | str | Iterable[Path | str], *, key: bytes | None = None) -> VerifyResult:
    """Walk the chain through ``paths`` (one file, or rotated files oldest first) and report the first break."""
    files = [Path(paths)] if isinstance(paths, str | Path) else [Path(p) for p in paths]
    seq, prev, count = 0, GENESIS, 0
    for path in files:
        try:
            handle = path.open("rb")
        except OSError as exc:
            return VerifyResult(False, count, seq, prev, path, 0, f"cannot open: {exc.strerror}")
        with handle:
            for number, raw in enumerate(handle, start=1):
                if not raw.endswith(b"\n"):
                    return VerifyResult(False, count, seq, prev, path, number, "incomplete last line (no newline)")
                record, reason = check_line(raw, seq + 1, prev, key)
                if reason is not None:
                    return VerifyResult(False, count, seq, prev, path, number, reason)
                assert record is not None
                seq, prev, count = record["seq"], record["hash"], count + 1
    return VerifyResult(True, count, seq, prev, files[-1] if files else None)
