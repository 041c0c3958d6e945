"""Where batch files live: a local path or an ``s3://bucket/key`` object.

Small objects (a chunk's part, an upload) are read and written whole. A job's
input and its output files can be gigabytes, so they are not: the input is
mapped (:func:`mapped`: a local file in place, an S3 object through a
temporary file), its lines counted in blocks (:func:`count_lines`), and the
output written through a :func:`sink`, a file on disk that becomes the
object when it is complete.

S3 goes through :class:`aiworks.storage.s3.S3Client`, the storage
initializer's client, configured by the same ``AWS_*`` variables. These are
blocking calls: async callers run them with ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import io
import mmap
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from aiworks.core.errors import InvalidArgument, NotFound, PayloadTooLarge
from aiworks.storage.s3 import S3Client

DEFAULT_MAX_BYTES = 8 << 30
_BLOCK = 8 << 20  # bytes read at a time where a file is streamed


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


def blocks(url: str) -> Iterator[bytes]:
    """A file's bytes in blocks, read as they are taken (a download served without holding the file)."""
    check_url(url)
    if url.startswith("s3://"):
        client, key = _s3(url)
        yield from client.stream(key)
        return
    path = _local(url)
    if not path.is_file():
        raise NotFound(f"file '{url}' does not exist")
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            yield block


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


def delete_tree(prefix: str) -> None:
    """Remove everything under ``prefix``: a local folder, or every S3 object whose key starts with it."""
    check_url(prefix)
    if prefix.startswith("s3://"):
        client, key = _s3(prefix)
        for name, _ in list(client.list(key)):
            client.delete(name)
        return
    shutil.rmtree(_local(prefix), ignore_errors=True)


def count_lines(url: str, max_bytes: int = DEFAULT_MAX_BYTES) -> int:
    """Lines of a file, read in blocks (a final newline ends the last line rather than starting one)."""
    lines = size = 0
    last = b""
    for block in blocks(url):
        size += len(block)
        if size > max_bytes:
            raise PayloadTooLarge(f"the input file is larger than {max_bytes} bytes")
        lines += block.count(b"\n")
        last = block[-1:]
    return lines + (1 if size and last != b"\n" else 0)


def local_copy(url: str, max_bytes: int = DEFAULT_MAX_BYTES) -> BinaryIO:
    """An S3 object downloaded, in blocks, to a temporary file (gone once closed), positioned at its start."""
    client, key = _s3(url)
    f = tempfile.TemporaryFile(prefix="aiworks-batch-input-")
    try:
        client.download(key, f, max_bytes)
        f.flush()
        f.seek(0)
    except BaseException:
        f.close()
        raise
    return f


@contextlib.contextmanager
def mapped(url: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[mmap.mmap | bytes]:
    """The file's bytes, mapped read-only: pages come from disk as they are read, so a file of gigabytes
    costs its reader no more memory than the slices it takes. An S3 object is downloaded to a temporary
    file first (removed on the way out). An empty file is ``b""`` (an empty file cannot be mapped)."""
    check_url(url)
    with contextlib.ExitStack() as stack:
        if url.startswith("s3://"):
            f: BinaryIO = stack.enter_context(local_copy(url, max_bytes))
        else:
            path = _local(url)
            if not path.is_file():
                raise NotFound(f"input file '{url}' does not exist")
            f = stack.enter_context(path.open("rb"))
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        yield stack.enter_context(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))


class Sink:
    """An object written in pieces through a file on disk; it appears, whole, at :meth:`commit`, and never
    if :meth:`abort` is called instead. Local: a temporary file beside the target, synced and renamed over
    it. S3: a temporary file, uploaded from disk (one PutObject) and removed. Blocking calls."""

    def __init__(self, url: str):
        check_url(url)
        self.url = url
        if url.startswith("s3://"):
            self.file: BinaryIO = tempfile.TemporaryFile(prefix="aiworks-batch-output-")
        else:
            path = _local(url)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False)  # noqa: SIM115

    def write(self, data: bytes) -> None:
        self.file.write(data)

    def commit(self) -> int:
        """Make the object what was written; its size."""
        f = self.file
        size = f.tell()
        f.flush()
        try:
            if self.url.startswith("s3://"):
                client, key = _s3(self.url)
                f.seek(0)
                client.upload_file(key, f, size)
            else:
                os.fsync(f.fileno())
                f.close()
                os.replace(f.name, _local(self.url))
        finally:
            self.abort()
        return size

    def abort(self) -> None:
        """Drop what was written (nothing once committed)."""
        self.file.close()
        name = getattr(self.file, "name", None)
        if isinstance(name, str):
            Path(name).unlink(missing_ok=True)


@contextlib.contextmanager
def sink(url: str) -> Iterator[BinaryIO]:
    """A file to write an object into, in pieces (:class:`Sink`): committed if the block ends without an
    error, else dropped."""
    target = Sink(url)
    try:
        yield target.file
    except BaseException:
        target.abort()
        raise
    target.commit()
