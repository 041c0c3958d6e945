"""Encrypted and signed model files, and the one call the runtime makes to open them.

Encryption (at rest): AES-256-GCM, or SM4-GCM where the OpenSSL build has SM4.
An encrypted file is::

    b"AIWENC" | version (1 byte) | header length (2 bytes, big-endian) | header JSON | nonce (12) | ciphertext | tag (16)

The header names the algorithm, the key id and the model's name (its file
name, or a path suffix such as ``digits/1/model.onnx``). Everything before the
nonce is GCM's associated data, so the header cannot be changed, and
:func:`open_model` checks the name against the file's own path, so an
encrypted model copied over another one is refused rather than served. The
format streams (the low-level ``Cipher`` API, not ``AESGCM``), so multi-GiB
models encrypt in constant memory and the 2 GiB one-shot limit never applies.

Signatures: Ed25519 over a manifest of every file the model reads (its
*plaintext*, its external data files, its config: ``model_manifest.py``), in
a detached ``<model>.sig`` JSON file with the signer's key id. Signing the
plaintext means one signature covers the model however it is stored.

Keys and the :class:`~aiworks.security.model_keys.Keyring` live in
``model_keys.py``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from cryptography.exceptions import InvalidSignature, InvalidTag, UnsupportedAlgorithm
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound, Status
from aiworks.security import model_manifest as manifest
from aiworks.security.certs import write_private_file
from aiworks.security.model_keys import (
    AES_256_GCM,
    ALGORITHMS,
    SM4_GCM,
    Keyring,
    data_key_id,
    key_bytes,
    public_key_id,
)

MAGIC = b"AIWENC"
FORMAT_VERSION = 1
NONCE_BYTES = 12
TAG_BYTES = 16
CHUNK_BYTES = 4 * 1024 * 1024
ENC_SUFFIX = ".enc"
SIG_SUFFIX = ".sig"
SIGNATURE_ALGORITHM = "Ed25519"
_SIG_DOMAIN = b"aiworks model signature v1\x00"
_MANIFEST_DOMAIN = b"aiworks model manifest v2\x00"
_PREFIX = struct.Struct(">6sBH")


class ModelIntegrityError(AIWorksError):
    """A model file failed decryption or signature checks; ``reason`` says which, in one word."""

    status = Status.FAILED_PRECONDITION

    def __init__(self, path: Path | str, reason: str, message: str):
        super().__init__(f"model file {path}: {message}")
        self.path = Path(path)
        self.reason = reason
        self.detail = message  # without the path, for messages that leave the server


class AlgorithmUnavailable(AIWorksError):
    """The OpenSSL build behind ``cryptography`` lacks the cipher asked for."""

    status = Status.UNIMPLEMENTED


# ---- encryption ---------------------------------------------------------------------------------


def _gcm(algorithm: str, key: bytes, nonce: bytes, tag: bytes | None = None) -> Any:
    """A GCM encryptor (no ``tag``) or decryptor (``tag`` given) for ``algorithm``."""
    if len(key) != key_bytes(algorithm):
        raise InvalidArgument(f"{algorithm} needs a {key_bytes(algorithm)}-byte key, got {len(key)} bytes")
    try:
        algo = algorithms.AES(key) if algorithm == AES_256_GCM else algorithms.SM4(key)
        cipher = Cipher(algo, modes.GCM(nonce, tag))
        return cipher.encryptor() if tag is None else cipher.decryptor()
    except UnsupportedAlgorithm:
        raise AlgorithmUnavailable(
            f"{algorithm} is unavailable: the OpenSSL build behind the cryptography package does not provide it; "
            f"use {AES_256_GCM}"
        ) from None


def sm4_available() -> bool:
    try:
        _gcm(SM4_GCM, bytes(16), bytes(NONCE_BYTES))
    except AlgorithmUnavailable:
        return False
    return True


def _header_bytes(algorithm: str, kid: str, name: str) -> bytes:
    header = json.dumps({"alg": algorithm, "kid": kid, "name": name}, sort_keys=True, separators=(",", ":")).encode()
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header)) + header


def encrypt_stream(
    src: BinaryIO, dst: BinaryIO, key: bytes, *, name: str, algorithm: str = AES_256_GCM
) -> dict[str, str]:
    """Encrypt ``src`` into ``dst`` for the model ``name``; returns the header written."""
    _check_name(name)
    nonce = os.urandom(NONCE_BYTES)
    encryptor = _gcm(algorithm, key, nonce)
    aad = _header_bytes(algorithm, data_key_id(key), name)
    encryptor.authenticate_additional_data(aad)
    dst.write(aad + nonce)
    while chunk := src.read(CHUNK_BYTES):
        dst.write(encryptor.update(chunk))
    dst.write(encryptor.finalize() + encryptor.tag)
    return {"alg": algorithm, "kid": data_key_id(key), "name": name}


def encrypt_file(
    src: Path | str, dst: Path | str | None = None, *, key: bytes, name: str | None = None, algorithm: str = AES_256_GCM
) -> Path:
    """Encrypt a model file to ``dst`` (default ``<src>.enc``), bound to ``name`` (default: its file name)."""
    src = Path(src)
    dst = Path(dst) if dst else src.with_name(src.name + ENC_SUFFIX)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        with src.open("rb") as fin, tmp.open("wb") as fout:
            if fin.read(len(MAGIC)) == MAGIC:
                raise InvalidArgument(f"{src} is already encrypted")
            fin.seek(0)
            encrypt_stream(fin, fout, key, name=name or src.name, algorithm=algorithm)
        os.replace(tmp, dst)
    except FileNotFoundError:
        raise NotFound(f"model file {src} does not exist") from None
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def _check_name(name: str) -> None:
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or ".." in parts:
        raise InvalidArgument(
            f"model name {name!r} must be a relative path such as 'model.onnx' or 'digits/1/model.onnx'"
        )


@dataclass(frozen=True)
class EncryptedHeader:
    algorithm: str
    kid: str
    name: str
    aad: bytes


def is_encrypted(data: bytes) -> bool:
    return data[: len(MAGIC)] == MAGIC


def read_header(data: bytes, path: Path | str) -> EncryptedHeader:
    if len(data) < _PREFIX.size:
        raise ModelIntegrityError(path, "tampered", "encrypted file is truncated")
    magic, version, length = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise ModelIntegrityError(path, "not-encrypted", "is not an AIWorks encrypted model")
    if version != FORMAT_VERSION:
        raise ModelIntegrityError(
            path, "unsupported", f"encrypted with format version {version}; this AIWorks reads version {FORMAT_VERSION}"
        )
    end = _PREFIX.size + length
    try:
        header = json.loads(data[_PREFIX.size : end])
        algorithm, kid, name = str(header["alg"]), str(header["kid"]), str(header["name"])
    except (ValueError, KeyError, TypeError):
        raise ModelIntegrityError(path, "tampered", "the encryption header is unreadable") from None
    if algorithm not in ALGORITHMS:
        raise ModelIntegrityError(path, "unsupported", f"encrypted with unknown algorithm {algorithm!r}")
    return EncryptedHeader(algorithm, kid, name, bytes(data[:end]))


def name_matches(path: Path | str, name: str) -> bool:
    """Whether ``name`` (``model.onnx`` or ``digits/1/model.onnx``) is the tail of ``path``, ``.enc`` ignored."""
    # abspath, not resolve(): the layout the user sees counts, not where symlinks (k8s volumes) point.
    parts = list(PurePosixPath(os.path.abspath(path)).parts)
    if parts and parts[-1].endswith(ENC_SUFFIX):
        parts[-1] = parts[-1][: -len(ENC_SUFFIX)]
    want = list(PurePosixPath(name).parts)
    return len(want) <= len(parts) and parts[-len(want) :] == want


def decrypt_bytes(data: bytes, keyring: Keyring, path: Path | str, *, name: str | None = None) -> bytes:
    """The plaintext of an encrypted model read from ``path``; ``name`` overrides the path check."""
    header = read_header(data, path)
    if name is not None:
        if header.name != name:
            raise ModelIntegrityError(path, "wrong-name", f"was encrypted for {header.name!r}, not {name!r}")
    elif not name_matches(path, header.name):
        raise ModelIntegrityError(
            path, "wrong-name", f"was encrypted for {header.name!r}; was it copied over another model?"
        )
    key = keyring.data_keys.get(header.kid)
    if key is None:
        have = ", ".join(sorted(keyring.data_keys)) or "none"
        raise ModelIntegrityError(
            path,
            "wrong-key",
            f"was encrypted with key id {header.kid}, which is not configured (key ids loaded: {have})",
        )
    body = memoryview(data)[len(header.aad) :]
    if len(body) < NONCE_BYTES + TAG_BYTES:
        raise ModelIntegrityError(path, "tampered", "encrypted file is truncated")
    nonce, ciphertext, tag = body[:NONCE_BYTES], body[NONCE_BYTES:-TAG_BYTES], body[-TAG_BYTES:]
    decryptor = _gcm(header.algorithm, key, bytes(nonce), bytes(tag))
    decryptor.authenticate_additional_data(header.aad)
    try:
        return decryptor.update(ciphertext) + decryptor.finalize()
    except InvalidTag:
        raise ModelIntegrityError(
            path, "tampered", "authentication failed: the ciphertext or its header was modified"
        ) from None


def decrypt_file(src: Path | str, dst: Path | str, keyring: Keyring, *, name: str | None = None) -> Path:
    """Decrypt to ``dst`` (mode 0600); nothing is written unless the whole file authenticates."""
    src = Path(src)
    plaintext = decrypt_bytes(_read_model(src), keyring, src, name=name)
    write_private_file(Path(dst), plaintext, 0o600)
    return Path(dst)


# ---- signatures ---------------------------------------------------------------------------------


def signature_path(model_path: Path | str) -> Path:
    """``model.onnx.sig`` for ``model.onnx`` and for ``model.onnx.enc``: the signature is of the plaintext."""
    path = Path(model_path)
    base = path.name[: -len(ENC_SUFFIX)] if path.name.endswith(ENC_SUFFIX) else path.name
    return path.with_name(base + SIG_SUFFIX)


def _signed_message(digest: bytes) -> bytes:
    return _SIG_DOMAIN + digest


def sign_bytes(plaintext: bytes, key: Ed25519PrivateKey) -> dict[str, str]:
    """A format 1 signature, of the model's plaintext alone (what earlier versions wrote; still verified)."""
    digest = hashlib.sha256(plaintext).digest()
    return {
        "alg": SIGNATURE_ALGORITHM,
        "kid": public_key_id(key.public_key()),
        "sha256": digest.hex(),
        "signature": base64.b64encode(key.sign(_signed_message(digest))).decode(),
    }


