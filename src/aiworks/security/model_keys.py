"""Model keys: symmetric data keys, Ed25519 signing keys, and the :class:`Keyring` the runtime loads.

Data keys are stored as one base64 line (32 bytes for AES-256, 16 for SM4),
so the same text works in a file (mode 0600) and in an environment variable.
Signing keys are PEM (PKCS#8 private, SubjectPublicKeyInfo public); a public
key may also be given as base64 of its 32 raw bytes. Key ids are short hashes:
of the public key for signers, of a domain-separated key for data keys, so an
id names a key without revealing it.

Keys never come from the model repository: a key stored next to the models it
protects protects nothing, so :func:`check_outside` refuses such a path.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from aiworks.core.errors import InvalidArgument, NotFound
from aiworks.security.certs import write_private_file

log = logging.getLogger(__name__)

AES_256_GCM = "AES-256-GCM"
SM4_GCM = "SM4-GCM"
ALGORITHMS = {AES_256_GCM: 32, SM4_GCM: 16}  # algorithm -> key bytes
_KID_DOMAIN = b"aiworks data key id v1\x00"


def data_key_id(key: bytes) -> str:
    """A short, stable id for a symmetric key that reveals nothing about it."""
    return hashlib.sha256(_KID_DOMAIN + key).hexdigest()[:16]


def public_key_id(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def generate_data_key(algorithm: str = AES_256_GCM) -> bytes:
    return os.urandom(key_bytes(algorithm))


def key_bytes(algorithm: str) -> int:
    try:
        return ALGORITHMS[algorithm]
    except KeyError:
        raise InvalidArgument(
            f"unknown model encryption algorithm {algorithm!r}; choose {', '.join(ALGORITHMS)}"
        ) from None


def write_data_key(path: Path | str, key: bytes) -> str:
    """Write a symmetric key as one base64 line, mode 0600; returns its key id."""
    write_private_file(Path(path), base64.b64encode(key) + b"\n", 0o600)
    return data_key_id(key)


def parse_data_key(text: str | bytes, source: str) -> bytes:
    """A base64 key (32 bytes for AES-256, 16 for SM4) from a file's or a variable's text."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(f"data key in {source} is not base64") from None
    if len(key) not in ALGORITHMS.values():
        raise InvalidArgument(f"data key in {source} is {len(key)} bytes; AES-256 needs 32 and SM4 needs 16")
    return key


def generate_signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def write_signing_key(path: Path | str, key: Ed25519PrivateKey) -> tuple[Path, str]:
    """Write the private key (PEM, 0600) to ``path`` and the public key to ``path``.pub; returns (pub path, key id)."""
    path = Path(path)
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    write_private_file(path, pem, 0o600)
    pub_path = path.with_name(path.name + ".pub")
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    write_private_file(pub_path, pub, 0o644)
    return pub_path, public_key_id(key.public_key())


