"""Where batch files live: a local path or an ``s3://bucket/key`` object.

Small objects (a chunk's part, an upload) are read and written whole. A job's
input and its output files can be gigabytes, so they are not: the input is
mapped (:func:`mapped`: a local file in place, an S3 object read in ranges
as it is sliced), its lines counted in blocks (:func:`count_lines`), and the
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
import time
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound, PayloadTooLarge, Status
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


def delete_tree(prefix: str) -> int:
    """Remove everything under ``prefix``: a local folder, or every S3 object whose key starts with it; how
    many files or objects there were."""
    check_url(prefix)
    if prefix.startswith("s3://"):
        client, key = _s3(prefix)
        names = [name for name, _ in client.list(key)]
        for name in names:
            client.delete(name)
        return len(names)
    folder = _local(prefix)
    count = sum(1 for p in folder.rglob("*") if p.is_file()) if folder.is_dir() else 0
    shutil.rmtree(folder, ignore_errors=True)
    return count


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


class Ranged:
    """One version of an S3 object, read in ranges as it is sliced (``obj[a:b]``: one ranged GetObject), and
    streamed in blocks (:meth:`blocks`) for a scan. Every read names the object's ETag (``If-Match``), so an
    object replaced while a job reads it is an error that says so, never a mix of two files. A read that
    fails for the endpoint (5xx, unreachable) is tried again, three times in all."""

    ATTEMPTS = 3

    def __init__(self, url: str, max_bytes: int = DEFAULT_MAX_BYTES):
        self.url = url
        self._client, self._key = _s3(url)
        self.size, self.etag = self._client.head(self._key)
        if self.size > max_bytes:
            raise PayloadTooLarge(f"{url} is larger than {max_bytes} bytes")

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, span: slice) -> bytes:
        start, stop, step = span.indices(self.size)
        if step != 1:
            raise ValueError("ranged reads take contiguous slices")
        attempt = 1
        while True:
            try:
                return self._client.read_range(self._key, start, stop, self.etag)
            except AIWorksError as exc:
                if exc.status is Status.FAILED_PRECONDITION:  # If-Match: another object under the key now
                    raise InvalidArgument(f"{self.url} was replaced while the job read it ({exc.message})") from None
                if exc.status is not Status.UNAVAILABLE or attempt == self.ATTEMPTS:
                    raise
            time.sleep(0.5 * 2 ** (attempt - 1))
            attempt += 1

    def blocks(self, size: int = _BLOCK) -> Iterator[bytes]:
        for start in range(0, self.size, size):
            yield self[start : min(start + size, self.size)]


class RangedFile(io.RawIOBase):
    """A :class:`Ranged` object as a read-only, seekable file (for pyarrow's Parquet reader: the footer, then
    each row group's column chunks, each one ranged read)."""

    def __init__(self, url: str, max_bytes: int = DEFAULT_MAX_BYTES):
        super().__init__()
        self._source = Ranged(url, max_bytes)
        self._at = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._at

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._source.size}[whence]
        self._at = max(0, base + offset)
        return self._at

    def readinto(self, buffer) -> int:
        end = min(self._source.size, self._at + len(buffer))
        if end <= self._at:
            return 0
        data = self._source[self._at : end]
        buffer[: len(data)] = data
        self._at += len(data)
        return len(data)


@contextlib.contextmanager
def mapped(url: str, max_bytes: int = DEFAULT_MAX_BYTES) -> Iterator[mmap.mmap | bytes | Ranged]:
    """The file's bytes, mapped read-only: pages come from disk as they are read, so a file of gigabytes
    costs its reader no more memory than the slices it takes. An S3 object is read in ranges as it is sliced
    (:class:`Ranged`: no copy on disk). An empty file is ``b""`` (an empty file cannot be mapped)."""
    check_url(url)
    if url.startswith("s3://"):
        source = Ranged(url, max_bytes)
        yield source if len(source) else b""
        return
    path = _local(url)
    if not path.is_file():
        raise NotFound(f"input file '{url}' does not exist")
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            yield b""
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            yield data


class Sink:
    """An object written in pieces through a file on disk; it appears, whole, at :meth:`commit`, and never
    if :meth:`abort` is called instead. Local: a temporary file beside the target, synced and renamed over
    it. S3: a temporary file, uploaded from disk (one PutObject) and removed. Blocking calls."""

    def __init__(self, url: str):
        check_url(url)
        self.url = url
        self._newlines = 0  # of what went through write(), so an upload's lines are known without reading it back
        self._last = b""
        if url.startswith("s3://"):
            self.file: BinaryIO = tempfile.TemporaryFile(prefix="aiworks-batch-output-")
        else:
            path = _local(url)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False)  # noqa: SIM115

    def write(self, data: bytes) -> None:
        self.file.write(data)
        if data:
            self._newlines += data.count(b"\n")
            self._last = data[-1:]

    @property
    def lines(self) -> int:
        """Lines written through :meth:`write`, counted as :func:`count_lines` counts them (a final newline
        ends the last line rather than starting one)."""
        return self._newlines + (1 if self._last not in (b"", b"\n") else 0)

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
