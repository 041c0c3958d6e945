"""An owner fingerprint inside an ONNX model's ``metadata_props``.

The fingerprint is ``HMAC-SHA256(owner key, owner id + digest of the weights)``.
The weights digest covers every tensor the graph carries (initializers,
sparse initializers and tensor attributes such as ``Constant`` values,
subgraphs included) by name, type, shape and value, normalized through numpy,
so it survives re-saving (inline or external data) and changes when any
weight does. Only the key holder can produce a fingerprint that checks, and
only the key holder can check one.

What this is and is not: metadata is not hidden, and whoever has the file can
delete it. It proves that a copy still carrying the fingerprint came from the
owner with these exact weights, and :func:`check_watermark` tells a missing
fingerprint from edited weights. It does not survive fine-tuning or
re-export; that needs a watermark in the weights themselves, which changes
outputs, and onnxruntime must give byte-identical outputs here.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import numpy_helper

from aiworks.core.errors import AIWorksError, InvalidArgument, Status

OWNER_KEY = "aiworks.watermark.owner"
FINGERPRINT_KEY = "aiworks.watermark.fingerprint"
SCHEME = "hmac-sha256-v1"
_DOMAIN = b"aiworks watermark v1\x00"


class WatermarkError(AIWorksError):
    """A model's fingerprint is missing, belongs to someone else, or no longer matches its weights."""

    status = Status.FAILED_PRECONDITION

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Watermark:
    owner: str
    fingerprint: str
    weights_sha256: str


def _tensors(graph: onnx.GraphProto, scope: str = "") -> Iterator[tuple[str, onnx.TensorProto]]:
    for t in graph.initializer:
        yield f"{scope}init/{t.name}", t
    for s in graph.sparse_initializer:
        yield f"{scope}sparse/{s.values.name}/values", s.values
        yield f"{scope}sparse/{s.values.name}/indices", s.indices
    for n, node in enumerate(graph.node):
        for attr in node.attribute:
            where = f"{scope}node{n}:{node.op_type}/{attr.name}"
            if attr.type == onnx.AttributeProto.TENSOR:
                yield where, attr.t
            for i, t in enumerate(attr.tensors):
                yield f"{where}[{i}]", t
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _tensors(attr.g, f"{where}/")
            for i, g in enumerate(attr.graphs):
                yield from _tensors(g, f"{where}[{i}]/")


def weights_digest(model: onnx.ModelProto, base_dir: Path | None = None) -> str:
    """SHA-256 over every weight tensor (name, dtype, shape, values), in a stable order."""
    h = hashlib.sha256()
    for where, tensor in sorted(_tensors(model.graph), key=lambda item: item[0]):
        try:
            array = numpy_helper.to_array(tensor, base_dir=str(base_dir) if base_dir else "")
        except Exception as exc:  # external data missing, unknown dtype: name the tensor
            raise InvalidArgument(f"cannot read weight {where}: {exc}") from None
        for part in (where.encode(), str(array.dtype.str).encode(), struct.pack(f"<{array.ndim}q", *array.shape)):
            h.update(struct.pack("<Q", len(part)) + part)
        if array.dtype == object:  # string tensors
            data = b"".join(
                struct.pack("<Q", len(v)) + (v if isinstance(v, bytes) else str(v).encode()) for v in array.flat
            )
        else:
            data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
        h.update(struct.pack("<Q", len(data)) + data)
    return h.hexdigest()


def _fingerprint(owner: str, digest: str, key: bytes) -> str:
    mac = hmac.new(key, _DOMAIN + owner.encode() + b"\x00" + bytes.fromhex(digest), hashlib.sha256).hexdigest()
    return f"{SCHEME}:{mac}"


def _props(model: onnx.ModelProto) -> dict[str, str]:
    return {p.key: p.value for p in model.metadata_props}


