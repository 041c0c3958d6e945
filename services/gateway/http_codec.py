"""The Open Inference Protocol's HTTP/REST body: JSON tensors and binary tensor data.

Requests may carry tensors as JSON ``data`` or, with Triton's binary tensor
data extension, as raw bytes after a JSON header whose length the
``Inference-Header-Content-Length`` header gives. Binary inputs are sliced out
of the body as memoryviews: no copy is made here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import orjson

from aiworks.core.datatypes import DATATYPES, NUMPY_DTYPES, Tensor, decode, element_count, encode
from aiworks.core.errors import InvalidArgument
from aiworks.core.inference import InferRequest, InferResponse

HEADER_LENGTH = "inference-header-content-length"


@dataclass
class OutputFormat:
    """Which outputs the client wants as binary data."""

    default_binary: bool = False
    binary: dict[str, bool] = field(default_factory=dict)

    def is_binary(self, name: str) -> bool:
        return self.binary.get(name, self.default_binary)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise InvalidArgument(message)


def _shape(value, where: str) -> tuple[int, ...]:
    _require(isinstance(value, list), f"{where}: 'shape' must be a list of integers")
    for d in value:
        _require(isinstance(d, int) and not isinstance(d, bool) and d >= 0, f"{where}: shape {value} has a bad dim")
    return tuple(value)


def _flatten(data, datatype: str, count: int, where: str) -> np.ndarray:
    """JSON ``data`` (flat or nested) as a flat numpy array of ``count`` elements."""
    _require(isinstance(data, list), f"{where}: 'data' must be a list")
    flat = data
    while flat and isinstance(flat[0], list):
        flat = [x for row in flat for x in (row if isinstance(row, list) else [row])]
    _require(len(flat) == count, f"{where}: 'data' has {len(flat)} elements, but the shape needs {count}")
    if datatype == "BYTES":
        for x in flat:
            _require(isinstance(x, str), f"{where}: BYTES data must be strings")
        return np.array(flat, dtype=np.object_)
    try:
        array = np.asarray(flat, dtype=NUMPY_DTYPES[datatype])
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgument(f"{where}: 'data' does not hold {datatype} values") from None
    _require(array.ndim == 1, f"{where}: 'data' must be numbers")
    if datatype == "BOOL":
        for x in flat:
            _require(isinstance(x, bool), f"{where}: BOOL data must be true or false")
    return array


def parse_infer_request(
    body: bytes, header_length: str | None, model: str, version: str
) -> tuple[InferRequest, OutputFormat]:
    """Parse an ``infer`` body into a request and the wanted output format."""
    view = memoryview(body)
    if header_length is not None:
        try:
            json_size = int(header_length)
        except ValueError:
            raise InvalidArgument(f"Inference-Header-Content-Length '{header_length}' is not an integer") from None
        _require(
            0 < json_size <= len(body),
            f"Inference-Header-Content-Length is {json_size}, but the body has {len(body)} bytes",
        )
    else:
        json_size = len(body)
    try:
        doc = orjson.loads(view[:json_size])
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"malformed JSON in request body: {exc}") from None
    _require(isinstance(doc, dict), "request body must be a JSON object")
    inputs = doc.get("inputs")
    _require(isinstance(inputs, list) and inputs, "request must have a non-empty 'inputs' list")
    params = doc.get("parameters") or {}
    _require(isinstance(params, dict), "'parameters' must be an object")

    binary = view[json_size:]
    offset = 0
    tensors = []
    for i, item in enumerate(inputs):
        _require(isinstance(item, dict), f"inputs[{i}] must be an object")
        name = item.get("name")
        _require(isinstance(name, str) and name, f"inputs[{i}] needs a 'name'")
        where = f"input '{name}'"
        datatype = item.get("datatype")
        _require(datatype in DATATYPES, f"{where}: unknown datatype {datatype!r}")
        shape = _shape(item.get("shape"), where)
        tparams = item.get("parameters") or {}
        _require(isinstance(tparams, dict), f"{where}: 'parameters' must be an object")
        size = tparams.get("binary_data_size")
        if size is not None:
            _require(isinstance(size, int) and size >= 0, f"{where}: binary_data_size must be a non-negative integer")
            _require(
                offset + size <= len(binary),
                f"{where}: binary_data_size {size} runs past the end of the body's binary data "
                f"({len(binary) - offset} bytes left)",
            )
            raw = binary[offset : offset + size]
            offset += size
            decode(raw, datatype, shape, name=name)  # checks the size matches the shape
        else:
            _require("data" in item, f"{where}: needs 'data' or parameters.binary_data_size")
            array = _flatten(item["data"], datatype, element_count(shape), where)
            raw = encode(array, datatype)
        tensors.append(Tensor(name, datatype, shape, raw))
    _require(
        offset == len(binary),
        f"the body carries {len(binary)} bytes of binary data, but the inputs declare {offset}",
    )

    fmt = OutputFormat(default_binary=bool(params.get("binary_data_output", False)))
    outputs = []
    for i, item in enumerate(doc.get("outputs") or []):
        _require(isinstance(item, dict) and isinstance(item.get("name"), str), f"outputs[{i}] needs a 'name'")
        outputs.append(item["name"])
        oparams = item.get("parameters") or {}
        if isinstance(oparams, dict) and "binary_data" in oparams:
            fmt.binary[item["name"]] = bool(oparams["binary_data"])
    request_id = doc.get("id", "")
    _require(isinstance(request_id, str), "'id' must be a string")
    request = InferRequest(model, version, tensors, outputs, id=request_id, parameters=params)
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
        if fmt.is_binary(t.name):
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
