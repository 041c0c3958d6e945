"""The runtime's gate between a model file on disk and a backend: decrypt, verify, check, or refuse.

:class:`ModelGuard` is what a runtime replica opens every ONNX model file
through. It reads the file with :func:`~aiworks.security.model_crypto.open_model_checked`
(decrypting ``model.onnx.enc`` or an encrypted ``model.onnx``, checking the
Ed25519 signature when trusted keys are configured, against every file the
model reads: its external data and its config too, ``model_manifest.py``;
refusing unsigned models when signatures are required), then checks the
owner's watermark when a watermark key is configured. The plaintext stays in
memory and goes to the backend as bytes, with the verified external data
(:meth:`ModelGuard.open_all`); it is never written to disk.

A failing model raises :class:`ModelRefused`, whose message names the file
(relative to the repository: messages reach clients) and the one-word
reason, and leaves an audit line (kind ``admin``, action
``model_refused``, the reason in ``details``). Models that pass through a
check are audited too (``model_verified``), so the audit file says which
signer and owner every served model was checked against.

:class:`ModelRefused` is deliberately not an ``AIWorksError``: the runtime's
data plane records a backend's plain exception as the model's load failure
(state UNAVAILABLE with the reason, in the repository index) and answers the
load request with the message.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from aiworks.core.errors import AIWorksError, InvalidArgument
from aiworks.security.audit import AuditLog
from aiworks.security.model_crypto import MAGIC, ModelIntegrityError, open_model_checked, signature_path
from aiworks.security.model_keys import Keyring, check_outside, load_data_key
from aiworks.security.watermark import WatermarkError, check_watermark

log = logging.getLogger(__name__)

ACTION_REFUSED = "model_refused"
ACTION_VERIFIED = "model_verified"


class ModelRefused(Exception):
    """A model file failed decryption, its signature or its watermark; ``reason`` says which, in one word."""

    def __init__(self, path: Path, reason: str, message: str):
        super().__init__(f"refused ({reason}): {message}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True)
class GuardedModel:
    """What the backend loads: ``source`` (a path, or the checked plaintext), and verified external data by name."""

    source: bytes | Path
    external: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True)
class Watermarking:
    """The owner every model's watermark must name, and the key that checks it."""

    owner: str
    key: bytes


