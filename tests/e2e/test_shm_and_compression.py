"""Triton's system shared memory extension and HTTP compression, end to end with tritonclient (issue 14, items 5-6).

One suite (scheduler, one runtime, gateway) in tenancy mode, with two tenants
(alice, bob) allowed the same models, and a cap of four shared memory regions
per tenant. Models built here: ``add`` (Triton's ``simple``: INPUT0 + INPUT1
and INPUT0 - INPUT1, FP32 [16], batched) and ``identity`` (FP32 [1M]).
Regions are real POSIX shared memory objects made by
``tritonclient.utils.shared_memory``.
"""

from __future__ import annotations

import gzip
import queue
import uuid
import zlib

import numpy as np
import onnx
import orjson
import pytest
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
import yaml
from e2e_support import start_suite
from onnx import TensorProto, helper
from security.test_hostile_input import LIVE_BUDGET_S, LiveProbe, rss_mb
from tritonclient.utils import InferenceServerException

from aiworks.gateway.auth import generate_api_key

MAX_REGIONS = 4
CUDA = "CUDA shared memory is not supported by this server"


def _save(folder, graph, config: str) -> None:
    (folder / "1").mkdir(parents=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "1" / "model.onnx")
    (folder / "config.pbtxt").write_text(config + 'parameters { key: "preload" value: { string_value: "true" } }\n')


def build_repository(root):
    fp32 = TensorProto.FLOAT
    add = helper.make_graph(
        [helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
         helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"])],
        "add",
        [helper.make_tensor_value_info(n, fp32, ["N", 16]) for n in ("INPUT0", "INPUT1")],
        [helper.make_tensor_value_info(n, fp32, ["N", 16]) for n in ("OUTPUT0", "OUTPUT1")],
    )  # fmt: skip
    io = "".join(
        f'{kind} {{ name: "{name}" data_type: TYPE_FP32 dims: [ 16 ] }}\n'
        for kind, name in (("input", "INPUT0"), ("input", "INPUT1"), ("output", "OUTPUT0"), ("output", "OUTPUT1"))
    )
    _save(root / "add", add, "max_batch_size: 8\n" + io)
    identity = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "identity",
        [helper.make_tensor_value_info("x", fp32, [1 << 20])],
        [helper.make_tensor_value_info("y", fp32, [1 << 20])],
    )
    _save(
        root / "identity",
        identity,
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1048576 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1048576 ] } ]\n',
    )
    return root


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    work = tmp_path_factory.mktemp("shm")
    repository = build_repository(work / "repository")
    keys, tenants = {}, []
    for tenant in ("alice", "bob"):
        keys[tenant], digest = generate_api_key()
        tenants.append({"id": tenant, "models": ["add", "identity"], "api_keys": [digest]})
    tenants_file = work / "tenants.yaml"
    tenants_file.write_text(yaml.safe_dump({"tenants": tenants}))
    env = {
        "AIWORKS_GATEWAY_TENANTS_FILE": str(tenants_file),
        "AIWORKS_GATEWAY_SHARED_MEMORY_MAX_REGIONS": str(MAX_REGIONS),
    }
    s = start_suite(repository, work / "logs", replicas=1, cache=False, extra_env=env)
    s.keys = keys
    yield s
    s.supervisor.stop()


def auth(suite, tenant: str = "alice") -> dict[str, str]:
    return {"authorization": f"Bearer {suite.keys[tenant]}"}


@pytest.fixture
def regions():
    """Make POSIX shared memory regions; every one is destroyed after the test."""
    made = []

    def make(byte_size: int):
        key = f"/aiw_test_{uuid.uuid4().hex[:12]}"
        handle = shm.create_shared_memory_region(key.strip("/"), key, byte_size)
        made.append(handle)
        return key, handle

    yield make
    for handle in made:
        shm.destroy_shared_memory_region(handle)


@pytest.fixture
def http(suite):
    client = httpclient.InferenceServerClient(suite.http_url)
    yield client
    for tenant in ("alice", "bob"):
        client.unregister_system_shared_memory(headers=auth(suite, tenant))
    client.close()


@pytest.fixture
def grpc(suite):
    client = grpcclient.InferenceServerClient(suite.grpc_url)
    yield client
    client.close()