def _canonical(files: dict[str, str]) -> bytes:
    return json.dumps(files, sort_keys=True, separators=(",", ":")).encode()


def sign_manifest(files: dict[str, str], key: Ed25519PrivateKey) -> dict:
    """A format 2 signature of ``files`` (path -> SHA-256 hex, from :func:`model_manifest.build`)."""
    return {
        "format": manifest.FORMAT,
        "alg": SIGNATURE_ALGORITHM,
        "kid": public_key_id(key.public_key()),
        "files": dict(sorted(files.items())),
        "signature": base64.b64encode(key.sign(_MANIFEST_DOMAIN + _canonical(files))).decode(),
    }


def sign_file(model_path: Path | str, key: Ed25519PrivateKey, keyring: Keyring | None = None) -> Path:
    """Sign every file the model reads (decrypting it with ``keyring`` if it is encrypted); writes ``<model>.sig``."""
    path = Path(model_path)
    data = _read_model(path)
    if is_encrypted(data):
        data = decrypt_bytes(data, keyring or Keyring(), path)
    try:
        files = manifest.build(path, data)
    except manifest.ManifestError as exc:
        raise ModelIntegrityError(path, exc.reason, exc.message) from None
    sig_path = signature_path(path)
    write_private_file(sig_path, (json.dumps(sign_manifest(files, key), indent=2) + "\n").encode(), 0o644)
    return sig_path