class ModelGuard:
    """Opens model files for a backend: decrypted, signature and watermark checked, refusals audited.

    Thread-safe: backends load in worker threads. ``actor`` names this
    replica in audit lines.
    """

    def __init__(
        self,
        keyring: Keyring | None = None,
        *,
        watermark: Watermarking | None = None,
        audit: AuditLog | None = None,
        actor: str = "runtime",
        root: Path | None = None,
    ):
        self.keyring = keyring or Keyring()
        self.watermark = watermark
        self.audit = audit
        self.actor = actor
        self.root = Path(root) if root else None

    @classmethod
    def load(
        cls,
        *,
        repository: Path,
        data_key_files: Iterable[Path] = (),
        data_keys: Iterable[str] = (),
        public_key_files: Iterable[Path] = (),
        require_signature: bool = False,
        watermark_key_file: Path | None = None,
        watermark_owner: str | None = None,
        audit: AuditLog | None = None,
        actor: str = "runtime",
    ) -> ModelGuard:
        """Keys from files and values; none of the files may sit inside ``repository``."""
        keyring = Keyring.load(
            data_key_files=data_key_files,
            data_keys=data_keys,
            public_key_files=public_key_files,
            require_signature=require_signature,
            forbidden_root=repository,
        )
        watermark = None
        if watermark_key_file is not None:
            if not watermark_owner:
                raise InvalidArgument("a watermark key is configured without the owner its watermarks must name")
            check_outside(Path(watermark_key_file), Path(repository))
            watermark = Watermarking(watermark_owner, load_data_key(watermark_key_file))
        return cls(keyring, watermark=watermark, audit=audit, actor=actor, root=repository)

    @property
    def checks(self) -> list[str]:
        """What this guard checks, in words (for the start-up log)."""
        found = []
        if self.keyring.data_keys:
            found.append(f"{len(self.keyring.data_keys)} data key(s)")
        if self.keyring.trusted_keys:
            need = "required" if self.keyring.require_signature else "checked when present"
            found.append(f"signatures by {len(self.keyring.trusted_keys)} trusted key(s) {need}")
        if self.watermark:
            found.append(f"watermark of {self.watermark.owner!r} required")
        return found

    def _plain_path_will_do(self, path: Path) -> bool:
        """A plaintext file with nothing to check loads from its path (external weight files keep working)."""
        if self.keyring.trusted_keys or self.watermark:
            return False
        with path.open("rb") as f:
            return f.read(len(MAGIC)) != MAGIC

    def open(self, path: Path | str, *, model: str = "", version: str = "") -> bytes | Path:
        """What the backend should load: ``path`` itself for an unprotected file, else the checked plaintext.

        Raises :class:`ModelRefused` (after an audit line) when a check fails.
        """
        return self.open_all(path, model=model, version=version).source

    def open_all(
        self, path: Path | str, *, model: str = "", version: str = "", config_file: str = "", config_sha256: str = ""
    ) -> GuardedModel:
        """:meth:`open`, with the external data files checked against the signature, for the backend to use.

        ``config_file``/``config_sha256``: the config the runtime parsed for
        this model (``ModelConfig.source_file``/``source_sha256``), which a
        signature covers too.
        """
        path = Path(path)
        try:
            if self._plain_path_will_do(path):
                return GuardedModel(path)
            opened = open_model_checked(path, self.keyring, config_file=config_file, config_sha256=config_sha256)
            owner = None
            if self.watermark is not None:
                owner = self._check_watermark(opened.data, path)
        except ModelIntegrityError as exc:
            raise self._refuse(path, exc.reason, exc.detail, model, version) from None
        except WatermarkError as exc:
            raise self._refuse(path, f"watermark-{exc.reason}", exc.message, model, version) from None
        if self.audit is not None:
            self.audit.admin(
                actor=self.actor, action=ACTION_VERIFIED, model=model or None, version=version or None,
                details={
                    "file": self._shown(path), "encrypted": opened.encrypted, "signed_by": opened.signed_by,
                    "signed_files": ", ".join(opened.covered)[:200] or None, "watermark_owner": owner,
                },
            )  # fmt: skip
        return GuardedModel(opened.data, opened.external)

    def _check_watermark(self, data: bytes, path: Path) -> str:
        assert self.watermark is not None
        try:
            proto = onnx.load_model_from_string(data)
        except Exception as exc:  # DecodeError and friends
            raise WatermarkError("unreadable", f"is not an ONNX model: {exc}") from None
        try:
            return check_watermark(proto, self.watermark.key, owner=self.watermark.owner, base_dir=path.parent).owner
        except WatermarkError:
            raise
        except AIWorksError as exc:  # a weight that cannot be read
            raise WatermarkError("unreadable", exc.message) from None

    def _shown(self, path: Path) -> str:
        """The file as the audit line names it: relative to the repository when inside it."""
        if self.root is not None:
            try:
                return str(path.resolve().relative_to(self.root.resolve()))
            except ValueError:
                pass
        return str(path)

    def _refuse(self, path: Path, reason: str, detail: str, model: str, version: str) -> ModelRefused:
        message = f"model file {self._shown(path)}: {detail}"
        refused = ModelRefused(path, reason, message)
        log.error("%s (%s)", refused, path)
        if self.audit is not None:
            details = {"reason": reason, "file": self._shown(path), "message": message[:500]}
            if signature_path(path).exists():
                details["signature_file"] = self._shown(signature_path(path))
            self.audit.admin(
                actor=self.actor, action=ACTION_REFUSED, status="refused", model=model or None,
                version=version or None, details=details,
            )  # fmt: skip
        return refused
