"""The credential key file as a key ring: one key seals and mints, older ones still open and verify.

The installation's credential key file (``aiworks up --tiers``, the chart's
install hook, ``aiworks certs --credential-key FILE``) holds one secret per
line, each of 16 bytes or more; blank lines are skipped:

- **the first line is the current key**: the gateway seals what jobs and
  queued requests will run with under it (:mod:`aiworks.security.sealing`)
  and mints work tokens under it (:mod:`aiworks.security.work_tokens`);
- **every other line is a key that still opens and verifies**: values sealed
  and tokens minted under it before a rotation keep working, so the jobs
  in flight across a rotation finish.

A file with one line, which every earlier version made, is a ring of one.

Rotating takes three steps where many processes take the file each at
their own moment (Kubernetes), because a runner must be able to open what a
gateway seals before any gateway seals under a new key; each step is taken
everywhere before the next:

1. ``stage``: a new random key goes in as the second line. Every gateway,
   runner and worker takes it; nothing is sealed under it yet.
2. ``promote``: the first two lines swap; the new key seals, the old one
   still opens.
3. ``retire``: every line but the first goes, once what the old key sealed
   has ended (a job's completion window and a quarter of an hour; a queued
   request's result TTL).

``at-once`` is ``stage`` and ``promote`` in one, for installs whose processes
read one file on one machine (``aiworks up``, compose). After a key has leaked,
replace the file with a new one instead: what the leaked key sealed then
fails, naming the key ids, rather than keep running under it.

No step needs a restart: every process that holds the ring watches its file
(:class:`KeyFileWatch`, every ``credential_key_reload_s``) and takes a
changed ring in place, logging the new key ids and setting the
``aiworks_credential_key_info`` gauge, so an operator can see when every
process holds a step before taking the next. A value or token under a key
id the process does not hold makes it read the file again at once (at most
once a second) before refusing it, so a runner that meets what a gateway
sealed under a key it has not read yet does not fail the work. A file that cannot be read or
holds a bad line is logged once and the ring in use stays: a broken edit
never leaves a process without a key.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from aiworks.core.errors import AIWorksError, InvalidArgument
from aiworks.core.metrics import CREDENTIAL_KEYS, INTERNAL_TOKEN_KEYS
from aiworks.security.callers import parse_ring, read_secret
from aiworks.security.certs import write_private_file

# What makes a credential key file, for the error that finds none.
CREDENTIAL_KEY_MAKER = "`aiworks up --tiers`, the chart's install hook or `aiworks certs --credential-key FILE`"
ROTATION_STEPS = ("stage", "promote", "retire", "at-once")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RingFile:
    """A kind of secret file: its name in messages, what makes one (for the error that finds none), the gauge of
    the key ids a process holds, by role, and the name of the task that watches it."""

    what: str
    maker: str
    gauge: object
    task: str


CREDENTIAL_KEY_FILE = RingFile("credential key file", CREDENTIAL_KEY_MAKER, CREDENTIAL_KEYS, "credential-key-watch")
# The internal token file (aiworks.security.callers): the first line's token is presented, every line's accepted.
INTERNAL_TOKEN_FILE = RingFile("internal token file", "`aiworks up` or `aiworks certs --internal-token FILE`",
                               INTERNAL_TOKEN_KEYS, "internal-token-watch")  # fmt: skip


def derive(keys: bytes | list[bytes], info: bytes) -> dict[str, bytes]:
    """Each key of the ring through HKDF-SHA256 under ``info`` (one use, one derived key), by key id (the first 8
    hex digits of the derived key's SHA-256), the current key first."""
    ring: dict[str, bytes] = {}
    for secret in [keys] if isinstance(keys, bytes) else keys:
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)
        ring.setdefault(hashlib.sha256(key).hexdigest()[:8], key)
    return ring


def describe_ring(key_ids: tuple[str, ...], first: str, others: str) -> str:
    """``credential key ids a1b2c3d4 (seals), e5f6a7b8 (opens only)``: for log lines and messages, never a key."""
    return f"credential key ids {key_ids[0]} ({first})" + "".join(f", {i} ({others})" for i in key_ids[1:])


def parse_keys(data: bytes, where: str = "credential key file") -> list[bytes]:
    """The ring in a key file's bytes: its non-blank lines, stripped, first the current; duplicates once."""
    return parse_ring(data, where)


def read_ring(path: Path | str, kind: RingFile) -> list[bytes]:
    """The ring in the ``kind`` file at ``path``; an error naming the file (and what makes one)."""
    return parse_ring(read_secret(path, kind.what, kind.maker), f"{kind.what} {path}")


def read_keys(path: Path | str) -> list[bytes]:
    """The key ring in the credential key file at ``path``."""
    return read_ring(path, CREDENTIAL_KEY_FILE)


def rotated(keys: list[bytes], step: str, what: str = "credential key file") -> list[bytes]:
    """The ring after one rotation ``step`` (:data:`ROTATION_STEPS`; the module docstring says when each)."""
    if step == "stage":
        return [keys[0], secrets.token_hex(32).encode(), *keys[1:]]
    if step == "promote":
        if len(keys) < 2:
            raise InvalidArgument(f"the {what} holds one key: stage a new one before promoting it")
        return [keys[1], keys[0], *keys[2:]]
    if step == "retire":
        return keys[:1]
    if step == "at-once":
        return rotated(rotated(keys, "stage", what), "promote", what)
    raise InvalidArgument(f"unknown rotation step {step!r}; one of {', '.join(ROTATION_STEPS)}")