A = np.arange(16, dtype=np.float32).reshape(1, 16)
B = np.full((1, 16), 3.0, dtype=np.float32)


def _inputs(module, offset0: int = 0, size: int = 64, region: str = "input_data"):
    inputs = [module.InferInput("INPUT0", [1, 16], "FP32"), module.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_shared_memory(region, size, offset=offset0)
    inputs[1].set_shared_memory(region, 64, offset=64)
    return inputs


def _outputs(module, region: str = "output_data", size: int = 64):
    outputs = [module.InferRequestedOutput("OUTPUT0"), module.InferRequestedOutput("OUTPUT1")]
    outputs[0].set_shared_memory(region, size)
    outputs[1].set_shared_memory(region, size, offset=64)
    return outputs


def _register_pair(client, suite, regions, tenant="alice"):
    in_key, in_handle = regions(128)
    out_key, out_handle = regions(128)
    shm.set_shared_memory_region(in_handle, [A, B])
    client.register_system_shared_memory("input_data", in_key, 128, headers=auth(suite, tenant))
    client.register_system_shared_memory("output_data", out_key, 128, headers=auth(suite, tenant))
    return (in_key, in_handle), (out_key, out_handle)


# ---- system shared memory -------------------------------------------------------------------------------


@pytest.mark.parametrize("front", ["http", "grpc"])
def test_inputs_and_outputs_in_shared_memory(suite, http, grpc, regions, front):
    client, module = (http, httpclient) if front == "http" else (grpc, grpcclient)
    (in_key, _), (out_key, out_handle) = _register_pair(client, suite, regions)
    result = client.infer("add", _inputs(module), outputs=_outputs(module), headers=auth(suite))
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16]), A + B)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16], offset=64), A - B)
    # The response carries no data for an output in shared memory.
    if front == "http":
        out0 = result.get_output("OUTPUT0")
        assert "data" not in out0 and out0["parameters"]["shared_memory_region"] == "output_data"
    else:
        message = result.get_response()
        assert list(message.raw_output_contents) == [b"", b""] and result.get_output("OUTPUT0").shape == [1, 16]
        assert result.get_output("OUTPUT0").parameters["shared_memory_region"].string_param == "output_data"

    if front == "http":
        status = client.get_system_shared_memory_status(headers=auth(suite))
        assert sorted(status, key=lambda r: r["name"]) == [
            {"name": "input_data", "key": in_key, "offset": 0, "byte_size": 128},
            {"name": "output_data", "key": out_key, "offset": 0, "byte_size": 128},
        ]
        assert client.get_system_shared_memory_status("input_data", headers=auth(suite))[0]["key"] == in_key
    else:
        status = client.get_system_shared_memory_status(headers=auth(suite), as_json=True)["regions"]
        assert set(status) == {"input_data", "output_data"} and status["input_data"]["key"] == in_key
        one = client.get_system_shared_memory_status("output_data", headers=auth(suite), as_json=True)["regions"]
        assert list(one) == ["output_data"] and int(one["output_data"]["byte_size"]) == 128

    client.unregister_system_shared_memory("input_data", headers=auth(suite))
    names = client.get_system_shared_memory_status(headers=auth(suite))
    names = [r["name"] for r in names] if front == "http" else list(names.regions)
    assert names == ["output_data"]
    client.unregister_system_shared_memory(headers=auth(suite))
    left = client.get_system_shared_memory_status(headers=auth(suite))
    assert (left if front == "http" else list(left.regions)) == []


def test_http_response_names_the_region_and_mixes_with_binary_outputs(suite, http, regions):
    _register_pair(http, suite, regions)
    outputs = [httpclient.InferRequestedOutput("OUTPUT0"), httpclient.InferRequestedOutput("OUTPUT1", binary_data=True)]
    outputs[0].set_shared_memory("output_data", 64)
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "FP32"), httpclient.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_shared_memory("input_data", 64)
    inputs[1].set_data_from_numpy(B * 2)  # one input in shared memory, one in the body
    result = http.infer("add", inputs, outputs=outputs, headers=auth(suite))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B * 2)
    out0 = result.get_output("OUTPUT0")
    assert "data" not in out0 and out0["parameters"]["shared_memory_region"] == "output_data"


