"""The storage initializer: put one model, named by a storage URI, into a model repository.

A runtime pod runs this as its init container (``aiworks storage fetch``),
as KServe's storage initializer does, so the runtime starts on a filled
Triton-layout repository. Sources:

=========================  ===========================================================
``s3://bucket/prefix``     every object under the prefix (a folder), or one archive
``gs://bucket/prefix``     the same on Google Cloud Storage
``https://host/x.tar.gz``  one archive (``.tar.gz``, ``.tgz``, ``.tar``, ``.zip``)
``pvc://claim/path``       a folder on a PersistentVolumeClaim mounted under ``pvc_root``
``file:///path``           a local folder or archive (tests, hostPath)
``demo`` / ``demo://iris`` the suite's demo model of that name, built here (no download)
=========================  ===========================================================

The result is ``<repository>/<model>/`` holding ``config.pbtxt`` (when the
source has one) and the numbered version folders. A source may hold the
model folder's contents, or one folder that holds them (``iris/...``, as
``tar czf iris.tar.gz iris`` makes). The model is written to a temporary
folder and moved into place, and a marker records its URI, so a restarted
pod whose volume survived does not fetch again.
"""

from __future__ import annotations

import logging
import shutil
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound, Status

log = logging.getLogger(__name__)

MARKER = ".aiworks-source"
ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")
DEFAULT_MAX_BYTES = 20 << 30
_MODEL_NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


@dataclass(frozen=True)
class FetchResult:
    """What one fetch did."""

    model: str
    uri: str
    path: Path
    files: int
    bytes: int
    skipped: bool = False

    def as_dict(self) -> dict:
        return {
            "model": self.model, "uri": self.uri, "path": str(self.path), "files": self.files,
            "bytes": self.bytes, "skipped": self.skipped,
        }  # fmt: skip


def _check_model_name(name: str) -> None:
    if not name or name in (".", "..") or not set(name) <= _MODEL_NAME_CHARS:
        raise InvalidArgument(f"'{name}' is not a model name (letters, digits, '_', '.', '-')")


def _relative(key: str, prefix: str) -> PurePosixPath | None:
    """``key`` below ``prefix`` as a safe relative path; None for folder markers."""
    rest = key[len(prefix) :].lstrip("/")
    if not rest or rest.endswith("/"):
        return None
    path = PurePosixPath(rest)
    if path.is_absolute() or ".." in path.parts:
        raise InvalidArgument(f"object '{key}' would be written outside the model folder")
    return path


