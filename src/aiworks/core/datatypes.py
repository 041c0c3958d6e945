"""Tensor codecs: KServe v2 datatypes, numpy arrays and raw tensor bytes.

A :class:`Tensor` holds raw little-endian bytes and never decodes them unless
asked: the scheduler batches by joining bytes, and only the runtime (and the
gateway's JSON path) turns them into numpy arrays, with ``np.frombuffer`` so no
copy is made. BYTES tensors use the KServe v2 binary layout: each element is a
4-byte little-endian length followed by its bytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import numpy as np

from aiworks.core.errors import InvalidArgument

# KServe v2 datatype -> numpy dtype (little-endian). BYTES has no fixed size.
NUMPY_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype("<u1"),
    "UINT16": np.dtype("<u2"),
    "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"),
    "INT8": np.dtype("<i1"),
    "INT16": np.dtype("<i2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
    "FP16": np.dtype("<f2"),
    "FP32": np.dtype("<f4"),
    "FP64": np.dtype("<f8"),
    "BYTES": np.dtype(np.object_),
}
DATATYPES = frozenset(NUMPY_DTYPES)
_BY_NUMPY = {v: k for k, v in NUMPY_DTYPES.items() if k != "BYTES"}

# ONNX tensor element type names -> KServe v2 datatypes.
ONNX_TO_DATATYPE = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def itemsize(datatype: str) -> int:
    """Bytes per element; 0 for BYTES, whose elements vary in size."""
    if datatype == "BYTES":
        return 0
    return NUMPY_DTYPES[datatype].itemsize


# Dims travel as int64 (the gRPC protocol and the suite's protos); numpy allows at most 64 of them.
MAX_DIM = 2**63 - 1
MAX_RANK = 64


def element_count(shape) -> int:
    return math.prod(shape)


def nominal_count(shape) -> int:
    """The element count of ``shape`` with its zero dims taken as 1.

    A shape such as ``[0, 2**62]`` holds no elements, yet numpy (and every
    runtime) refuses it as too big: element caps are checked against this
    count, so such a shape is refused as a 4xx where it arrives.
    """
    return math.prod(d or 1 for d in shape)


def check_shape(shape, name: str = "tensor") -> tuple[int, ...]:
    """``shape`` as a tuple, or InvalidArgument: at most MAX_RANK dims, each an integer in [0, MAX_DIM]."""
    if len(shape) > MAX_RANK:
        raise InvalidArgument(f"input '{name}' has {len(shape)} dims; at most {MAX_RANK} are allowed")
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            shown = shape if len(shape) <= 8 else [*shape[:8], "..."]
            raise InvalidArgument(f"input '{name}': shape {shown} has a bad dim (each must be an integer 0..2^63-1)")
    return tuple(shape)


def datatype_of(array: np.ndarray) -> str:
    """The KServe v2 datatype of a numpy array."""
    if array.dtype == np.object_ or array.dtype.kind in ("S", "U"):
        return "BYTES"
    try:
        return _BY_NUMPY[array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype]
    except KeyError:
        raise InvalidArgument(f"numpy dtype {array.dtype} has no KServe v2 datatype") from None


@dataclass(slots=True)
class Tensor:
    """A named tensor whose data stays as raw bytes (bytes or a memoryview)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    raw: bytes | memoryview = b""
    parameters: dict = field(default_factory=dict)

    def to_numpy(self) -> np.ndarray:
        return decode(self.raw, self.datatype, self.shape, name=self.name)

    @classmethod
    def from_numpy(cls, name: str, array: np.ndarray) -> Tensor:
        datatype = datatype_of(array)
        return cls(name, datatype, tuple(int(d) for d in array.shape), encode(array, datatype))


def encode(array: np.ndarray, datatype: str) -> bytes:
    """Raw bytes of ``array`` in the KServe v2 binary layout."""
    if datatype == "BYTES":
        return serialize_bytes(array)
    dtype = NUMPY_DTYPES[datatype]
    if array.dtype != dtype:
        array = array.astype(dtype)
    return array.tobytes()


def decode(raw: bytes | memoryview, datatype: str, shape, *, name: str = "tensor") -> np.ndarray:
    """A numpy view of ``raw`` (no copy for fixed-size datatypes)."""
    count = element_count(shape)
    if datatype == "BYTES":
        return _reshape(deserialize_bytes(raw, count, name=name), shape, name)
    try:
        dtype = NUMPY_DTYPES[datatype]
    except KeyError:
        raise InvalidArgument(f"input '{name}': unknown datatype '{datatype}'") from None
    expected = count * dtype.itemsize
    if len(raw) != expected:
        raise InvalidArgument(
            f"input '{name}': {len(raw)} bytes of data, but shape {list(shape)} of {datatype} needs {expected}"
        )
    return _reshape(np.frombuffer(raw, dtype=dtype), shape, name)


def _reshape(array: np.ndarray, shape, name: str) -> np.ndarray:
    try:
        return array.reshape(shape)
    except ValueError:  # numpy sizes zero dims as 1, and allows at most 64 dims
        raise InvalidArgument(f"input '{name}': shape {list(shape)[:8]} is too large for an array") from None


