"""Bad input gets a clear 4xx (or gRPC status) naming the problem, and the suite stays up."""

from __future__ import annotations

import json

import numpy as np
import pytest
import requests
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException


def post(suite, path, body, headers=None):
    return requests.post(f"{suite.base}{path}", data=body, headers=headers or {}, timeout=10)


def iris_json(**overrides):
    item = {"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [5.1, 3.5, 1.4, 0.2]}
    item.update(overrides)
    return json.dumps({"inputs": [item]})


@pytest.mark.parametrize(
    "path,body,status,message",
    [
        ("/v2/models/nope/infer", iris_json(), 400, "Request for unknown model: 'nope' is not found"),
        (
            "/v2/models/iris/versions/7/infer",
            iris_json(),
            404,
            "Request for unknown model: 'iris' version 7 is not found",
        ),
        ("/v2/models/iris/infer", iris_json(name="wrong"), 400, "unexpected input 'wrong'"),
        ("/v2/models/iris/infer", iris_json(shape=[1, 3], data=[1, 2, 3]), 400, "expects [-1, 4]"),
        ("/v2/models/iris/infer", iris_json(datatype="INT32", data=[1, 2, 3, 4]), 400, "expects FP32"),
        ("/v2/models/iris/infer", iris_json(shape=[65, 4], data=[0.0] * 260), 400, "accepts 1..64"),
        ("/v2/models/iris/infer", iris_json(shape=[2, 4]), 400, "has 4 elements, but the shape needs 8"),
        ("/v2/models/iris/infer", '{"inputs": [', 400, "malformed JSON"),
        ("/v2/models/iris/infer", "[1, 2]", 400, "must be a JSON object"),
    ],
)
def test_http_rejections(suite, path, body, status, message):
    resp = post(suite, path, body)
    assert resp.status_code == status, resp.text
    assert message in resp.json()["error"]


def test_binary_header_length_that_lies(suite):
    header = json.dumps(
        {"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "parameters": {"binary_data_size": 16}}]}
    ).encode()
    data = np.zeros(4, np.float32).tobytes()
    resp = post(suite, "/v2/models/iris/infer", header + data, {"Inference-Header-Content-Length": "9999"})
    assert resp.status_code == 400 and "Inference-Header-Content-Length is 9999" in resp.json()["error"]
    resp = post(suite, "/v2/models/iris/infer", header + data[:8], {"Inference-Header-Content-Length": str(len(header))})
    assert resp.status_code == 400 and "binary_data_size 16 runs past the end" in resp.json()["error"]


def test_oversized_body(suite):
    limit = 32 * 1024 * 1024
    resp = post(suite, "/v2/models/iris/infer", b"x" * (limit + 1))
    assert resp.status_code == 413 and "exceeds the limit" in resp.json()["error"]


def test_grpc_rejections(grpc_client):
    inp = grpcclient.InferInput("input", [1, 3], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(InferenceServerException) as err:
        grpc_client.infer("iris", [inp])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT" and "expects [-1, 4]" in err.value.message()
    with pytest.raises(InferenceServerException) as err:
        grpc_client.infer("nope", [inp])
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"  # as Triton answers a name it does not know
    assert err.value.message() == "Request for unknown model: 'nope' is not found"
    with pytest.raises(InferenceServerException) as err:
        grpc_client.infer("iris", [inp], model_version="7")
    assert err.value.status() == "StatusCode.NOT_FOUND"
    assert err.value.message().startswith("Request for unknown model: 'iris' version 7 is not found")


def test_suite_is_still_up_after_all_that(http_client, grpc_client):
    assert http_client.is_server_ready() and grpc_client.is_server_ready()
    inp = grpcclient.InferInput("input", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    assert grpc_client.infer("iris", [inp]).as_numpy("label").shape == (1, 1)
