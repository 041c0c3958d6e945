"""The audit chain in a Redis Stream, shared by every replica of a service.

Each replica is one *writer* (its pod name by default) with a chain of its own:
the lines are exactly those of :mod:`aiworks.security.audit` (``seq``, ``prev``,
``hash``), added to one stream as entries ``{w: writer, line: <the JSON line>}``.
One stream keeps every replica's records in arrival order; verifying walks the
stream and checks each writer's chain separately.

Appending is one Lua script per batch: it compares the writer's head (``seq
hash entry-id`` in a hash beside the stream) with the one this process holds,
adds the batch and moves the head, atomically. A second process writing under
the same name therefore fails loudly instead of forking the chain, and the
heads make cutting records off the stream's end visible, which a file alone
cannot show. Nothing here trims the stream: audit records are kept until an
operator exports and removes them.

The sink runs in the audit log's worker thread, so it uses redis-py's blocking
client; nothing here touches the event loop.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass, field

import redis

from aiworks.core.errors import Unavailable
from aiworks.security.audit import (
    GENESIS,
    AuditChainError,
    AuditWriteError,
    VerifyResult,
    check_head_record,
    check_line,
)

DEFAULT_STREAM = "aiworks:audit"
BATCH_LINES = 500  # lines per script call: bounds one call's time inside Redis

# KEYS: stream, heads. ARGV: writer, expected head ("" at the start), new head's "seq hash", lines...
_APPEND = """
local head = redis.call('HGET', KEYS[2], ARGV[1]) or ''
if head ~= ARGV[2] then return redis.error_reply('AUDITCHAIN ' .. head) end
local id = ''
for i = 4, #ARGV do
  id = redis.call('XADD', KEYS[1], '*', 'w', ARGV[1], 'line', ARGV[i])
end
local new = ARGV[3] .. ' ' .. id
redis.call('HSET', KEYS[2], ARGV[1], new)
return new
"""


def heads_key(stream: str) -> str:
    return f"{stream}:heads"


def default_writer() -> str:
    """The pod's name under Kubernetes (its hostname), else this machine's."""
    return socket.gethostname()


def _seq_hash(head: str) -> tuple[int, str]:
    seq, digest, _ = head.split(" ", 2)
    return int(seq), digest


class RedisStreamSink:
    """An :class:`~aiworks.security.audit.AuditLog` sink: this writer's chain in a shared Redis Stream."""

    def __init__(self, url: str, *, writer: str | None = None, stream: str = DEFAULT_STREAM,
                 timeout_s: float = 5.0):  # fmt: skip
        self.url = url
        self.writer = writer or default_writer()
        if not self.writer or " " in self.writer:
            raise ValueError(f"audit writer name {self.writer!r} must be non-empty text without spaces")
        self.stream = stream
        self.name = f"redis stream {stream} (writer {self.writer})"
        self._timeout_s = timeout_s
        self._client: redis.Redis | None = None
        self._script = None
        self._head = ""

    @property
    def is_open(self) -> bool:
        return self._client is not None

    def open(self, key: bytes | None) -> tuple[int, str]:
        client = redis.Redis.from_url(self.url, socket_timeout=self._timeout_s, socket_connect_timeout=self._timeout_s)
        try:
            head = client.hget(heads_key(self.stream), self.writer)
            found = (0, GENESIS)
            if head:
                self._head = head.decode()
                entry_id = self._head.split(" ", 2)[2]
                entries = client.xrange(self.stream, entry_id, entry_id)
                hint = f"aiworks audit verify --redis-url URL --stream {self.stream}"
                if not entries:
                    raise AuditChainError(
                        f"writer {self.writer}'s last audit record ({entry_id}) is missing from {self.stream}; "
                        f"check it with `{hint}`"
                    )
                found = check_head_record(entries[0][1][b"line"], key, where=f"audit record {entry_id} of {self.stream}",
                                          verify_hint=hint)  # fmt: skip
                if found != _seq_hash(self._head):
                    raise AuditChainError(f"the head of writer {self.writer} in {heads_key(self.stream)} does not "
                                          f"match its last record ({entry_id})")  # fmt: skip
            self._script = client.register_script(_APPEND)
        except redis.RedisError as exc:
            client.close()
            raise Unavailable(f"audit log: Redis at {self.stream} cannot be read: {exc}") from None
        except BaseException:
            client.close()
            raise
        self._client = client
        return found

    def write(self, data: bytes) -> None:
        lines = data.splitlines()
        written = 0
        for start in range(0, len(lines), BATCH_LINES):
            batch = lines[start : start + BATCH_LINES]
            last = json.loads(batch[-1])
            new = f"{last['seq']} {last['hash']}"
            try:
                self._head = self._append(batch, new)
            except redis.RedisError as exc:
                raise AuditWriteError(f"writing {self.name}: {exc}", written) from exc
            written += sum(len(line) + 1 for line in batch)

    def _append(self, batch: list[bytes], new: str) -> str:
        assert self._client is not None and self._script is not None
        try:
            result = self._script(keys=[self.stream, heads_key(self.stream)], args=[self.writer, self._head, new, *batch])
        except redis.ResponseError as exc:
            text = str(exc)
            if not text.startswith("AUDITCHAIN"):
                raise
            found = text.removeprefix("AUDITCHAIN").strip()
            # The script ran but its answer was lost (a timeout): the head already is this batch's last line.
            if found and " ".join(found.split(" ")[:2]) == new:
                return found
            raise AuditChainError(
                f"writer {self.writer}'s chain in {self.stream} moved under this process (head {found or 'none'}, "
                f"expected {self._head or 'none'}): another process writes under the same name; give each its own"
            ) from None
        return result.decode() if isinstance(result, bytes) else str(result)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