def _set_props(model: onnx.ModelProto, values: dict[str, str]) -> None:
    kept = [(p.key, p.value) for p in model.metadata_props if p.key not in values]
    del model.metadata_props[:]
    for k, v in [*kept, *values.items()]:
        model.metadata_props.add(key=k, value=v)


def embed_watermark(
    model: onnx.ModelProto, owner: str, key: bytes, *, replace: bool = False, base_dir: Path | None = None
) -> Watermark:
    """Add the owner's fingerprint to ``model`` (in place); a different owner's mark is kept unless ``replace``."""
    if not owner or len(owner) > 256:
        raise InvalidArgument("a watermark owner id is 1 to 256 characters")
    if len(key) < 16:
        raise InvalidArgument(f"a watermark key needs at least 16 bytes, got {len(key)}")
    current = _props(model).get(OWNER_KEY)
    if current is not None and current != owner and not replace:
        raise WatermarkError(
            "other-owner", f"model already carries a watermark of owner {current!r}; pass replace=True to overwrite it"
        )
    digest = weights_digest(model, base_dir)
    mark = Watermark(owner, _fingerprint(owner, digest, key), digest)
    _set_props(model, {OWNER_KEY: owner, FINGERPRINT_KEY: mark.fingerprint})
    return mark


def check_watermark(
    model: onnx.ModelProto, key: bytes, *, owner: str | None = None, base_dir: Path | None = None
) -> Watermark:
    """The model's watermark if it is ``owner``'s (when given) and matches the weights; otherwise WatermarkError."""
    props = _props(model)
    found_owner, fingerprint = props.get(OWNER_KEY), props.get(FINGERPRINT_KEY)
    if found_owner is None or fingerprint is None:
        raise WatermarkError(
            "missing", f"model has no AIWorks watermark (metadata_props {OWNER_KEY} / {FINGERPRINT_KEY})"
        )
    if owner is not None and found_owner != owner:
        raise WatermarkError("other-owner", f"model is watermarked by {found_owner!r}, not {owner!r}")
    if not fingerprint.startswith(SCHEME + ":"):
        raise WatermarkError("unsupported", f"model's watermark uses an unknown scheme: {fingerprint.split(':')[0]!r}")
    digest = weights_digest(model, base_dir)
    expected = _fingerprint(found_owner, digest, key)
    if not hmac.compare_digest(expected, fingerprint):
        raise WatermarkError(
            "mismatch",
            f"model's watermark for owner {found_owner!r} does not match: its weights were changed, "
            "or it was marked with another key",
        )
    return Watermark(found_owner, fingerprint, digest)


def _uses_external_data(model: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for _, t in _tensors(model.graph))


def watermark_file(src: Path | str, dst: Path | str, owner: str, key: bytes, *, replace: bool = False) -> Watermark:
    """Watermark an ONNX file into ``dst`` (which may be ``src``).

    External weight files are read for the digest but neither loaded into the
    saved model nor rewritten, so ``dst`` must sit beside them.
    """
    src, dst = Path(src), Path(dst)
    model = _load(src)
    if _uses_external_data(model) and dst.resolve().parent != src.resolve().parent:
        raise InvalidArgument(f"{src} keeps its weights in external files; write the watermarked model beside it")
    mark = embed_watermark(model, owner, key, replace=replace, base_dir=src.parent)
    onnx.save_model(model, str(dst))
    return mark


def check_file(path: Path | str, key: bytes, *, owner: str | None = None) -> Watermark:
    path = Path(path)
    return check_watermark(_load(path), key, owner=owner, base_dir=path.parent)


def _load(path: Path) -> onnx.ModelProto:
    if not path.exists():
        raise InvalidArgument(f"model file {path} does not exist")
    try:
        return onnx.load_model(str(path), load_external_data=False)
    except Exception as exc:  # onnx raises DecodeError, OSError, ...
        raise InvalidArgument(f"{path} is not an ONNX model: {exc}") from None