def test_grpc_mixes_shared_memory_and_raw_inputs(suite, grpc, http, regions):
    _register_pair(grpc, suite, regions)
    inputs = [grpcclient.InferInput("INPUT0", [1, 16], "FP32"), grpcclient.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(B * 5)
    inputs[1].set_shared_memory("input_data", 64)  # A
    result = grpc.infer("add", inputs, headers=auth(suite))
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), B * 5 + A)


def test_stream_infer_with_shared_memory(suite, grpc, http, regions):
    """ModelStreamInfer takes inputs from and writes outputs into the caller's regions too."""
    _, (_, out_handle) = _register_pair(grpc, suite, regions)
    answers = queue.Queue()
    grpc.start_stream(callback=lambda result, error: answers.put((result, error)), headers=auth(suite))
    try:
        grpc.async_stream_infer("add", _inputs(grpcclient), outputs=_outputs(grpcclient), request_id="s1")
        grpc.async_stream_infer("add", _inputs(grpcclient, region="nope"), request_id="s2")
        first, error = answers.get(timeout=30)
        assert error is None and first.get_response().id == "s1"
        _, error = answers.get(timeout=30)
        assert error is not None and "Unable to find system shared memory region: 'nope'" in str(error)
    finally:
        grpc.stop_stream()
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16]), A + B)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(out_handle, np.float32, [1, 16], offset=64), A - B)


def test_tenants_have_their_own_names(suite, http, regions):
    """alice and bob both register 'input_data' and 'output_data'; each reads and writes only its own."""
    _, (_, alice_out) = _register_pair(http, suite, regions, "alice")
    bob_in_key, bob_in = regions(128)
    bob_out_key, bob_out = regions(128)
    shm.set_shared_memory_region(bob_in, [A * 10, B * 10])
    http.register_system_shared_memory("input_data", bob_in_key, 128, headers=auth(suite, "bob"))
    http.register_system_shared_memory("output_data", bob_out_key, 128, headers=auth(suite, "bob"))
    http.infer("add", _inputs(httpclient), outputs=_outputs(httpclient), headers=auth(suite, "bob"))
    http.infer("add", _inputs(httpclient), outputs=_outputs(httpclient), headers=auth(suite, "alice"))
    np.testing.assert_array_equal(shm.get_contents_as_numpy(bob_out, np.float32, [1, 16]), (A + B) * 10)
    np.testing.assert_array_equal(shm.get_contents_as_numpy(alice_out, np.float32, [1, 16]), A + B)
    assert {r["key"] for r in http.get_system_shared_memory_status(headers=auth(suite, "bob"))} == {
        bob_in_key, bob_out_key
    }
    http.unregister_system_shared_memory(headers=auth(suite, "bob"))  # all of bob's, none of alice's
    assert len(http.get_system_shared_memory_status(headers=auth(suite, "alice"))) == 2


def _refused(call, *words: str, status: str = "400") -> str:
    with pytest.raises(InferenceServerException) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, message
    if status and info.value.status() is not None:
        assert str(info.value.status()) in (status, f"StatusCode.{_GRPC[status]}"), message
    return message


_GRPC = {"400": "INVALID_ARGUMENT", "401": "UNAUTHENTICATED", "429": "RESOURCE_EXHAUSTED"}