@dataclass
class StreamVerifyResult:
    """Each writer's chain in one stream: its :class:`VerifyResult`, and problems found against the heads."""

    stream: str
    writers: dict[str, VerifyResult] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.ok for r in self.writers.values())

    def summary(self) -> str:
        lines = []
        for writer, result in sorted(self.writers.items()):
            if result.ok:
                lines.append(f"{writer}: ok: {result.records} records, head seq {result.head_seq} hash {result.head_hash}")
            else:
                lines.append(f"{writer}: FAILED at its record {result.bad_line}: {result.reason}")
        lines += [f"FAILED: {p}" for p in self.problems]
        if not self.writers and not self.problems:
            lines.append(f"ok: {self.stream} holds no audit records")
        return "\n".join(lines)


def verify_audit_stream(url: str, *, stream: str = DEFAULT_STREAM, key: bytes | None = None,
                        page: int = 1000) -> StreamVerifyResult:  # fmt: skip
    """Walk ``stream`` once, checking every writer's chain, then each writer's head against its last record."""
    client = redis.Redis.from_url(url, socket_timeout=30)
    out = StreamVerifyResult(stream)
    state: dict[str, list] = {}  # writer -> [seq, prev, count, failed]
    try:
        start = "-"
        while True:
            entries = client.xrange(stream, start, "+", count=page)
            for entry_id, fields in entries:
                writer = fields.get(b"w", b"").decode()
                seq, prev, count, failed = state.setdefault(writer, [0, GENESIS, 0, False])
                if failed:
                    continue
                record, reason = check_line(fields.get(b"line", b""), seq + 1, prev, key)
                if reason is not None:
                    out.writers[writer] = VerifyResult(False, count, seq, prev, None, count + 1,
                                                       f"entry {entry_id.decode()}: {reason}")  # fmt: skip
                    state[writer][3] = True
                    continue
                state[writer] = [record["seq"], record["hash"], count + 1, False]
            if len(entries) < page:
                break
            start = "(" + entries[-1][0].decode()
        heads = {k.decode(): v.decode() for k, v in client.hgetall(heads_key(stream)).items()}
    finally:
        client.close()
    for writer, (seq, prev, count, failed) in state.items():
        if not failed:
            out.writers[writer] = VerifyResult(True, count, seq, prev)
        head = heads.get(writer)
        if head is None:
            out.problems.append(f"writer {writer} has records but no head in {heads_key(stream)}")
        elif not failed and _seq_hash(head) != (seq, prev):
            out.problems.append(
                f"writer {writer}'s head is seq {_seq_hash(head)[0]} but its last record is seq {seq}: "
                "records were removed from the end of the stream"
            )
    for writer in sorted(set(heads) - set(state)):
        out.problems.append(f"writer {writer} has a head ({heads[writer].split(' ')[0]} records) but no records left")
    return out
