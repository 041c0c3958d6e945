"""Work tokens: what a batch job or a queued asynchronous request runs with, minted by the gateway.

Work submitted now runs later: a batch job's lines over hours, a queued
request when a worker takes it. The runner or worker calls the gateway as the
submitter, so tenancy, limits, metering and the audit apply. What it sends is
not the submitter's own API key or JWT but a token the gateway minted at
submission:

- **It outlives the submitter's JWT.** A job of ten million lines runs longer
  than a JWT lives; the work was authorized when it was submitted, so it
  runs to its end (its completion window) however short the JWT was.
- **It dies with the submitter's API key.** A token minted for a call made
  with an API key carries that key's SHA-256, and the gateway refuses it once
  the key is no longer in its tenants file: revoking a key stops the work it
  submitted. A tenant removed from the file stops all of its work.
- **It can only run inference, of its work's model.** A gateway refuses it
  for any other model, for the Batch and Files APIs, for asynchronous
  submission and results, for result streams and for admin calls, so a token
  cannot submit more work or mint a longer-lived one.
- **It dies with its batch job.** A batch job's token names the job; once the job
  has ended (completed, failed, cancelled or expired) the gateway refuses it
  (:class:`EndedWork`, fed from the job store's record of ended jobs), so a
  token taken from a cancelled job runs nothing more.
- **It is not the submitter's credential.** What waits in Redis (sealed,
  :mod:`aiworks.security.sealing`) is this token, which expires with the
  work; the caller's long-lived API key is kept nowhere.

Format (ASCII)::

    aiwt1.<key id: 8 hex>.<base64url of the claims' JSON>.<base64url of HMAC-SHA256>

The HMAC covers everything before its own dot, under a key derived
(HKDF-SHA256) from the installation's credential key file: every gateway
replica that holds the file mints and verifies the same tokens. The file's
first key mints; its other keys still verify, so a rotation
(:mod:`aiworks.security.keyring`) does not stop work in flight. Claims:
``t`` tenant id, ``m`` how the submitter proved it (``api_key`` or ``jwt``),
``s`` its subject (the key's hash prefix or the JWT's ``sub``), ``k`` the
key's full SHA-256 (API keys only), ``w`` what the work is (``batch`` or
``async``), ``j`` the work's id (a batch job's; absent for a queued request), ``n`` the one model it may use,
``i`` and ``e`` issued and expiry (Unix seconds).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from dataclasses import dataclass
from pathlib import Path

import orjson

from aiworks.security.keyring import derive, describe_ring, read_keys

PREFIX = "aiwt1."
_INFO = b"aiworks work token v1"


class TokenError(ValueError):
    """A work token that does not verify; the message says why and never holds the token."""


@dataclass(frozen=True, slots=True)
class WorkClaims:
    tenant: str
    method: str
    subject: str
    key: str  # hex SHA-256 of the submitting API key, "" for a JWT
    work: str
    model: str
    issued_at: int
    expires_at: int
    work_id: str = ""  # the batch job's id; "" for a queued request's token


def is_work_token(token: str) -> bool:
    return token.startswith(PREFIX)


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class WorkTokens:
    """Mints under the credential key file's current key, verifies under any of its keys
    (:mod:`aiworks.security.keyring`): a token minted before a rotation runs to its end."""

    def __init__(self, keys: bytes | list[bytes]):
        self.reload(keys)
        self.refresh = None  # set by a KeyFileWatch: reads the file again when a token names a key not held

    def reload(self, keys: bytes | list[bytes]) -> None:
        """Take a new ring in place (:class:`aiworks.security.keyring.KeyFileWatch`)."""
        self._keys = derive(keys, _INFO)
        self.key_id = next(iter(self._keys))  # the current key's: what mint() uses
        self.key_ids = tuple(self._keys)

    @classmethod
    def from_file(cls, path: Path | str) -> WorkTokens:
        return cls(read_keys(path))

    def describe(self) -> str:
        """The ring for a start-up log line: key ids (a token's, not a sealed value's), never a key."""
        return "work tokens: " + describe_ring(self.key_ids, "mints", "verifies only")

    describe_keys = describe  # what a KeyFileWatch logs of its holders

    def holds_key_of(self, token: str) -> bool:
        """Whether the key ``token`` names is still in the ring: a token verified before a retirement, and
        remembered, is not taken on trust after it."""
        return token[len(PREFIX):].partition(".")[0] in self._keys

    def _mac(self, signed: str, key_id: str | None = None) -> bytes:
        return hmac.new(self._keys[key_id or self.key_id], signed.encode(), hashlib.sha256).digest()

    def mint(self, *, tenant: str, method: str, subject: str, key: str = "", work: str, model: str,
             lifetime_s: float, work_id: str = "", now: float | None = None) -> str:  # fmt: skip
        issued = int(time.time() if now is None else now)
        claims = {"t": tenant, "m": method, "s": subject, "w": work, "n": model, "i": issued,
                  "e": issued + int(lifetime_s) + 1}  # fmt: skip
        if key:
            claims["k"] = key
        if work_id:
            claims["j"] = work_id
        signed = f"{PREFIX}{self.key_id}.{_b64(orjson.dumps(claims))}"
        return f"{signed}.{_b64(self._mac(signed))}"

    def verify(self, token: str, now: float | None = None) -> WorkClaims:
        """The token's claims; :class:`TokenError` when it is malformed, from another key, altered or expired."""
        signed, _, mac = token.rpartition(".")
        parts = signed[len(PREFIX):].split(".")
        if not token.startswith(PREFIX) or len(parts) != 2:
            raise TokenError("work token is malformed")
        key_id, payload = parts
        if key_id not in self._keys and self.refresh is not None:
            self.refresh()  # another gateway may have minted it under a key this one has not read yet
        if key_id not in self._keys:
            raise TokenError(f"work token was minted under credential key {key_id[:8]!r}, which this gateway does "
                             "not hold (another installation's, or retired)")
        try:
            given = _unb64(mac)
        except (ValueError, binascii.Error):
            raise TokenError("work token is malformed") from None
        if not hmac.compare_digest(given, self._mac(signed, key_id)):
            raise TokenError("work token's signature does not match: it was altered")
        try:
            raw = orjson.loads(_unb64(payload))
            claims = WorkClaims(str(raw["t"]), str(raw["m"]), str(raw.get("s", "")), str(raw.get("k", "")),
                                str(raw["w"]), str(raw["n"]), int(raw["i"]), int(raw["e"]),
                                str(raw.get("j", "")))  # fmt: skip
        except (ValueError, KeyError, TypeError, binascii.Error, orjson.JSONDecodeError):
            raise TokenError("work token's claims are malformed") from None
        if (time.time() if now is None else now) >= claims.expires_at:
            raise TokenError(f"work token expired (the {claims.work} work it was minted for outlived its window)")
        return claims