@dataclass(frozen=True)
class Signed:
    """A verified signature: its signer and the files it covers (path -> SHA-256 hex)."""

    kid: str
    files: dict[str, str]


def verify_signature(plaintext: bytes, sig_path: Path, keyring: Keyring, model_path: Path | str) -> Signed:
    """Check ``sig_path`` against the trusted keys: its signer and what it signed (format 1: the model alone)."""
    try:
        sig = json.loads(sig_path.read_bytes())
        kid, signature = str(sig["kid"]), base64.b64decode(sig["signature"], validate=True)
        alg = sig.get("alg", SIGNATURE_ALGORITHM)
        files = sig.get("files")
        if files is not None and not (
            isinstance(files, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in files.items())
        ):
            raise ValueError("files")
    except FileNotFoundError:
        raise ModelIntegrityError(
            model_path, "missing-signature", f"has no signature ({sig_path.name} is missing)"
        ) from None
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise ModelIntegrityError(model_path, "bad-signature", f"signature file {sig_path.name} is unreadable") from None
    if alg != SIGNATURE_ALGORITHM:
        raise ModelIntegrityError(model_path, "bad-signature", f"signature uses {alg!r}; only Ed25519 is accepted")
    public = keyring.trusted_keys.get(kid)
    if public is None:
        have = ", ".join(sorted(keyring.trusted_keys)) or "none"
        raise ModelIntegrityError(
            model_path, "untrusted-signer", f"is signed by key id {kid}, which is not trusted (trusted: {have})"
        )
    if files is not None:  # format 2: a manifest
        message = _MANIFEST_DOMAIN + _canonical(files)
    else:  # format 1: the model's plaintext alone
        files = {manifest.plain_name(Path(model_path)): hashlib.sha256(plaintext).hexdigest()}
        message = _signed_message(hashlib.sha256(plaintext).digest())
    try:
        public.verify(signature, message)
    except InvalidSignature:
        raise ModelIntegrityError(
            model_path, "bad-signature", f"signature does not match the model (modified after signing by key {kid})"
        ) from None
    return Signed(kid, files)