def rotate_file(path: Path | str, step: str, kind: RingFile = CREDENTIAL_KEY_FILE) -> list[bytes]:
    """Rotate the key file at ``path`` in place (mode 0600, replaced atomically); the new ring."""
    path = Path(path)
    keys = rotated(read_ring(path, kind), step, kind.what)
    write_private_file(path, b"".join(k + b"\n" for k in keys))
    return keys


class KeyFileWatch:
    """Keeps the holders of a ring (``Sealer``, ``WorkTokens``: each with ``reload(keys)``, ``key_ids`` and
    ``describe()``) in step with the key file at ``path``. :meth:`check` re-reads it and, when its bytes
    changed and parse, hands the new ring to every holder; :meth:`run` checks every ``interval_s``, reading
    off the event loop. The gauge shows the first holder's key ids (the sealer's, the ids the start-up and
    reload log lines and a refused value's message name)."""

    def __init__(self, path: Path | str, holders: Sequence, kind: RingFile = CREDENTIAL_KEY_FILE):
        self.path = Path(path)
        self.kind = kind
        self.holders = list(holders)
        read = self._read()
        self._seen = read if isinstance(read, bytes) else None
        self._failure = ""
        self._refreshed_at = float("-inf")
        for holder in self.holders:
            holder.refresh = self.refresh
        self._publish()

    def refresh(self) -> bool:
        """A holder met a key id it does not hold: read the file now (a small file; at most once a second,
        so values under a truly unknown key cannot make it read on every call); whether the ring changed."""
        now = time.monotonic()
        if now - self._refreshed_at < 1.0:
            return False
        self._refreshed_at = now
        return self.check()

    def _read(self) -> bytes | OSError:
        try:
            return self.path.read_bytes()
        except OSError as exc:
            return exc

    def _describe(self) -> str:
        return "; ".join(holder.describe_keys() for holder in self.holders)

    def _publish(self) -> None:
        """1 for each key id held, by role (``current``: seals and mints, or is presented; ``previous``: only
        opens and verifies, or is accepted); ids no longer held go."""
        gauge = self.kind.gauge
        gauge.clear()
        for n, key_id in enumerate(self.holders[0].key_ids):
            gauge.labels(key_id=key_id, role="previous" if n else "current").set(1)

    def _failed(self, why: str) -> None:
        if why != self._failure:  # once per distinct failure, not every interval
            log.error("%s; keeping %s", why, self._describe())
        self._failure = why

    def check(self, data: bytes | OSError | None = None) -> bool:
        """Re-read the file (or take what a read elsewhere gave: its bytes, or why it failed); whether the ring
        changed."""
        data = self._read() if data is None else data
        if isinstance(data, OSError):
            self._failed(f"{self.kind.what} {self.path} cannot be read ({data.strerror or type(data).__name__})")
            return False
        if data == self._seen:
            self._failure = ""
            return False
        try:
            keys = parse_ring(data, f"{self.kind.what} {self.path}")
        except AIWorksError as exc:
            self._failed(exc.message)
            return False
        before = self.holders[0].key_ids
        for holder in self.holders:
            holder.reload(keys)
        self._seen, self._failure = data, ""
        if self.holders[0].key_ids == before:
            return False
        log.info("%s %s changed: now %s", self.kind.what, self.path, self._describe())
        self._publish()
        return True

    async def run(self, interval_s: float) -> None:
        """Check every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            self.check(await asyncio.to_thread(self._read))


def watch_key_file(path: Path | str | None, holders: Sequence, interval_s: float,
                   kind: RingFile = CREDENTIAL_KEY_FILE) -> asyncio.Task | None:  # fmt: skip
    """A running :class:`KeyFileWatch` task for ``holders`` (``None`` ones skipped) on the running loop; none
    without a file or a holder. ``interval_s`` 0 publishes the gauge and watches nothing."""
    holders = [h for h in holders if h is not None]
    if not path or not holders:
        return None
    watch = KeyFileWatch(path, holders, kind)
    if interval_s <= 0:
        return None
    return asyncio.get_running_loop().create_task(watch.run(interval_s), name=kind.task)


def watch_internal_token(settings, auth=None, also: Sequence = ()) -> asyncio.Task | None:
    """Keep this process's internal token in step with its ``internal_token_file``: the token it presents (the
    process caller, :func:`aiworks.core.rpc.process_caller`) and, for a server, the tokens ``auth`` accepts
    (a :class:`~aiworks.security.callers.CallerAuth`, or a ``CallerCheck`` holding one); ``also``: other
    :class:`~aiworks.security.callers.ClientCaller` objects of the process. Within the running loop."""
    from aiworks.core.rpc import process_caller

    auth = getattr(auth, "auth", auth)
    holders = [auth if auth is not None and auth.key_ids else None, process_caller(), *also]
    return watch_key_file(settings.internal_token_file, holders, settings.internal_token_reload_s,
                          INTERNAL_TOKEN_FILE)  # fmt: skip