@pytest.mark.parametrize("front", ["http", "grpc"])
def test_bad_shared_memory_requests_are_refused(suite, http, grpc, regions, front):
    client, module = (http, httpclient) if front == "http" else (grpc, grpcclient)
    alice, bob = auth(suite, "alice"), auth(suite, "bob")
    (in_key, _), _ = _register_pair(client, suite, regions)

    # Out of bounds: offset + size past the registered region.
    past = _inputs(module, offset0=100)
    _refused(lambda: client.infer("add", past, headers=alice), "runs past the end", "(128 bytes)")
    # An output region too small for the output.
    _refused(
        lambda: client.infer("add", _inputs(module), outputs=_outputs(module, size=32), headers=alice),
        "more than the 32",
    )
    # Unknown region, and another tenant's region: the same answer.
    _refused(lambda: client.infer("add", _inputs(module, region="nope"), headers=alice), "Unable to find", "'nope'")
    client.register_system_shared_memory("alice_only", in_key, 128, headers=alice)
    _refused(lambda: client.infer("add", _inputs(module, region="alice_only"), headers=bob), "Unable to find")
    _refused(lambda: client.get_system_shared_memory_status("alice_only", headers=bob), "Unable to find")
    # Another tenant's key, a key that is not there, a key that walks out of /dev/shm, a region past its object.
    _refused(lambda: client.register_system_shared_memory("mine", in_key, 128, headers=bob), "Unable to open")
    _refused(lambda: client.register_system_shared_memory("x", "/aiw_absent_key", 8, headers=alice), "Unable to open")
    _refused(lambda: client.register_system_shared_memory("x", "../etc/passwd", 8, headers=alice), "POSIX")
    _refused(lambda: client.register_system_shared_memory("x", in_key, 4096, headers=alice), "runs past the end")
    _refused(lambda: client.register_system_shared_memory("input_data", in_key, 8, headers=alice), "already")
    # No credentials.
    _refused(lambda: client.get_system_shared_memory_status(), status="401")
    # CUDA shared memory, as a Triton without GPUs: nothing can be registered, so there is nothing to show and
    # unregistering (which Triton's examples do first, to clean up) does nothing.
    _refused(lambda: client.register_cuda_shared_memory("g", b"\0" * 64, 0, 64, headers=alice), CUDA)
    _refused(lambda: client.get_cuda_shared_memory_status("g", headers=alice), "Unable to find", CUDA)
    status = client.get_cuda_shared_memory_status(headers=alice)
    assert not (status.regions if hasattr(status, "regions") else status)
    client.unregister_cuda_shared_memory(headers=alice)
    client.unregister_cuda_shared_memory("g", headers=alice)
    _refused(lambda: client.unregister_cuda_shared_memory(), status="401")
    # The cap on regions per tenant (alice holds three now).
    client.register_system_shared_memory("fourth", in_key, 64, headers=alice)
    fifth = lambda: client.register_system_shared_memory("fifth", in_key, 64, headers=alice)  # noqa: E731
    _refused(fifth, "unregister", status="429")
    client.unregister_system_shared_memory(headers=alice)


def test_shared_memory_parameters_must_be_whole(suite, regions, http):
    _register_pair(http, suite, regions)
    body = {
        "inputs": [
            {"name": "INPUT0", "shape": [1, 16], "datatype": "FP32",
             "parameters": {"shared_memory_region": "input_data"}},
            {"name": "INPUT1", "shape": [1, 16], "datatype": "FP32", "data": B.ravel().tolist()},
        ]
    }
    resp = requests.post(f"{suite.base}/v2/models/add/infer", json=body, headers=auth(suite), timeout=10)
    assert resp.status_code == 400 and "needs both" in resp.json()["error"], resp.text
    body["inputs"][0]["parameters"]["shared_memory_byte_size"] = 64
    body["inputs"][0]["data"] = A.ravel().tolist()
    resp = requests.post(f"{suite.base}/v2/models/add/infer", json=body, headers=auth(suite), timeout=10)
    assert resp.status_code == 400 and "with data in the body" in resp.json()["error"], resp.text


def test_server_metadata_lists_system_shared_memory(suite, http):
    extensions = http.get_server_metadata()["extensions"]
    assert "system_shared_memory" in extensions and "cuda_shared_memory" not in extensions


# ---- HTTP compression -----------------------------------------------------------------------------------


@pytest.mark.parametrize("request_algorithm", ["gzip", "deflate", None])
@pytest.mark.parametrize("response_algorithm", ["gzip", "deflate", None])
@pytest.mark.parametrize("binary", [True, False])
def test_tritonclient_compression(suite, http, request_algorithm, response_algorithm, binary):
    inputs = [httpclient.InferInput("INPUT0", [1, 16], "FP32"), httpclient.InferInput("INPUT1", [1, 16], "FP32")]
    inputs[0].set_data_from_numpy(A, binary_data=binary)
    inputs[1].set_data_from_numpy(B, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput(n, binary_data=binary) for n in ("OUTPUT0", "OUTPUT1")]
    result = http.infer(
        "add", inputs, outputs=outputs, headers=auth(suite),
        request_compression_algorithm=request_algorithm, response_compression_algorithm=response_algorithm,
    )  # fmt: skip
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), A + B)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), A - B)


