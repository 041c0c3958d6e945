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

Rotating takes three steps where the processes restart one by one
(Kubernetes), because a runner must be able to open what a gateway seals
before any gateway seals under a new key:

1. ``stage``: a new random key goes in as the second line. Roll it out to
   every gateway, runner and worker; nothing is sealed under it yet.
2. ``promote``: the first two lines swap; the new key seals, the old one
   still opens. Roll it out.
3. ``retire``: every line but the first goes, once what the old key sealed
   has ended (a job's completion window and a quarter of an hour; a queued
   request's result TTL). Roll it out.

``at-once`` is ``stage`` and ``promote`` in one, for installs whose processes
all restart together (``aiworks up``, compose). After a key has leaked,
replace the file with a new one instead: what the leaked key sealed then
fails, naming the key ids, rather than keep running under it.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from aiworks.core.errors import InvalidArgument
from aiworks.security.callers import read_secret
from aiworks.security.certs import write_private_file

# What makes a credential key file, for the error that finds none.
CREDENTIAL_KEY_MAKER = "`aiworks up --tiers`, the chart's install hook or `aiworks certs --credential-key FILE`"
ROTATION_STEPS = ("stage", "promote", "retire", "at-once")
_MIN_BYTES = 16


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
    keys: list[bytes] = []
    for number, line in enumerate(data.splitlines(), 1):
        key = line.strip()
        if not key:
            continue
        if len(key) < _MIN_BYTES:
            raise InvalidArgument(f"{where}: line {number} holds {len(key)} bytes; each key needs at least {_MIN_BYTES}")
        if key not in keys:
            keys.append(key)
    if not keys:
        raise InvalidArgument(f"{where} holds no key")
    return keys


def read_keys(path: Path | str) -> list[bytes]:
    """The key ring in the credential key file at ``path``; an error naming the file (and what makes one)."""
    return parse_keys(read_secret(path, "credential key file", CREDENTIAL_KEY_MAKER), f"credential key file {path}")


def rotated(keys: list[bytes], step: str) -> list[bytes]:
    """The ring after one rotation ``step`` (:data:`ROTATION_STEPS`; the module docstring says when each)."""
    if step == "stage":
        return [keys[0], secrets.token_hex(32).encode(), *keys[1:]]
    if step == "promote":
        if len(keys) < 2:
            raise InvalidArgument("the credential key file holds one key: stage a new one before promoting it")
        return [keys[1], keys[0], *keys[2:]]
    if step == "retire":
        return keys[:1]
    if step == "at-once":
        return rotated(rotated(keys, "stage"), "promote")
    raise InvalidArgument(f"unknown rotation step {step!r}; one of {', '.join(ROTATION_STEPS)}")


def rotate_file(path: Path | str, step: str) -> list[bytes]:
    """Rotate the key file at ``path`` in place (mode 0600, replaced atomically); the new ring."""
    path = Path(path)
    keys = rotated(read_keys(path), step)
    write_private_file(path, b"".join(k + b"\n" for k in keys))
    return keys