def serialize_bytes(array: np.ndarray) -> bytes:
    """Length-prefixed serialization of a BYTES tensor (str elements become UTF-8)."""
    return serialize_items(np.asarray(array, dtype=np.object_).ravel(order="C"))


_LENGTH = struct.Struct("<I")


def serialize_items(items) -> bytes:
    """Length-prefixed serialization of an iterable of str (as UTF-8) or bytes-like elements, in one pass."""
    pack = _LENGTH.pack
    parts = []
    append = parts.append
    for item in items:
        if isinstance(item, str):
            item = item.encode("utf-8")
        elif not isinstance(item, (bytes, bytearray, memoryview)):
            item = str(item).encode("utf-8")
        append(pack(len(item)))
        append(item)
    return b"".join(parts)


def bytes_offsets(raw: bytes | memoryview, *, name: str = "tensor", limit: int | None = None) -> list[int]:
    """Start offsets of each length-prefixed element, plus the end offset.

    With ``limit``, stops as soon as the data holds more than ``limit``
    elements (InvalidArgument), so a wrong count costs no more than the right one.
    """
    view = memoryview(raw)
    offsets = [0]
    pos = 0
    end = len(view)
    unpack = _LENGTH.unpack_from
    while pos < end:
        if pos + 4 > end:
            raise InvalidArgument(f"input '{name}': BYTES data ends inside an element's length prefix")
        if limit is not None and len(offsets) > limit:
            raise InvalidArgument(f"input '{name}': more than {limit} BYTES elements, but the shape needs {limit}")
        (length,) = unpack(view, pos)
        pos += 4 + length
        if pos > end:
            raise InvalidArgument(f"input '{name}': a BYTES element's length runs past the end of the data")
        offsets.append(pos)
    return offsets


def check_bytes_count(raw: bytes | memoryview, count: int, *, name: str = "tensor") -> None:
    """InvalidArgument unless ``raw`` holds exactly ``count`` well-formed BYTES elements; builds no element."""
    view = memoryview(raw)
    pos = 0
    end = len(view)
    found = 0
    unpack = _LENGTH.unpack_from
    while pos < end:
        if found == count:
            raise InvalidArgument(f"input '{name}': more than {count} BYTES elements, but the shape needs {count}")
        if pos + 4 > end:
            raise InvalidArgument(f"input '{name}': BYTES data ends inside an element's length prefix")
        pos += 4 + unpack(view, pos)[0]
        if pos > end:
            raise InvalidArgument(f"input '{name}': a BYTES element's length runs past the end of the data")
        found += 1
    if found != count:
        raise InvalidArgument(f"input '{name}': {found} BYTES elements, but the shape needs {count}")


def check_raw_input(raw: bytes | memoryview, datatype: str, shape, name: str) -> None:
    """InvalidArgument unless an input's raw data (binary HTTP, gRPC ``raw_input_contents``, shared memory) fits
    its shape and datatype: so many well-formed BYTES elements, or so many bytes of a fixed-size type."""
    count = element_count(shape)
    if datatype == "BYTES":
        check_bytes_count(raw, count, name=name)
    elif len(raw) != count * itemsize(datatype):
        raise InvalidArgument(
            f"input '{name}': {len(raw)} bytes of data, but shape {list(shape)} of {datatype} needs "
            f"{count * itemsize(datatype)}"
        )


def deserialize_bytes(raw: bytes | memoryview, count: int, *, name: str = "tensor") -> np.ndarray:
    """An object array of the ``count`` bytes elements in ``raw``."""
    view = memoryview(raw)
    offsets = bytes_offsets(view, name=name, limit=count)
    if len(offsets) - 1 != count:
        raise InvalidArgument(f"input '{name}': {len(offsets) - 1} BYTES elements, but the shape needs {count}")
    out = np.empty(count, dtype=np.object_)
    for i in range(count):
        out[i] = bytes(view[offsets[i] + 4 : offsets[i + 1]])
    return out


def split_rows(raw: bytes | memoryview, datatype: str, shape, row_counts: list[int]) -> list[bytes | memoryview]:
    """Split a batched tensor's bytes back into per-request pieces by rows.

    Fixed-size datatypes split by arithmetic on memoryview slices (no copy);
    BYTES walks the length prefixes once.
    """
    view = memoryview(raw)
    total_rows = shape[0] if shape else 0
    if sum(row_counts) != total_rows:
        raise InvalidArgument(f"batched output has {total_rows} rows, requests asked for {sum(row_counts)}")
    per_row_elements = element_count(shape[1:])
    pieces: list[bytes | memoryview] = []
    if datatype != "BYTES":
        row_bytes = per_row_elements * itemsize(datatype)
        pos = 0
        for rows in row_counts:
            pieces.append(view[pos : pos + rows * row_bytes])
            pos += rows * row_bytes
        return pieces
    offsets = bytes_offsets(view, name="output")
    element = 0
    for rows in row_counts:
        start = offsets[element]
        element += rows * per_row_elements
        pieces.append(view[start : offsets[element]])
    return pieces