class EndedWork:
    """The batch jobs that have ended, as this gateway last read them: their tokens are refused.

    The job store records each job it ends (:meth:`aiworks.batch.jobs.JobStore.ended_since`) until the
    job's token would have expired anyway; the gateway reads what was added every second or so
    (``services/gateway/server.py``) and :meth:`note` s it here, so the synchronous authentication path
    checks a set, not Redis. Bounded by the store: the jobs ended within their tokens' lifetimes.
    """

    def __init__(self) -> None:
        self._ended: dict[str, float] = {}  # job id -> when its token expires (Unix seconds)
        self._soonest = float("inf")  # the earliest of those: nothing to drop before it
        self.read_to = 0.0  # the latest end the store reported: the next read starts a little before it

    def __contains__(self, work_id: str) -> bool:
        return work_id in self._ended

    def __len__(self) -> int:
        return len(self._ended)

    def note(self, ended: list[tuple[str, float, float]], now: float | None = None) -> None:
        """Take ``(job id, when it ended, when its token expires)`` entries; drop those whose tokens expired."""
        for work_id, ended_at, expires_at in ended:
            self._ended[work_id] = expires_at
            self._soonest = min(self._soonest, expires_at)
            self.read_to = max(self.read_to, ended_at)
        now = time.time() if now is None else now
        if now >= self._soonest:  # a pass over the entries only when one of them is due
            self._ended = {k: v for k, v in self._ended.items() if v > now}
            self._soonest = min(self._ended.values(), default=float("inf"))
