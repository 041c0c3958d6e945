"""The Open Inference Protocol's HTTP/REST body: JSON tensors and binary tensor data.

Requests may carry tensors as JSON ``data`` or, with Triton's binary tensor
data extension, as raw bytes after a JSON header whose length the
``Inference-Header-Content-Length`` header gives. Binary inputs are sliced out
of the body as memoryviews: no copy is made here.

Parsing is in two steps, so a hostile body costs no more than its header
until the caller is known to be allowed (docs/security.md, "Hostile input"):
:func:`parse_infer_header` reads the JSON (refusing, before parsing, a body
that holds more values than ``max_listed_values``) and each input's name,
datatype and shape; the :class:`~aiworks.core.inference.PendingInputs` it
returns decodes the tensor data later, once the data plane has checked the
caps. JSON ``data`` may be flat or nested as the shape is (the protocol's
"natural multi-dimensional representation", or nested along the leading dims
only, as Triton accepts); it is walked once, level by level, and the walk
stops at the first list whose length or nesting does not fit the shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import orjson

from aiworks.core.datatypes import (
    DATATYPES,
    NUMPY_DTYPES,
    Tensor,
    check_raw_input,
    check_shape,
    element_count,
    encode,
    serialize_items,
)
from aiworks.core.errors import AIWorksError, InvalidArgument, Status
from aiworks.core.inference import InferRequest, InferResponse, PendingInputs
from aiworks.gateway.filters import MAX_PARAMETERS, InputLimits, class_count
from aiworks.gateway.shared_memory import BYTE_SIZE, REGION, ShmRef, shm_ref

HEADER_LENGTH = "inference-header-content-length"
# The bytes a shared memory reference names, for the input it is named by (shared_memory.py).
ShmView = Callable[[ShmRef, str], memoryview]
JSON_DEPTH_LIMIT = 1024  # orjson's own limit; deeper documents are refused by the parser itself
_SCALARS = (str, int, float, bool)
_DEFAULT_LIMITS = InputLimits()


# The OIP inference request as a JSON Schema, for the OpenAPI document (clients and fuzzers read it there).
_PARAMETERS_SCHEMA = {
    "type": "object",
    "description": "Key/value parameters: each value a string, number or boolean.",
    "additionalProperties": {"type": ["string", "number", "boolean"]},
}
INFER_REQUEST_SCHEMA = {
    "title": "InferenceRequest",
    "description": "Open Inference Protocol inference request; with Inference-Header-Content-Length, the JSON "
    "header of a body that carries binary tensor data after it.",
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "id": {"type": "string"},
        "parameters": _PARAMETERS_SCHEMA,
        "inputs": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "required": ["name", "shape", "datatype"],
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                    "datatype": {"type": "string", "enum": sorted(DATATYPES)},
                    "parameters": _PARAMETERS_SCHEMA,
                    "data": {
                        "type": "array",
                        "description": "Tensor elements in row-major order: flat, or nested as the shape is.",
                        "items": {"type": ["number", "string", "boolean", "array"]},
                    },
                },
            },
        },
        "outputs": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name"],
                "properties": {"name": {"type": "string"}, "parameters": _PARAMETERS_SCHEMA},
            },
        },
    },
}


CHALLENGE = 'Bearer realm="aiworks"'


def error_headers(exc: AIWorksError) -> dict[str, str] | None:
    """What every HTTP front adds to an error: Retry-After on a 429 or 503 that has a hint (whole seconds, rounded
    up), WWW-Authenticate on a 401."""
    if exc.retry_after_s is not None:
        return {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    if exc.status is Status.UNAUTHENTICATED:
        return {"WWW-Authenticate": CHALLENGE}
    return None


@dataclass
class OutputFormat:
    """Which outputs the client wants as binary data."""

    default_binary: bool = False
    binary: dict[str, bool] = field(default_factory=dict)
    # Outputs the client placed in system shared memory: the response names the region, with no data.
    shm: dict[str, ShmRef] = field(default_factory=dict)

    def is_binary(self, name: str) -> bool:
        return self.binary.get(name, self.default_binary)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidArgument(message)


def _shape(value, where: str, name: str) -> tuple[int, ...]:
    _require(type(value) is list, f"{where}: 'shape' must be a list of integers")
    return check_shape(value, name)


def _parameters(value, where: str) -> dict:
    """An OIP ``$parameters`` object: string, number or boolean values (as Triton accepts)."""
    if value is None:
        return {}
    _require(type(value) is dict, f"{where}'parameters' must be an object")
    _require(len(value) <= MAX_PARAMETERS, f"{where}'parameters' has {len(value)} entries; at most {MAX_PARAMETERS}")
    for key, item in value.items():
        _require(
            isinstance(item, _SCALARS),
            f"{where}parameter '{key[:64]}' must be a string, number or boolean, not {type(item).__name__}",
        )
    return value


def _walk(data, shape: tuple[int, ...], count: int, where: str) -> list:
    """JSON ``data`` as one flat list of ``count`` items, walked once and only as deep as the shape goes.

    Flat data is taken as it is. Nested data is walked level by level: at
    each level every item must be a list, as long as its dim (or, when the
    data stops nesting there, as long as all the dims left together); the
    first that is not ends the walk. Items deeper than the shape allows are
    left for the caller's type check to refuse, so nothing is walked twice.
    """
    _require(type(data) is list, f"{where}: 'data' must be a list")
    if not data or type(data[0]) is not list:
        _require(len(data) == count, f"{where}: 'data' has {len(data)} elements, but the shape needs {count}")
        return data
    rank = len(shape)
    level = [data]
    for depth in range(rank):
        spans = element_count(shape[depth:])
        nested = depth < rank - 1 and shape[depth] > 0 and bool(level[0]) and type(level[0][0]) is list
        want = shape[depth] if nested else spans
        for item in level:
            if type(item) is not list:
                raise InvalidArgument(f"{where}: 'data' nests {depth} levels deep where the shape {list(shape)} has a list")
            if len(item) != want:
                raise InvalidArgument(
                    f"{where}: 'data' has a list of {len(item)} at depth {depth}, but shape {list(shape)} needs {want}"
                )
        level = list(chain.from_iterable(level))
        if not nested:
            return level
    raise InvalidArgument(f"{where}: 'data' nests deeper than shape {list(shape)}")  # a rank-0 shape with lists


def decode_json_data(data, datatype: str, shape: tuple[int, ...], where: str) -> bytes:
    """Raw tensor bytes of JSON ``data``: one walk, one conversion; InvalidArgument naming what does not fit."""
    flat = _walk(data, shape, element_count(shape), where)
    if datatype == "BYTES":
        for x in flat:
            if type(x) is not str:
                kind = "nests deeper than the shape" if type(x) is list else f"holds a {type(x).__name__}"
                raise InvalidArgument(f"{where}: BYTES data must be strings, but 'data' {kind}")
        return serialize_items(flat)
    if datatype == "BOOL":
        for x in flat:
            if type(x) is not bool:
                kind = "nests deeper than the shape" if type(x) is list else f"holds {x!r:.40}"
                raise InvalidArgument(f"{where}: BOOL data must be true or false, but 'data' {kind}")
    try:
        array = np.asarray(flat, dtype=NUMPY_DTYPES[datatype])
    except ValueError as exc:
        if "sequence" in str(exc):
            raise InvalidArgument(f"{where}: 'data' nests deeper than shape {list(shape)}") from None
        raise InvalidArgument(f"{where}: 'data' does not hold {datatype} values") from None
    except (TypeError, OverflowError):
        raise InvalidArgument(f"{where}: 'data' does not hold {datatype} values") from None
    if array.ndim != 1:  # lists of one element each, below the last dim
        raise InvalidArgument(f"{where}: 'data' nests deeper than shape {list(shape)}")
    return encode(array, datatype)


def _binary(raw: memoryview, datatype: str, shape: tuple[int, ...], name: str):
    def check() -> memoryview:
        check_raw_input(raw, datatype, shape, name)
        return raw

    return check


def _json(data, datatype: str, shape: tuple[int, ...], where: str):
    return lambda: decode_json_data(data, datatype, shape, where)


def _load_json(view: memoryview, limits: InputLimits):
    # Every JSON value but the first in a container follows a comma, and every container opens with a
    # bracket: their count bounds the values orjson would build, at memchr speed. Small bodies cannot
    # hold many values (each takes at least two bytes), so they are not counted.
    if limits.max_listed_values is not None and len(view) > 2 * limits.max_listed_values:
        raw = view.tobytes() if not isinstance(view.obj, bytes) or len(view) != len(view.obj) else view.obj
        bound = raw.count(b",") + raw.count(b"[") + raw.count(b"{") + 1
        limits.check_listed(bound, "the request's JSON")
    try:
        return orjson.loads(view)
    except orjson.JSONDecodeError as exc:
        if "depth limit" in str(exc):
            raise InvalidArgument(
                f"malformed JSON in request body: it nests deeper than {JSON_DEPTH_LIMIT} levels"
            ) from None
        raise InvalidArgument(f"malformed JSON in request body: {exc}") from None


def parse_infer_header(
    body: bytes, header_length: str | None, model: str, version: str, limits: InputLimits = _DEFAULT_LIMITS,
    shm: ShmView | None = None,
) -> tuple[InferRequest, OutputFormat, PendingInputs]:
    """Parse an ``infer`` body's header: the request (inputs not decoded yet), the output format, the decoder.

    ``shm`` gives the bytes an input's shared memory parameters name (a slice
    of the caller's region); without it such an input is refused.
    """
    view = memoryview(body)
    if header_length is not None:
        try:
            json_size = int(header_length) if len(header_length) <= 20 else -1
        except ValueError:
            json_size = None
        _require(json_size is not None, f"Inference-Header-Content-Length '{header_length[:40]}' is not an integer")
        _require(
            0 < json_size <= len(body),
            f"Inference-Header-Content-Length is {header_length[:40]}, but the body has {len(body)} bytes",
        )
    else:
        json_size = len(body)
    doc = _load_json(view[:json_size], limits)
    _require(type(doc) is dict, "request body must be a JSON object")
    inputs = doc.get("inputs")
    _require(type(inputs) is list and inputs, "request must have a non-empty 'inputs' list")
    requested = doc.get("outputs") or []
    _require(type(requested) is list, "'outputs' must be a list")
    limits.check_tensor_count(len(inputs), len(requested))
    params = _parameters(doc.get("parameters"), "")

    binary = view[json_size:]
    offset = 0
    tensors = []
    decoders = []
    slow = 0
    for i, item in enumerate(inputs):
        _require(type(item) is dict, f"inputs[{i}] must be an object")
        name = item.get("name")
        _require(type(name) is str and name, f"inputs[{i}] needs a 'name'")
        where = f"input '{name}'"
        datatype = item.get("datatype")
        _require(type(datatype) is str and datatype in DATATYPES, f"{where}: unknown datatype {datatype!r:.40}")
        shape = _shape(item.get("shape"), where, name)
        iparams = _parameters(item.get("parameters"), f"{where}: ")
        size = iparams.get("binary_data_size")
        ref = shm_ref(iparams, where)
        if ref is not None:
            _require(size is None and "data" not in item, f"{where}: shared memory input with data in the body")
            _require(shm is not None, f"{where}: shared memory is not available here")
            decoders.append(_binary(shm(ref, where), datatype, shape, name))
            if datatype == "BYTES":
                slow += element_count(shape)
        elif size is not None:
            _require(
                type(size) is int and size >= 0, f"{where}: binary_data_size must be a non-negative integer"
            )
            _require(
                offset + size <= len(binary),
                f"{where}: binary_data_size {size} runs past the end of the body's binary data "
                f"({len(binary) - offset} bytes left)",
            )
            decoders.append(_binary(binary[offset : offset + size], datatype, shape, name))
            offset += size
            if datatype == "BYTES":
                slow += element_count(shape)
        else:
            _require("data" in item, f"{where}: needs 'data' or parameters.binary_data_size")
            decoders.append(_json(item["data"], datatype, shape, where))
            slow += element_count(shape)
        tensors.append(Tensor(name, datatype, shape))
    _require(
        offset == len(binary),
        f"the body carries {len(binary)} bytes of binary data, but the inputs declare {offset}",
    )

    fmt = OutputFormat(default_binary=bool(params.get("binary_data_output", False)))
    outputs = []
    classification = {}
    for i, item in enumerate(requested):
        _require(type(item) is dict and type(item.get("name")) is str, f"outputs[{i}] needs a 'name'")
        outputs.append(item["name"])
        oparams = _parameters(item.get("parameters"), f"outputs[{i}]: ")
        if "classification" in oparams:
            classification[item["name"]] = class_count(oparams["classification"], item["name"])
        ref = shm_ref(oparams, f"output '{item['name'][:64]}'")
        if ref is not None:
            _require(not oparams.get("binary_data"), f"output '{item['name'][:64]}': shared memory and binary_data")
            fmt.shm[item["name"]] = ref
        elif "binary_data" in oparams:
            fmt.binary[item["name"]] = bool(oparams["binary_data"])
    request_id = doc.get("id", "")
    _require(type(request_id) is str, "'id' must be a string")
    request = InferRequest(
        model, version, tensors, outputs, id=request_id, parameters=params, classification=classification
    )

    def decode() -> None:
        for tensor, fill in zip(tensors, decoders):
            tensor.raw = fill()

    return request, fmt, PendingInputs(decode, slow)


def parse_infer_request(
    body: bytes, header_length: str | None, model: str, version: str, limits: InputLimits = _DEFAULT_LIMITS
) -> tuple[InferRequest, OutputFormat]:
    """Parse an ``infer`` body into a decoded request and the wanted output format (header, caps, then data)."""
    request, fmt, pending = parse_infer_header(body, header_length, model, version, limits)
    limits.check_shapes(request)
    pending.decode()
    return request, fmt


def _json_data(tensor: Tensor) -> list:
    array = tensor.to_numpy().ravel()
    if tensor.datatype == "BYTES":
        return [x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x) for x in array]
    return array.tolist()


def encode_infer_response(response: InferResponse, fmt: OutputFormat) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary data follows."""
    outputs = []
    chunks = []
    for t in response.outputs:
        out = {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
        ref = fmt.shm.get(t.name)
        if ref is not None:  # written into the region already: no data here
            out["parameters"] = {REGION: ref.region, BYTE_SIZE: len(t.raw)}
        elif fmt.is_binary(t.name):
            out["parameters"] = {"binary_data_size": len(t.raw)}
            chunks.append(t.raw)
        else:
            out["data"] = _json_data(t)
        outputs.append(out)
    doc = {"model_name": response.model, "model_version": response.version, "outputs": outputs}
    if response.id:
        doc["id"] = response.id
    if response.parameters:
        doc["parameters"] = response.parameters
    header = orjson.dumps(doc)
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)
