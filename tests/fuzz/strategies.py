"""Hypothesis strategies for Open Inference Protocol requests: JSON, binary tensor bodies and gRPC messages.

Each strategy mixes requests the models accept (iris: FP32 [-1, 4]) with
near misses and garbage, so the fuzzers reach the data plane and the
scheduler as well as the parsers.
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import orjson
from hypothesis import strategies as st
from tritonclient.grpc import service_pb2 as pb

DATATYPES = ["BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
             "FP16", "FP32", "FP64", "BYTES"]  # fmt: skip
MODELS = ["iris", "digits", "nope", "", "../etc", "iris/../digits"]
ODD_NUMBERS = [0, -0.0, 1e308, -1e308, 5e-324, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, 2**53 + 1]

names = st.sampled_from(["input", "x", "input "]) | st.text(max_size=6)
datatypes = st.sampled_from(DATATYPES) | st.sampled_from(["FP99", "", "fp32", "STRING"])
dims = st.integers(0, 5) | st.sampled_from([64, 65, 2**31, 2**62, 2**63 - 1])
shapes = st.lists(dims, max_size=4)
scalars = (
    st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.integers(-(2**63), 2**64 - 1)
    | st.booleans()
    | st.text(max_size=8)
    | st.sampled_from(ODD_NUMBERS)
)
data = st.recursive(st.lists(scalars, max_size=10), lambda inner: st.lists(inner, max_size=4), max_leaves=40)
parameters = st.dictionaries(
    st.sampled_from(["priority", "timeout", "binary_data_output", "sequence_id", "x"]) | st.text(max_size=6),
    scalars | st.sampled_from(["²", "9" * 50, "realtime", "batch", "0"]),
    max_size=4,
)


@st.composite
def iris_input(draw) -> dict:
    """A valid iris input, sometimes nested, sometimes with one thing wrong."""
    rows = draw(st.integers(1, 4))
    values = draw(st.lists(st.floats(-10, 10, width=32), min_size=rows * 4, max_size=rows * 4))
    item = {"name": "input", "datatype": "FP32", "shape": [rows, 4], "data": values}
    if draw(st.booleans()):
        item["data"] = [values[i * 4 : i * 4 + 4] for i in range(rows)]
    flaw = draw(st.sampled_from([None, None, "name", "datatype", "shape", "data"]))
    if flaw is not None:
        item[flaw] = draw({"name": names, "datatype": datatypes, "shape": shapes, "data": data}[flaw])
    return item


@st.composite
def json_inputs(draw) -> dict:
    item = {"name": draw(names), "datatype": draw(datatypes), "shape": draw(shapes), "data": draw(data)}
    if draw(st.booleans()):
        item["parameters"] = draw(parameters)
    return item


@st.composite
def json_requests(draw) -> tuple[str, bytes]:
    """(model, JSON body) of an infer request."""
    doc: dict = {"inputs": draw(st.lists(iris_input() | json_inputs(), min_size=0, max_size=3))}
    if draw(st.booleans()):
        doc["parameters"] = draw(parameters)
    if draw(st.booleans()):
        doc["outputs"] = [{"name": draw(names), "parameters": {"binary_data": draw(st.booleans())}}]
    if draw(st.booleans()):
        doc["id"] = draw(st.text(max_size=8) | st.integers(-(2**70), 2**70))
    return draw(st.sampled_from(MODELS)), json.dumps(doc).encode()


@st.composite
def binary_requests(draw) -> tuple[str, bytes, dict[str, str]]:
    """(model, body, headers) with Triton's binary tensor data extension, honest or lying about sizes."""
    rows = draw(st.integers(0, 3))
    datatype = draw(st.sampled_from(["FP32", "FP32", "BYTES", "INT64", "BOOL"]))
    shape = draw(st.just([rows, 4]) | shapes)
    if datatype == "BYTES":
        items = draw(st.lists(st.binary(max_size=6), max_size=8))
        raw = b"".join(struct.pack("<I", len(i)) + i for i in items)
        if draw(st.booleans()):
            raw = raw + struct.pack("<I", draw(st.integers(0, 2**32 - 1)))  # a length prefix that lies
    else:
        raw = np.asarray(draw(st.lists(st.floats(-5, 5, width=32), min_size=rows * 4, max_size=rows * 4)),
                         np.float32).tobytes()  # fmt: skip
        if draw(st.booleans()):
            raw = draw(st.binary(max_size=40))
    size = draw(st.just(len(raw)) | st.integers(-1, 80))
    header = orjson.dumps({"inputs": [{"name": "input", "datatype": datatype, "shape": shape,
                                        "parameters": {"binary_data_size": size}}]})  # fmt: skip
    length = draw(
        st.just(str(len(header)))
        | st.sampled_from(["0", "-1", "abc", "1e3", "99999999999999999999999", "²"])
        | st.integers(0, len(header) + len(raw) + 2).map(str)
    )
    return draw(st.sampled_from(["iris", "digits", "nope"])), header + raw, {"Inference-Header-Content-Length": length}


