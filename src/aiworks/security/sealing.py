"""Callers' credentials kept for later use, sealed at rest under the installation's credential key.

A batch job and a queued asynchronous request run after the call that made
them, as their submitter, so tenancy, limits and metering apply to them as
to the call. What they run with (a work token the gateway minted,
:mod:`aiworks.security.work_tokens`; from a gateway before those, the
submitter's own ``Authorization`` value) waits in Redis until a batch runner
or a nearline worker sends it. It is stored sealed, never in clear: a Redis
dump, a replica, a backup or ``MONITOR`` shows no token and no API key.

Format of a sealed value (ASCII)::

    aiw1.<key id: 8 hex>.<base64url of nonce (12) | ciphertext | tag (16)>

AES-256-GCM, under a key derived (HKDF-SHA256) from the secret in the
credential key file, which the gateway (that seals) and the runners and
workers (that open) share and nothing else needs. The associated data is the
key id and the record the credential belongs to (the job's or the request's
id), so a sealed value copied onto another record does not open. The key id
names which key sealed a value, so a process given another key says so
rather than sending a wrong credential.

The key file holds one secret of at least 16 bytes per line: ``aiworks up``
makes one (``ensure_secret_file``), the chart's install hook keeps one in a
Secret, and ``aiworks certs --credential-key FILE`` makes one for compose.
The first line seals; the others still open what they sealed before a
rotation (:mod:`aiworks.security.keyring`), and a changed file is taken
without a restart.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from aiworks.core.errors import AIWorksError, Internal
from aiworks.security.keyring import derive, describe_ring, read_keys

PREFIX = "aiw1."
_INFO = b"aiworks credential seal v1"
_NONCE = 12


class SealError(Internal):
    """A sealed credential that this process cannot open (no key, another key, or changed)."""


def is_sealed(value: str) -> bool:
    return value.startswith(PREFIX)


class Sealer:
    """Seals under the ring's current key and opens under any of its keys (:mod:`aiworks.security.keyring`);
    ``context`` binds a sealed value to its record."""

    def __init__(self, keys: bytes | list[bytes]):
        self.reload(keys)
        self.refresh = None  # set by a KeyFileWatch: reads the file again when a value names a key not held

    def reload(self, keys: bytes | list[bytes]) -> None:
        """Take a new ring in place (:class:`aiworks.security.keyring.KeyFileWatch`); nothing awaits between
        the assignments, so a coroutine sees the old ring or the new one."""
        self._aeads = {key_id: AESGCM(key) for key_id, key in derive(keys, _INFO).items()}
        self.key_id = next(iter(self._aeads))  # the current key's: what seal() uses
        self.key_ids = tuple(self._aeads)

    @classmethod
    def from_file(cls, path: Path | str) -> Sealer:
        return cls(read_keys(path))

    def describe(self) -> str:
        """The ring for a start-up log line: key ids only, never a key."""
        return describe_ring(self.key_ids, "seals", "opens only")

    describe_keys = describe  # what a KeyFileWatch logs of its holders

    def _aad(self, key_id: str, context: str) -> bytes:
        return f"{key_id}|{context}".encode()

    def seal(self, credential: str, context: str) -> str:
        nonce = os.urandom(_NONCE)
        sealed = self._aeads[self.key_id].encrypt(nonce, credential.encode(), self._aad(self.key_id, context))
        return f"{PREFIX}{self.key_id}.{base64.urlsafe_b64encode(nonce + sealed).decode()}"

    def open(self, sealed: str, context: str) -> str:
        try:
            key_id, blob = sealed[len(PREFIX):].split(".", 1)
            raw = base64.urlsafe_b64decode(blob.encode())
        except (ValueError, binascii.Error):
            raise SealError(f"the stored credential of {context} is not a sealed value") from None
        aead = self._aeads.get(key_id)
        if aead is None and self.refresh is not None and self.refresh():  # a key this process has not read yet
            aead = self._aeads.get(key_id)
        if aead is None:
            held = ", ".join(self.key_ids)
            raise SealError(
                f"the credential of {context} was sealed under credential key {key_id[:8]}, and this process holds "
                f"key{'s' if len(self.key_ids) > 1 else ''} {held}: give it the gateway's credential key file (a "
                "retired key opens nothing)"
            )
        try:
            return aead.decrypt(raw[:_NONCE], raw[_NONCE:], self._aad(key_id, context)).decode()
        except (InvalidTag, ValueError):
            raise SealError(f"the sealed credential of {context} does not open: it was changed, or belongs to "
                            "another record") from None  # fmt: skip


def seal(sealer: Sealer | None, credential: str | None, context: str) -> str | None:
    """What a store keeps for ``credential``: sealed, or ``None`` for none; in clear only without a sealer."""
    if not credential:
        return None
    return sealer.seal(credential, context) if sealer is not None else credential


def unseal(sealer: Sealer | None, stored: str | None, context: str) -> str | None:
    """The credential a store kept: opened when sealed; a value in clear (kept by a process without a key,
    or before sealing existed) as it is."""
    if not stored:
        return None
    if not is_sealed(stored):
        return stored
    if sealer is None:
        raise SealError(f"the credential of {context} is sealed, and this process has no credential key file")
    return sealer.open(stored, context)


def load_sealer(path: str | Path | None, variable: str, what: str) -> Sealer | None:
    """A runner's or worker's sealer at start-up: ``None`` when ``path`` is unset (warned: ``what`` whose
    credential is sealed will fail); a key file that cannot be read stops the process, naming the variable."""
    if not path:
        logging.getLogger(__name__).warning(
            "no credential key file (%s): %s whose credential the gateway sealed will fail", variable, what
        )
        return None
    try:
        sealer = Sealer.from_file(path)
    except AIWorksError as exc:
        raise SystemExit(f"error: {variable}: {exc.message}") from None
    logging.getLogger(__name__).info("credential key file %s: %s", path, sealer.describe())
    return sealer