def parse_private_key(data: bytes, source: str) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise InvalidArgument(f"signing key in {source} is not an unencrypted PEM private key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise InvalidArgument(f"signing key in {source} is {type(key).__name__}, not Ed25519")
    return key


def parse_public_key(data: bytes, source: str) -> Ed25519PublicKey:
    """An Ed25519 public key as PEM, or as base64 of its 32 raw bytes (handy in a variable)."""
    try:
        if b"-----BEGIN" in data:
            key = serialization.load_pem_public_key(data)
        else:
            key = Ed25519PublicKey.from_public_bytes(base64.b64decode(data.strip(), validate=True))
    except (ValueError, TypeError, binascii.Error, UnsupportedAlgorithm) as exc:
        raise InvalidArgument(f"public key in {source} is neither PEM nor base64 Ed25519: {exc}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise InvalidArgument(f"public key in {source} is {type(key).__name__}, not Ed25519")
    return key


def _read_key_file(path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise NotFound(f"key file {path} does not exist") from None
    except PermissionError:
        raise InvalidArgument(f"key file {path} is not readable by this process") from None
    if os.stat(path).st_mode & 0o077 and not path.name.endswith(".pub"):
        log.warning("key file %s is readable by other users; chmod 600 it", path)
    return data


def load_data_key(path: Path | str) -> bytes:
    return parse_data_key(_read_key_file(Path(path)), str(path))


def load_signing_key(path: Path | str) -> Ed25519PrivateKey:
    return parse_private_key(_read_key_file(Path(path)), str(path))


def load_public_key(path: Path | str) -> Ed25519PublicKey:
    return parse_public_key(_read_key_file(Path(path)), str(path))


@dataclass
class Keyring:
    """The data keys the runtime can decrypt with and the public keys whose signatures it trusts.

    With ``require_signature`` an unsigned model is refused; without it, a
    signature present is still checked whenever a trusted key is configured.
    """

    data_keys: dict[str, bytes] = field(default_factory=dict)
    trusted_keys: dict[str, Ed25519PublicKey] = field(default_factory=dict)
    require_signature: bool = False

    def __post_init__(self) -> None:
        if self.require_signature and not self.trusted_keys:
            raise InvalidArgument("model signatures are required but no trusted public key is configured")

    @classmethod
    def load(
        cls,
        *,
        data_key_files: Iterable[Path | str] = (),
        public_key_files: Iterable[Path | str] = (),
        data_keys: Iterable[str] = (),
        public_keys: Iterable[str] = (),
        require_signature: bool = False,
        forbidden_root: Path | str | None = None,
    ) -> Keyring:
        """Keys from files and from values (base64 data keys, PEM or base64 public keys, e.g. from variables).

        ``forbidden_root`` (the model repository) is a folder no key file may sit in.
        """
        data_key_files, public_key_files = [Path(p) for p in data_key_files], [Path(p) for p in public_key_files]
        if forbidden_root is not None:
            for path in data_key_files + public_key_files:
                check_outside(path, Path(forbidden_root))
        ring: dict[str, bytes] = {}
        for path in data_key_files:
            key = load_data_key(path)
            ring[data_key_id(key)] = key
        for i, text in enumerate(data_keys):
            key = parse_data_key(text, f"data key value #{i + 1}")
            ring[data_key_id(key)] = key
        trusted: dict[str, Ed25519PublicKey] = {}
        for path in public_key_files:
            pub = load_public_key(path)
            trusted[public_key_id(pub)] = pub
        for i, text in enumerate(public_keys):
            pub = parse_public_key(text.encode(), f"public key value #{i + 1}")
            trusted[public_key_id(pub)] = pub
        return cls(ring, trusted, require_signature)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, prefix: str = "AIWORKS_MODEL_") -> Keyring:
        """Keys named by ``<prefix>KEY`` / ``KEY_FILE`` / ``PUBLIC_KEY`` / ``PUBLIC_KEY_FILE`` (comma-separated
        lists) and ``<prefix>REQUIRE_SIGNATURE`` (1/true): for the command line; services use their Settings."""
        env = os.environ if environ is None else environ

        def items(name: str) -> list[str]:
            return [v.strip() for v in env.get(prefix + name, "").split(",") if v.strip()]

        return cls.load(
            data_key_files=items("KEY_FILE"),
            public_key_files=items("PUBLIC_KEY_FILE"),
            data_keys=items("KEY"),
            public_keys=items("PUBLIC_KEY"),
            require_signature=env.get(prefix + "REQUIRE_SIGNATURE", "").lower() in ("1", "true", "yes"),
        )


def check_outside(path: Path, root: Path) -> None:
    """Refuse a key file inside ``root``: keys travel apart from the models they protect."""
    resolved, base = path.resolve(), root.resolve()
    if resolved == base or base in resolved.parents:
        raise InvalidArgument(
            f"key file {path} is inside the model repository {root}; keep keys in a secret store or a separate folder"
        )