# ---- loading ------------------------------------------------------------------------------------


def _read_model(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise NotFound(f"model file {path} does not exist") from None
    except IsADirectoryError:
        raise InvalidArgument(f"model file {path} is a directory") from None


@dataclass(frozen=True)
class OpenedModel:
    """A model's plaintext and what was checked on the way.

    ``external``: its external data files, verified against the signature,
    for the backend to load from memory (empty when no signature was checked:
    the backend then reads them from the model's folder itself).
    """

    data: bytes
    encrypted: bool
    signed_by: str | None
    external: dict[str, bytes] = field(default_factory=dict)
    covered: tuple[str, ...] = ()


def open_model_checked(
    path: Path | str, keyring: Keyring, *, name: str | None = None, config_file: str = "", config_sha256: str = ""
) -> OpenedModel:
    """Read a model: decrypt it if encrypted, check its signature when trusted keys are configured.

    A signature is checked against every file the model reads
    (:mod:`model_manifest`); ``config_file``/``config_sha256`` name the config
    the caller parsed, so its digest is the one compared.
    """
    path = Path(path)
    data = _read_model(path)
    encrypted = is_encrypted(data)
    if encrypted:
        data = decrypt_bytes(data, keyring, path, name=name)
    sig_path = signature_path(path)
    if not (keyring.trusted_keys and (keyring.require_signature or sig_path.exists())):
        return OpenedModel(data, encrypted, None)
    signed = verify_signature(data, sig_path, keyring, path)
    try:
        checked = manifest.check(
            signed.files, path, data, required=keyring.require_signature,
            config_file=config_file, config_sha256=config_sha256,
        )  # fmt: skip
    except manifest.ManifestError as exc:
        raise ModelIntegrityError(path, exc.reason, exc.message) from None
    return OpenedModel(data, encrypted, signed.kid, checked.external, checked.covered)


def open_model(path: Path | str, keyring: Keyring, *, name: str | None = None) -> bytes:
    """The bytes onnxruntime should load for ``path``; raises :class:`ModelIntegrityError` naming the failure.

    Plain models pass through unless ``keyring.require_signature``. Reasons:
    ``wrong-key``, ``tampered``, ``wrong-name``, ``missing-signature``,
    ``untrusted-signer``, ``bad-signature``, ``unsupported``, and for the
    other files the model reads ``unsigned-file``, ``missing-file``,
    ``unsafe-external-data``.
    """
    return open_model_checked(path, keyring, name=name).data


def describe(path: Path | str) -> dict[str, Any]:
    """What a model file is (encrypted or not, its header, its signature file), without any key."""
    path = Path(path)
    with path.open("rb") as f:
        head = f.read(_PREFIX.size + 4096)
    info: dict[str, Any] = {"path": str(path), "encrypted": is_encrypted(head)}
    if info["encrypted"]:
        h = read_header(head, path)
        info.update(algorithm=h.algorithm, kid=h.kid, name=h.name)
    sig = signature_path(path)
    info["signature"] = str(sig) if sig.exists() else None
    return info