_CONTENTS = {
    "BOOL": ("bool_contents", st.booleans()),
    "INT32": ("int_contents", st.integers(-(2**31), 2**31 - 1)),
    "INT64": ("int64_contents", st.integers(-(2**63), 2**63 - 1)),
    "UINT64": ("uint64_contents", st.integers(0, 2**64 - 1)),
    "FP32": ("fp32_contents", st.floats(width=32)),
    "FP64": ("fp64_contents", st.floats()),
    "BYTES": ("bytes_contents", st.binary(max_size=6)),
}


def _param(value) -> pb.InferParameter:
    if isinstance(value, bool):
        return pb.InferParameter(bool_param=value)
    if isinstance(value, int):
        return pb.InferParameter(int64_param=value)
    if isinstance(value, float):
        return pb.InferParameter(double_param=value)
    return pb.InferParameter(string_param=value)


grpc_parameters = st.dictionaries(
    st.sampled_from(["priority", "timeout", "sequence_id", "x"]),
    st.integers(-(2**63), 2**63 - 1) | st.floats() | st.booleans() | st.sampled_from(["²", "9" * 50, "batch", ""]),
    max_size=3,
)


@st.composite
def grpc_requests(draw) -> pb.ModelInferRequest:
    """A ModelInferRequest: typed contents or raw_input_contents, right or wrong."""
    msg = pb.ModelInferRequest(model_name=draw(st.sampled_from(MODELS)), id=draw(st.text(max_size=4)))
    raw_mode = draw(st.booleans())
    for _ in range(draw(st.integers(0, 2))):
        datatype = draw(st.sampled_from(list(_CONTENTS)) | datatypes)
        rows = draw(st.integers(0, 3))
        shape = draw(st.just([rows, 4]) | st.lists(st.integers(0, 5) | st.sampled_from([2**62, 2**63 - 1]), max_size=3))
        tensor = pb.ModelInferRequest.InferInputTensor(name=draw(names), datatype=datatype, shape=shape)
        if raw_mode:
            if datatype == "FP32" and draw(st.booleans()):
                raw = np.asarray(draw(st.lists(st.floats(-5, 5, width=32), min_size=rows * 4, max_size=rows * 4)),
                                 np.float32).tobytes()  # fmt: skip
            else:
                raw = draw(st.binary(max_size=48))
            msg.raw_input_contents.append(raw)
        elif datatype in _CONTENTS:
            field, elements = _CONTENTS[datatype]
            count = math.prod(shape) if math.prod(shape) <= 64 else draw(st.integers(0, 8))
            getattr(tensor.contents, field).extend(draw(st.lists(elements, min_size=count, max_size=count)))
        msg.inputs.append(tensor)
    for key, value in draw(grpc_parameters).items():
        msg.parameters[key].CopyFrom(_param(value))
    if draw(st.booleans()) and msg.raw_input_contents:
        msg.raw_input_contents.append(b"extra")  # more raw entries than inputs
    return msg