def _binary_body() -> tuple[bytes, int]:
    header = orjson.dumps({
        "inputs": [{"name": n, "shape": [1, 16], "datatype": "FP32", "parameters": {"binary_data_size": 64}}
                   for n in ("INPUT0", "INPUT1")],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}],
    })  # fmt: skip
    return header + A.tobytes() + B.tobytes(), len(header)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_wire_format(suite, encoding):
    """Header lengths count decompressed bodies, both ways; the answer says how it is compressed."""
    body, header_length = _binary_body()
    packed = gzip.compress(body) if encoding == "gzip" else zlib.compress(body)
    headers = {
        **auth(suite), "Content-Encoding": encoding, "Accept-Encoding": encoding,
        "Inference-Header-Content-Length": str(header_length), "Content-Type": "application/octet-stream",
    }  # fmt: skip
    resp = requests.post(f"{suite.base}/v2/models/add/infer", data=packed, headers=headers, stream=True, timeout=10)
    assert resp.status_code == 200, resp.text
    assert resp.headers["Content-Encoding"] == encoding
    raw = resp.raw.read()
    plain = gzip.decompress(raw) if encoding == "gzip" else zlib.decompress(raw)
    length = int(resp.headers["Inference-Header-Content-Length"])
    assert orjson.loads(plain[:length])["outputs"][0]["parameters"]["binary_data_size"] == 64
    np.testing.assert_array_equal(np.frombuffer(plain[length:], np.float32), (A + B).ravel())


def test_bad_encodings_are_refused(suite):
    body, header_length = _binary_body()
    base = {**auth(suite), "Inference-Header-Content-Length": str(header_length)}
    url = f"{suite.base}/v2/models/add/infer"
    resp = requests.post(url, data=body, headers={**base, "Content-Encoding": "br"}, timeout=10)
    assert resp.status_code == 415 and "gzip, deflate or identity" in resp.json()["error"], resp.text
    resp = requests.post(url, data=body, headers={**base, "Content-Encoding": "gzip"}, timeout=10)
    assert resp.status_code == 400 and "not valid gzip data" in resp.json()["error"], resp.text
    resp = requests.post(url, data=gzip.compress(body)[:-12], headers={**base, "Content-Encoding": "gzip"}, timeout=10)
    assert resp.status_code == 400 and "not valid gzip data" in resp.json()["error"], resp.text
    resp = requests.post(url, data=body, headers={**base, "Content-Encoding": "identity"}, timeout=10)
    assert resp.status_code == 200, resp.text


@pytest.fixture(scope="module")
def bomb() -> bytes:
    """1 GiB of zeros, gzip-compressed (about 1 MB)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    zeros = bytes(1 << 20)
    parts = [packer.compress(zeros) for _ in range(1024)]
    return b"".join(parts) + packer.flush()


def test_decompression_bomb_is_refused_without_inflating_it(suite, bomb):
    gateway = suite.supervisor.child("gateway").process.pid
    assert len(bomb) < 2 << 20
    headers = {**auth(suite), "Content-Encoding": "gzip", "Inference-Header-Content-Length": "100"}
    before, _ = rss_mb(gateway)
    with LiveProbe(suite.base) as probe:
        resp = requests.post(f"{suite.base}/v2/models/add/infer", data=bomb, headers=headers, timeout=60)
    now, peak = rss_mb(gateway)
    print(f"\nbomb: {resp.status_code}; live worst {probe.worst_s * 1e3:.1f} ms; RSS {before:.0f} -> {peak:.0f} MB")
    assert resp.status_code == 413, resp.text
    assert "inflates past the limit of 33554432 bytes" in resp.json()["error"]
    assert probe.worst_s < LIVE_BUDGET_S, f"liveness took {probe.worst_s * 1e3:.0f} ms during the bomb"
    assert peak - before < 100, f"the gateway grew from {before:.0f} MB to a peak of {peak:.0f} MB"