def _fetch_bucket(client, scheme: str, bucket: str, prefix: str, work: Path, max_bytes: int) -> tuple[int, int]:
    """Download one archive (extracted) or every object under ``prefix`` into ``work``."""
    if prefix.endswith(ARCHIVE_SUFFIXES):
        archive = work.parent / ("download" + _suffix(prefix))
        with archive.open("wb") as out:
            size = client.download(prefix, out, max_bytes)
        files = _extract(archive, work)
        archive.unlink()
        return files, size
    folder = prefix.rstrip("/") + "/" if prefix else ""
    files = total = 0
    for key, size in client.list(folder):
        relative = _relative(key, folder)
        if relative is None:
            continue
        total += size
        if total > max_bytes:
            raise AIWorksError(f"{scheme}://{bucket}/{folder} holds more than {max_bytes} bytes", Status.PAYLOAD_TOO_LARGE)
        target = work.joinpath(*relative.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as out:
            client.download(key, out, max_bytes)
        files += 1
    if not files:
        raise NotFound(f"no objects under {scheme}://{bucket}/{folder}")
    return files, total


def _suffix(name: str) -> str:
    return next(s for s in ARCHIVE_SUFFIXES if name.endswith(s))


def _extract(archive: Path, into: Path) -> int:
    """Unpack an archive, refusing members that would land outside ``into`` or are links and devices."""
    name = archive.name
    if name.endswith(".zip"):
        with zipfile.ZipFile(archive) as z:
            for info in z.infolist():
                if info.is_dir():
                    continue
                relative = _relative(info.filename, "")
                if relative is None or (info.external_attr >> 16) & 0o170000 == 0o120000:
                    raise InvalidArgument(f"archive member '{info.filename}' is not a plain file inside the archive")
                target = into.joinpath(*relative.parts)
                target.parent.mkdir(parents=True, exist_ok=True)
                with z.open(info) as src, target.open("wb") as out:
                    shutil.copyfileobj(src, out)
            return sum(1 for i in z.infolist() if not i.is_dir())
    try:
        with tarfile.open(archive) as tar:
            members = tar.getmembers()
            for member in members:
                if not (member.isfile() or member.isdir()):
                    raise InvalidArgument(f"archive member '{member.name}' is a link or device; only files are taken")
            # The "data" filter refuses absolute paths, '..' and special bits (PEP 706).
            tar.extractall(into, filter="data")
            return sum(1 for m in members if m.isfile())
    except tarfile.TarError as exc:
        raise InvalidArgument(f"{name} is not a readable archive: {exc}") from None


def _fetch_https(uri: str, work: Path, max_bytes: int, ca_file: str | None) -> tuple[int, int]:
    path = urllib.parse.urlsplit(uri).path
    if not path.endswith(ARCHIVE_SUFFIXES):
        raise InvalidArgument(f"{uri}: an http(s) source must be an archive ({', '.join(ARCHIVE_SUFFIXES)})")
    import ssl

    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    archive = work.parent / ("download" + _suffix(path))
    size = 0
    try:
        with urllib.request.urlopen(uri, timeout=60, context=context) as reply, archive.open("wb") as out:
            while chunk := reply.read(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise AIWorksError(f"{uri} is larger than {max_bytes} bytes", Status.PAYLOAD_TOO_LARGE)
                out.write(chunk)
    except urllib.error.HTTPError as exc:
        message = f"{uri}: the server answered {exc.code} {exc.reason}"
        raise (NotFound(message) if exc.code == 404 else AIWorksError(message, Status.UNAVAILABLE)) from None
    except (urllib.error.URLError, OSError) as exc:
        raise AIWorksError(f"{uri}: {getattr(exc, 'reason', exc)}", Status.UNAVAILABLE) from None
    files = _extract(archive, work)
    archive.unlink()
    return files, size


def _copy_local(source: Path, work: Path, what: str) -> tuple[int, int]:
    if source.is_file() and source.name.endswith(ARCHIVE_SUFFIXES):
        return _extract(source, work), source.stat().st_size
    if not source.is_dir():
        raise NotFound(f"{what} {source} is neither a folder nor an archive")
    shutil.copytree(source, work, dirs_exist_ok=True, symlinks=False)
    files = [p for p in work.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def _fetch_demo(name: str, work: Path, progress: Callable[[str], None]) -> tuple[int, int]:
    from aiworks.demo.models import DEMO_MODELS, build_demo_model

    if name not in DEMO_MODELS:
        raise NotFound(f"there is no demo model '{name}'; the demo models are {', '.join(DEMO_MODELS)}")
    build_demo_model(name, work.parent / "demo", progress=progress)
    return _copy_local(work.parent / "demo" / name, work, "demo model")


def _model_folder(work: Path, model: str) -> Path:
    """The folder in ``work`` that holds the model: itself, ``<model>/``, or its one sub-folder."""
    if (work / "config.pbtxt").is_file():
        return work
    if (work / model).is_dir():
        return work / model
    entries = [p for p in work.iterdir() if not p.name.startswith(".")]
    if len(entries) == 1 and entries[0].is_dir() and not entries[0].name.isdigit():
        return entries[0]
    if any(p.is_dir() and p.name.isdigit() for p in entries):
        return work  # version folders without a config (Triton may auto-complete one)
    found = ", ".join(sorted(p.name for p in entries)) or "nothing"
    raise InvalidArgument(
        f"the source of model '{model}' holds {found}: expected config.pbtxt and version folders (1/, 2/ ...), "
        f"or one folder holding them"
    )


def fetch_model(
    uri: str,
    model: str,
    repository: Path,
    *,
    pvc_root: Path = Path("/mnt/pvc"),
    max_bytes: int = DEFAULT_MAX_BYTES,
    ca_file: str | None = None,
    force: bool = False,
    progress: Callable[[str], None] = lambda message: None,
) -> FetchResult:
    """Fetch ``uri`` into ``repository/model``; skipped when a marker says it is there from the same URI."""
    _check_model_name(model)
    repository = Path(repository)
    target = repository / model
    marker = target / MARKER
    if not force and marker.is_file() and marker.read_text().strip() == uri:
        return FetchResult(model, uri, target, 0, 0, skipped=True)
    repository.mkdir(parents=True, exist_ok=True)
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme or ("demo" if uri == "demo" else "")
    with tempfile.TemporaryDirectory(dir=repository, prefix=f".fetch-{model}-") as tmp:
        work = Path(tmp) / "model"
        work.mkdir()
        progress(f"fetching model '{model}' from {uri}")
        if scheme in ("s3", "gs"):
            if not parts.netloc:
                raise InvalidArgument(f"{uri}: name a bucket ({scheme}://bucket/path)")
            if scheme == "s3":
                from aiworks.storage.s3 import S3Client

                client = S3Client(parts.netloc)
            else:
                from aiworks.storage.gcs import GCSClient

                client = GCSClient(parts.netloc)
            files, size = _fetch_bucket(client, scheme, parts.netloc, parts.path.lstrip("/"), work, max_bytes)
        elif scheme in ("http", "https"):
            files, size = _fetch_https(uri, work, max_bytes, ca_file)
        elif scheme == "pvc":
            relative = _relative(parts.path, "") or PurePosixPath()
            files, size = _copy_local(pvc_root / parts.netloc / relative, work, "PVC path")
        elif scheme == "file":
            files, size = _copy_local(Path(urllib.parse.unquote(parts.path)), work, "path")
        elif scheme == "demo":
            files, size = _fetch_demo(parts.netloc or model, work, progress)
        else:
            raise InvalidArgument(
                f"storage URI '{uri}': unknown scheme; use s3://, gs://, https://, pvc://, file:// or demo"
            )
        folder = _model_folder(work, model)
        (folder / MARKER).write_text(uri + "\n")
        if target.exists():
            shutil.rmtree(target)
        folder.rename(target)
    progress(f"model '{model}': {files} file(s), {size} bytes in {target}")
    return FetchResult(model, uri, target, files, size)
