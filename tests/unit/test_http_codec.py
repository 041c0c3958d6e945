import json

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor, serialize_bytes
from aiworks.core.errors import InvalidArgument
from aiworks.core.inference import InferResponse
from aiworks.gateway.http_codec import OutputFormat, encode_infer_response, parse_infer_request


def binary_body(header: dict, *chunks: bytes) -> tuple[bytes, str]:
    head = json.dumps(header).encode()
    return head + b"".join(chunks), str(len(head))


def test_json_tensors_nested_and_flat():
    body = json.dumps(
        {"id": "r1", "inputs": [{"name": "x", "datatype": "FP32", "shape": [2, 2], "data": [[1, 2], [3, 4]]}]}
    ).encode()
    request, fmt = parse_infer_request(body, None, "m", "")
    assert request.id == "r1" and request.inputs[0].shape == (2, 2)
    np.testing.assert_array_equal(request.inputs[0].to_numpy(), [[1, 2], [3, 4]])
    assert not fmt.is_binary("y")


def test_binary_inputs_are_views_of_the_body():
    data = np.arange(4, dtype=np.float32).tobytes()
    header = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "parameters": {"binary_data_size": 16}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": True}}],
    }
    body, length = binary_body(header, data)
    request, fmt = parse_infer_request(body, length, "m", "2")
    assert isinstance(request.inputs[0].raw, memoryview)
    assert bytes(request.inputs[0].raw) == data
    assert request.version == "2" and request.outputs == ["y"] and fmt.is_binary("y")


@pytest.mark.parametrize(
    "body,length,message",
    [
        (b"{not json", None, "malformed JSON"),
        (b"[]", None, "must be a JSON object"),
        (b'{"inputs": []}', None, "non-empty 'inputs'"),
        (b'{"inputs": [{"name": "x", "datatype": "FP99", "shape": [1], "data": [1]}]}', None, "unknown datatype"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [2], "data": [1]}]}', None, "has 1 elements"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [-1], "data": [1]}]}', None, "bad dim"),
        (b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1], "data": ["a"]}]}', None, "does not hold FP32"),
        (b"{}", "99", "Inference-Header-Content-Length is 99"),
        (b"{}", "abc", "is not an integer"),
    ],
)
def test_malformed_requests_name_the_problem(body, length, message):
    with pytest.raises(InvalidArgument, match=message):
        parse_infer_request(body, length, "m", "")


def test_binary_size_that_lies_is_rejected():
    header = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [4], "parameters": {"binary_data_size": 64}}]}
    body, length = binary_body(header, b"\0" * 16)
    with pytest.raises(InvalidArgument, match="runs past the end"):
        parse_infer_request(body, length, "m", "")
    header["inputs"][0]["parameters"]["binary_data_size"] = 8
    body, length = binary_body(header, b"\0" * 16)
    with pytest.raises(InvalidArgument):
        parse_infer_request(body, length, "m", "")


def test_response_json_and_binary():
    out = [
        Tensor("y", "FP32", (2,), np.array([1.5, 2.5], np.float32).tobytes()),
        Tensor("s", "BYTES", (1,), serialize_bytes(np.array([b"hi"], dtype=object))),
    ]
    resp = InferResponse("m", "1", out, id="r")
    body, length = encode_infer_response(resp, OutputFormat())
    assert length is None
    doc = json.loads(body)
    assert doc["outputs"][0]["data"] == [1.5, 2.5] and doc["outputs"][1]["data"] == ["hi"] and doc["id"] == "r"

    body, length = encode_infer_response(resp, OutputFormat(binary={"y": True}))
    doc = json.loads(body[:length])
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 8
    assert np.frombuffer(body[length:], np.float32).tolist() == [1.5, 2.5]
