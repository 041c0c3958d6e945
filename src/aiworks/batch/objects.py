"""Where batch files live: a local path or an ``s3://bucket/key`` object, read and written whole.

S3 goes through :class:`aiworks.storage.s3.S3Client`, the storage
initializer's client, configured by the same ``AWS_*`` variables. These are
blocking calls: async callers run them with ``asyncio.to_thread``.
"""

from __future__ import annotations

import io
import os
import tempfile
from pathlib import Path

from aiworks.core.errors import InvalidArgument, NotFound
from aiworks.storage.s3 import S3Client

DEFAULT_MAX_BYTES = 8 << 30


def _s3(url: str) -> tuple[S3Client, str]:
    rest = url[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not bucket or not key:
        raise InvalidArgument(f"'{url}' is not s3://bucket/key")
    return S3Client(bucket), key


def check_url(url: str) -> None:
    """Refuse what is neither ``s3://bucket/key`` nor a local path."""
    if "://" in url and not url.startswith(("s3://", "file://")):
        raise InvalidArgument(f"unsupported location '{url.split('://')[0]}://'; use a local path or s3://bucket/key")
    if url.startswith("s3://"):
        _s3(url)


def _local(url: str) -> Path:
    return Path(url[len("file://") :] if url.startswith("file://") else url)


def exists(url: str) -> bool:
    check_url(url)
    if url.startswith("s3://"):
        client, key = _s3(url)
        return client.exists(key)
    return _local(url).is_file()


def read_bytes(url: str, max_bytes: int = DEFAULT_MAX_BYTES) -> bytes:
    check_url(url)
    if url.startswith("s3://"):
        client, key = _s3(url)
        out = io.BytesIO()
        client.download(key, out, max_bytes)
        return out.getvalue()
    path = _local(url)
    if not path.is_file():
        raise NotFound(f"input file '{url}' does not exist")
    return path.read_bytes()


def write_bytes(url: str, data: bytes) -> None:
    """Write ``data`` whole; a local file is replaced atomically (written beside it, then renamed)."""
    check_url(url)
    if url.startswith("s3://"):
        client, key = _s3(url)
        client.upload(key, data)
        return
    path = _local(url)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as tmp:
        tmp.write(data)
        tmp.flush()
        os.fsync(tmp.fileno())
    os.replace(tmp.name, path)


def delete(url: str) -> None:
    check_url(url)
    if url.startswith("s3://"):
        client, key = _s3(url)
        client.delete(key)
        return
    _local(url).unlink(missing_ok=True)
