"""What a model signature covers: a manifest of every file the model reads.

A signature (``<model>.sig``, format 2) signs a manifest, ``{path: SHA-256}``,
of:

- the model's plaintext, under its plain name (``model.onnx``, also for
  ``model.onnx.enc``);
- each external data file its ONNX graph names (weights kept beside the
  graph, ``weights.bin``): ONNX Runtime reads them by name from the model's
  folder, so a signature of the graph alone would let them be swapped;
- its config (``../config.pbtxt`` or ``../config.json``) when the model sits
  in a Triton layout (``<model>/<version>/model.onnx``): the config decides
  the model's inputs, batching and output masking.

Paths are relative to the model's folder. Format 1 signatures (the model
file alone) are still read: they cover nothing else, so where signatures are
required a model with a config or external data needs a format 2 one.
At load time every file the model reads is hashed once, from the bytes the
backend then gets (external data is handed to ONNX Runtime from memory), so
a file changed between the check and the load cannot slip in.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import onnx

from aiworks.core.model_config import CONFIG_FILES

FORMAT = 2
CONFIG_PREFIX = "../"
# A graph without the key "location" has no external data (nothing to parse, even for a large model).
_EXTERNAL_MARK = b"location"


class ManifestError(Exception):
    """A file the model reads is not what was signed; ``reason`` in one word, ``message`` naming the file."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def plain_name(model_path: Path) -> str:
    """The model file's name without ``.enc``: what the manifest calls it."""
    name = Path(model_path).name
    return name[: -len(".enc")] if name.endswith(".enc") else name


def _tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("t"):
                yield attribute.t
            yield from attribute.tensors
            if attribute.HasField("g"):
                yield from _tensors(attribute.g)
            for sub in attribute.graphs:
                yield from _tensors(sub)


def external_locations(plaintext: bytes) -> list[str]:
    """The external data files an ONNX model names, in order of first use (checked to stay in its folder)."""
    if _EXTERNAL_MARK not in plaintext:
        return []
    model = onnx.ModelProto()
    try:
        model.ParseFromString(plaintext)
    except Exception:  # not an ONNX model: the backend says so; it names no external file either way
        return []
    found: list[str] = []
    for tensor in _tensors(model.graph):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        parts = PurePosixPath(location).parts
        if not location or location.startswith("/") or "\\" in location or ".." in parts or "." in parts:
            raise ManifestError(
                "unsafe-external-data", f"external data location {location[:80]!r} leaves the model's folder"
            )
        if location not in found:
            found.append(location)
    return found


def config_beside(model_path: Path) -> Path | None:
    """``<model>/config.pbtxt`` (or ``.json``) for ``<model>/<version>/model.onnx``; None outside that layout."""
    version = Path(model_path).parent
    if not version.name.isdigit():
        return None
    for name in CONFIG_FILES:
        candidate = version.parent / name
        if candidate.is_file():
            return candidate
    return None


def _read_inside(folder: Path, location: str) -> bytes:
    path = folder / location
    resolved = path.resolve()
    if folder.resolve() not in resolved.parents:
        raise ManifestError("unsafe-external-data", f"external data file '{location}' resolves outside the model's folder")
    try:
        return resolved.read_bytes()
    except FileNotFoundError:
        raise ManifestError("missing-file", f"external data file '{location}' does not exist") from None
    except OSError as exc:
        raise ManifestError("missing-file", f"external data file '{location}' cannot be read ({exc.strerror})") from None


def build(model_path: Path, plaintext: bytes) -> dict[str, str]:
    """The manifest to sign for the model at ``model_path`` whose plaintext is ``plaintext``."""
    model_path = Path(model_path)
    files = {plain_name(model_path): digest(plaintext)}
    for location in external_locations(plaintext):
        files[location] = digest(_read_inside(model_path.parent, location))
    config = config_beside(model_path)
    if config is not None:
        files[CONFIG_PREFIX + config.name] = digest(config.read_bytes())
    return files


@dataclass(frozen=True)
class Checked:
    """What a check of the manifest found: the verified external data, and the files the signature covered."""

    external: dict[str, bytes]
    covered: tuple[str, ...]


def check(
    files: dict[str, str],
    model_path: Path,
    plaintext: bytes,
    *,
    required: bool,
    config_file: str = "",
    config_sha256: str = "",
) -> Checked:
    """Check every file the model reads against the signed ``files``.

    A file whose digest differs is refused (``bad-signature``); one the
    signature does not cover is refused when signatures are ``required``
    (``unsigned-file``) and passes otherwise, as an unsigned model would.
    ``config_file``/``config_sha256``: the config the runtime parsed (its
    digest is compared, so the bytes checked are the bytes used); unset, the
    config beside the model is read from disk.
    """
    model_path = Path(model_path)
    name = plain_name(model_path)
    if files.get(name) != digest(plaintext):
        raise ManifestError("bad-signature", f"signature does not match '{name}' (modified after signing)")
    reads: dict[str, tuple[str, str]] = {}  # manifest path -> (what it is, its digest now)
    external: dict[str, bytes] = {}
    for location in external_locations(plaintext):
        data = _read_inside(model_path.parent, location)
        external[location] = data
        reads[location] = ("external data file", digest(data))
    if config_file:
        reads[CONFIG_PREFIX + config_file] = ("config", config_sha256)
    else:
        config = config_beside(model_path)
        if config is not None:
            reads[CONFIG_PREFIX + config.name] = ("config", digest(config.read_bytes()))
    for path, (what, now) in reads.items():
        shown = path.removeprefix(CONFIG_PREFIX) if what == "config" else path
        signed = files.get(path)
        if signed is None:
            if required:
                raise ManifestError(
                    "unsigned-file",
                    f"{what} '{shown}' is not covered by the signature; sign the model again (`aiworks model sign`)",
                )
            continue
        if signed != now:
            raise ManifestError("bad-signature", f"{what} '{shown}' was modified after signing")
    return Checked(external, tuple(sorted(files)))
