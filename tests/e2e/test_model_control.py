"""Triton's model control with overrides, and its trace and log settings APIs, end to end (issue 14, items 4 and 9).

One suite (scheduler, two runtime replicas sharing a repository, a gateway
with a tenants file and a span file), driven by tritonclient over HTTP and
gRPC as an admin tenant (``ops``) and as a tenant that may only infer
(``alice``). Models (built here): ``double`` (FP32 x*2, max_batch_size 8)
and ``trap``, a folder whose version folder is a link to a folder outside
the repository.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from e2e_support import Suite, internal_channel, start_suite
from onnx import TensorProto, helper
from tritonclient.utils import InferenceServerException

from aiworks.gateway.auth import generate_api_key
from aiworks.pb.runtime.v1 import runtime_pb2, runtime_pb2_grpc
from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

pytestmark = pytest.mark.slow

MAX_FILE_BYTES = 8192


def _onnx_bytes(name: str, op: str, constant: float) -> bytes:
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "k"], ["y"])],
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [constant])],
    )
    out = io.BytesIO()
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), out)
    return out.getvalue()


def _config(name: str, max_batch_size: int, **extra) -> dict:
    return {
        "name": name,
        "platform": "onnxruntime_onnx",
        "max_batch_size": max_batch_size,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
        **extra,
    }


FOLDER_CONFIG = (
    'platform: "onnxruntime_onnx"\nmax_batch_size: 8\n'
    'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
    'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
)


@pytest.fixture(scope="module")
def control(tmp_path_factory):
    work = tmp_path_factory.mktemp("model-control")
    repository = work / "repository"
    (repository / "double" / "1").mkdir(parents=True)
    (repository / "double" / "1" / "model.onnx").write_bytes(_onnx_bytes("double", "Mul", 2.0))
    (repository / "double" / "config.pbtxt").write_text(FOLDER_CONFIG)
    (work / "outside").mkdir()
    (repository / "trap").mkdir()
    (repository / "trap" / "1").symlink_to(work / "outside")

    keys = {}
    tenants = []
    for tenant_id, fields in {"ops": {"admin": True}, "alice": {"models": ["double", "uploaded"]}}.items():
        keys[tenant_id], digest = generate_api_key()
        tenants.append({"id": tenant_id, "api_keys": [digest], **fields})
    tenants_file = work / "tenants.yaml"
    tenants_file.write_text(yaml.safe_dump({"tenants": tenants}, sort_keys=False))
    env = {
        "AIWORKS_GATEWAY_TENANTS_FILE": str(tenants_file),
        "AIWORKS_GATEWAY_TRACE_FILE": str(work / "gateway-spans.jsonl"),
        "AIWORKS_GATEWAY_MAX_LOAD_FILE_BYTES": str(MAX_FILE_BYTES),
    }
    suite = start_suite(repository, work / "logs", replicas=2, cache=False, extra_env=env)
    try:
        yield suite, keys, work
    finally:
        suite.supervisor.stop()


def _http(suite: Suite, key: str) -> tuple[httpclient.InferenceServerClient, dict]:
    return httpclient.InferenceServerClient(suite.http_url), {"x-api-key": key}


def _grpc(suite: Suite, key: str) -> tuple[grpcclient.InferenceServerClient, dict]:
    return grpcclient.InferenceServerClient(suite.grpc_url), {"x-api-key": key}


def _rows(module, rows: int):
    x = module.InferInput("x", [rows, 4], "FP32")
    x.set_data_from_numpy(np.arange(rows * 4, dtype=np.float32).reshape(rows, 4))
    return [x]


def _replica_batch_sizes(suite: Suite, model: str) -> list[int]:
    """max_batch_size of ``model`` as each runtime replica serves it (asked of the replicas themselves)."""
    sizes = []
    with internal_channel(suite.supervisor, suite.supervisor.scheduler_address, "scheduler") as channel:
        status = scheduler_pb2_grpc.SchedulerServiceStub(channel).Status(scheduler_pb2.StatusRequest(), timeout=10)
    addresses = [r.address for r in status.replicas if r.live]
    assert len(addresses) == 2
    for address in addresses:
        with internal_channel(suite.supervisor, address, "runtime") as channel:
            reply = runtime_pb2_grpc.RuntimeServiceStub(channel).ListModels(
                runtime_pb2.ListModelsRequest(ready_only=True), timeout=10
            )
        sizes += [m.max_batch_size for m in reply.models if m.name == model]
    return sizes


# ---- load with overrides --------------------------------------------------------------------------------


def test_a_config_override_applies_on_every_replica_and_a_plain_load_restores_the_folder(control):
    suite, keys, _ = control
    client, ops = _http(suite, keys["ops"])
    try:
        client.load_model("double", headers=ops, config=json.dumps(_config("double", 2)))
        assert client.get_model_config("double", headers=ops)["max_batch_size"] == 2
        assert _replica_batch_sizes(suite, "double") == [2, 2]
        out = client.infer("double", _rows(httpclient, 2), headers=ops).as_numpy("y")
        np.testing.assert_allclose(out, np.arange(8, dtype=np.float32).reshape(2, 4) * 2)
        with pytest.raises(InferenceServerException) as refused:
            client.infer("double", _rows(httpclient, 3), headers=ops)
        assert refused.value.status() == "400" and "batch" in refused.value.message()

        client.load_model("double", headers=ops)  # no override: the folder's config.pbtxt again
        assert client.get_model_config("double", headers=ops)["max_batch_size"] == 8
        assert _replica_batch_sizes(suite, "double") == [8, 8]
        assert client.infer("double", _rows(httpclient, 3), headers=ops).as_numpy("y").shape == (3, 4)
    finally:
        client.close()


def test_an_invalid_config_is_a_400_naming_the_model_and_the_reason_and_the_model_keeps_serving(control):
    suite, keys, work = control
    client, ops = _http(suite, keys["ops"])
    try:
        with pytest.raises(InferenceServerException) as bad:
            client.load_model("double", headers=ops, config=json.dumps({"max_batch_sise": 4}))
        assert bad.value.status() == "400"
        assert bad.value.message().startswith("failed to load 'double': ")
        assert "max_batch_sise" in bad.value.message()
        with pytest.raises(InferenceServerException) as negative:
            client.load_model("double", headers=ops, config=json.dumps(_config("double", -1)))
        assert negative.value.status() == "400" and "max_batch_size must be >= 0" in negative.value.message()
        with pytest.raises(InferenceServerException) as not_json:
            client.load_model("double", headers=ops, config="{not json")
        assert not_json.value.status() == "400" and "failed to load 'double'" in not_json.value.message()
        for error in (bad, negative, not_json):
            assert str(work) not in error.value.message()
        assert client.infer("double", _rows(httpclient, 1), headers=ops).as_numpy("y").shape == (1, 4)
    finally:
        client.close()


def test_a_new_models_files_are_uploaded_over_http_and_grpc_and_served(control):
    suite, keys, _ = control
    client, ops = _http(suite, keys["ops"])
    gclient, gops = _grpc(suite, keys["ops"])
    try:
        model = _onnx_bytes("uploaded", "Add", 1.0)
        client.load_model(
            "uploaded", headers=ops, config=json.dumps(_config("uploaded", 4)), files={"file:1/model.onnx": model}
        )
        assert (suite.model_repository / "uploaded" / "1" / "model.onnx").read_bytes() == model
        out = client.infer("uploaded", _rows(httpclient, 2), headers=ops).as_numpy("y")
        np.testing.assert_allclose(out, np.arange(8, dtype=np.float32).reshape(2, 4) + 1)
        assert _replica_batch_sizes(suite, "uploaded") == [4, 4]

        model = _onnx_bytes("uploaded_grpc", "Sub", 1.0)
        gclient.load_model(
            "uploaded_grpc", headers=gops, config=json.dumps(_config("uploaded_grpc", 2)),
            files={"file:1/model.onnx": model},
        )  # fmt: skip
        out = gclient.infer("uploaded_grpc", _rows(grpcclient, 2), headers=gops).as_numpy("y")
        np.testing.assert_allclose(out, np.arange(8, dtype=np.float32).reshape(2, 4) - 1)
        assert gclient.get_model_config("uploaded_grpc", headers=gops).config.max_batch_size == 2
    finally:
        client.close()
        gclient.close()


def test_a_grpc_config_override_applies_and_an_invalid_one_is_invalid_argument(control):
    suite, keys, _ = control
    gclient, gops = _grpc(suite, keys["ops"])
    try:
        gclient.load_model("double", headers=gops, config=json.dumps(_config("double", 3)))
        assert gclient.get_model_config("double", headers=gops).config.max_batch_size == 3
        with pytest.raises(InferenceServerException) as refused:
            gclient.infer("double", _rows(grpcclient, 4), headers=gops)
        assert "batch" in refused.value.message()
        with pytest.raises(InferenceServerException) as bad:
            gclient.load_model("double", headers=gops, config=json.dumps({"input": "x"}))
        assert bad.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert bad.value.message().startswith("failed to load 'double': ")
        gclient.load_model("double", headers=gops)
        assert gclient.get_model_config("double", headers=gops).config.max_batch_size == 8
    finally:
        gclient.close()


@pytest.mark.parametrize(
    "path, why",
    [
        ("file:../double/1/model.onnx", "'..'"),
        ("file:1/../../double/1/model.onnx", "'..'"),
        ("file:/tmp/evil.onnx", "relative"),
        ("file:1\\model.onnx", "relative"),
        ("file:config.pbtxt", "'config' parameter"),
    ],
)
def test_a_file_path_that_escapes_its_models_folder_is_refused(control, path, why):
    suite, keys, work = control
    client, ops = _http(suite, keys["ops"])
    before = (suite.model_repository / "double" / "1" / "model.onnx").read_bytes()
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("escape", headers=ops, config=json.dumps(_config("escape", 2)), files={path: b"x"})
        assert refused.value.status() == "400", refused.value.message()
        assert refused.value.message().startswith("failed to load 'escape': ") and why in refused.value.message()
        assert str(work) not in refused.value.message()
    finally:
        client.close()
    assert (suite.model_repository / "double" / "1" / "model.onnx").read_bytes() == before
    assert not Path("/tmp/evil.onnx").exists()


def test_a_path_escape_over_grpc_is_invalid_argument_and_writes_nothing(control):
    suite, keys, work = control
    gclient, gops = _grpc(suite, keys["ops"])
    try:
        with pytest.raises(InferenceServerException) as refused:
            gclient.load_model(
                "escape", headers=gops, config=json.dumps(_config("escape", 2)),
                files={"file:1/model.onnx": b"x", "file:../outside.onnx": b"x"},
            )  # fmt: skip
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT"
        assert refused.value.message().startswith("failed to load 'escape': ") and "'..'" in refused.value.message()
        assert str(work) not in refused.value.message()
    finally:
        gclient.close()
    assert not (suite.model_repository / "escape").exists()
    assert not (suite.model_repository / "outside.onnx").exists()


def test_a_link_out_of_the_models_folder_is_refused_and_nothing_is_written_through_it(control):
    suite, keys, work = control
    client, ops = _http(suite, keys["ops"])
    try:
        with pytest.raises(InferenceServerException) as refused:
            client.load_model(
                "trap", headers=ops, config=json.dumps(_config("trap", 2)),
                files={"file:1/model.onnx": _onnx_bytes("trap", "Mul", 3.0)},
            )  # fmt: skip
        assert refused.value.status() == "400"
        assert "failed to load 'trap'" in refused.value.message() and "link" in refused.value.message()
        assert str(work) not in refused.value.message()
    finally:
        client.close()
    assert list((work / "outside").iterdir()) == []


def test_files_without_a_config_and_unknown_parameters_are_refused(control):
    suite, keys, _ = control
    client, ops = _http(suite, keys["ops"])
    try:
        with pytest.raises(InferenceServerException) as no_config:
            client.load_model("lonely", headers=ops, files={"file:1/model.onnx": b"x"})
        assert no_config.value.status() == "400" and "needs a 'config' parameter" in no_config.value.message()
        assert not (suite.model_repository / "lonely").exists()
    finally:
        client.close()


def test_more_file_bytes_than_the_cap_are_413_and_nothing_is_written(control):
    suite, keys, _ = control
    client, ops = _http(suite, keys["ops"])
    try:
        with pytest.raises(InferenceServerException) as big:
            client.load_model(
                "big", headers=ops, config=json.dumps(_config("big", 2)),
                files={"file:1/model.onnx": b"\0" * (MAX_FILE_BYTES + 1)},
            )  # fmt: skip
        assert big.value.status() == "413"
        assert f"more than the {MAX_FILE_BYTES} bytes" in big.value.message()
        assert not (suite.model_repository / "big").exists()
    finally:
        client.close()


def test_a_tenant_that_is_not_admin_may_not_load_with_overrides(control):
    suite, keys, _ = control
    client, alice = _http(suite, keys["alice"])
    gclient, galice = _grpc(suite, keys["alice"])
    files = {"file:1/model.onnx": _onnx_bytes("uploaded", "Mul", 5.0)}
    before = (suite.model_repository / "double" / "config.pbtxt").read_text()
    try:
        assert client.infer("double", _rows(httpclient, 1), headers=alice).as_numpy("y").shape == (1, 4)
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("double", headers=alice, config=json.dumps(_config("double", 1)))
        assert refused.value.status() == "403" and "admin: true" in refused.value.message()
        with pytest.raises(InferenceServerException) as refused:
            client.load_model("sneaky", headers=alice, config=json.dumps(_config("sneaky", 1)), files=files)
        assert refused.value.status() == "403"
        with pytest.raises(InferenceServerException) as refused:
            gclient.load_model("sneaky", headers=galice, config=json.dumps(_config("sneaky", 1)), files=files)
        assert refused.value.status() == "StatusCode.PERMISSION_DENIED"
    finally:
        client.close()
        gclient.close()
    assert not (suite.model_repository / "sneaky").exists()
    assert (suite.model_repository / "double" / "config.pbtxt").read_text() == before
    assert _replica_batch_sizes(suite, "double") == [8, 8]


# ---- trace and log settings ----------------------------------------------------------------------------


def _gateway_spans(work: Path, model: str) -> int:
    """Gateway spans of ``model`` in the span file, once the exporter (it writes every 0.5 s) has caught up."""
    path = work / "gateway-spans.jsonl"
    last, stable_since = -1, time.monotonic()
    while True:
        spans = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        count = sum(1 for s in spans if s["name"] == "gateway infer" and s["attributes"].get("aiworks.model") == model)
        if count != last:
            last, stable_since = count, time.monotonic()
        elif time.monotonic() - stable_since >= 1.5:
            return count
        time.sleep(0.1)


def test_trace_settings_over_http_set_the_sampling_for_all_models_and_one(control):
    suite, keys, work = control
    client, ops = _http(suite, keys["ops"])
    try:
        start = client.get_trace_settings(headers=ops)
        assert start["trace_level"] == ["TIMESTAMPS"] and start["trace_rate"] == "1"
        assert start["trace_mode"] == "opentelemetry" and start["trace_count"] == "-1"
        assert start["trace_file"] == "gateway-spans.jsonl"  # its name, never the server's path

        # Off for "double" only: its requests leave no span; every model's rate stays 1.
        model = client.update_trace_settings("double", {"trace_level": ["OFF"]}, headers=ops)
        assert model["trace_level"] == ["OFF"]
        assert client.get_trace_settings(headers=ops)["trace_level"] == ["TIMESTAMPS"]
        before = _gateway_spans(work, "double")
        for _ in range(5):
            client.infer("double", _rows(httpclient, 1), headers=ops)
        assert _gateway_spans(work, "double") - before == 0

        # Cleared: the model follows every model's settings again, and each request is traced.
        cleared = client.update_trace_settings("double", {"trace_level": None}, headers=ops)
        assert cleared["trace_level"] == ["TIMESTAMPS"] and cleared["trace_rate"] == "1"
        before = _gateway_spans(work, "double")
        for _ in range(5):
            client.infer("double", _rows(httpclient, 1), headers=ops)
        assert _gateway_spans(work, "double") - before == 5

        # A rate of 1000: about one request in a thousand; 20 requests leave (almost surely) none.
        updated = client.update_trace_settings(settings={"trace_rate": "1000"}, headers=ops)
        assert updated["trace_rate"] == "1000" and updated["trace_level"] == ["TIMESTAMPS"]
        assert client.get_trace_settings("double", headers=ops)["trace_rate"] == "1000"
        before = _gateway_spans(work, "double")
        for _ in range(20):
            client.infer("double", _rows(httpclient, 1), headers=ops)
        assert _gateway_spans(work, "double") - before <= 1

        with pytest.raises(InferenceServerException) as tensors:
            client.update_trace_settings(settings={"trace_level": ["TENSORS"]}, headers=ops)
        assert tensors.value.status() == "400" and "TENSORS" in tensors.value.message()
        with pytest.raises(InferenceServerException) as count:
            client.update_trace_settings(settings={"trace_count": "10"}, headers=ops)
        assert count.value.status() == "400" and "trace_count" in count.value.message()
        with pytest.raises(InferenceServerException) as rate:
            client.update_trace_settings(settings={"trace_rate": "0"}, headers=ops)
        assert rate.value.status() == "400" and "trace_rate" in rate.value.message()
        with pytest.raises(InferenceServerException) as unknown:
            client.update_trace_settings(settings={"trace_colour": "red"}, headers=ops)
        assert unknown.value.status() == "400" and "trace_colour" in unknown.value.message()

        restored = client.update_trace_settings(settings={"trace_rate": None}, headers=ops)
        assert restored["trace_rate"] == "1" and restored["trace_level"] == ["TIMESTAMPS"]
    finally:
        client.close()


def test_trace_settings_over_grpc(control):
    suite, keys, _ = control
    gclient, gops = _grpc(suite, keys["ops"])
    try:
        got = gclient.get_trace_settings(headers=gops, as_json=True)["settings"]
        assert got["trace_level"]["value"] == ["TIMESTAMPS"] and got["trace_rate"]["value"] == ["1"]
        set_ = gclient.update_trace_settings("double", {"trace_rate": "10"}, headers=gops, as_json=True)["settings"]
        assert set_["trace_rate"]["value"] == ["10"]
        assert gclient.get_trace_settings("double", headers=gops, as_json=True)["settings"]["trace_rate"]["value"] == [
            "10"
        ]
        assert gclient.get_trace_settings(headers=gops, as_json=True)["settings"]["trace_rate"]["value"] == ["1"]
        cleared = gclient.update_trace_settings("double", {"trace_rate": None}, headers=gops, as_json=True)
        assert cleared["settings"]["trace_rate"]["value"] == ["1"]
        with pytest.raises(InferenceServerException) as refused:
            gclient.update_trace_settings(settings={"trace_mode": "triton"}, headers=gops)
        assert refused.value.status() == "StatusCode.INVALID_ARGUMENT" and "trace_mode" in refused.value.message()
    finally:
        gclient.close()


def test_log_settings_over_http_and_grpc_set_the_gateways_log_level(control):
    suite, keys, work = control
    client, ops = _http(suite, keys["ops"])
    gclient, gops = _grpc(suite, keys["ops"])
    try:
        start = client.get_log_settings(headers=ops)
        assert start == {"log_file": "", "log_info": True, "log_warning": True, "log_error": True,
                         "log_verbose_level": 0, "log_format": "ISO8601"}  # fmt: skip
        verbose = client.update_log_settings({"log_verbose_level": 1}, headers=ops)
        assert verbose["log_verbose_level"] == 1
        gateway_log = (work / "logs" / "gateway.log").read_text()
        assert "log level now DEBUG (logging API)" in gateway_log

        quiet = gclient.update_log_settings({"log_verbose_level": 0, "log_info": False}, headers=gops, as_json=True)
        assert quiet["settings"]["log_info"]["bool_param"] is False
        assert client.get_log_settings(headers=ops)["log_warning"] is True
        assert "log level now WARNING" in (work / "logs" / "gateway.log").read_text()

        with pytest.raises(InferenceServerException) as format_:
            client.update_log_settings({"log_format": "default"}, headers=ops)
        assert format_.value.status() == "400" and "log_format" in format_.value.message()
        with pytest.raises(InferenceServerException) as mixed:
            client.update_log_settings({"log_info": True, "log_warning": False}, headers=ops)
        assert mixed.value.status() == "400" and "log_info on with log_warning off" in mixed.value.message()
        with pytest.raises(InferenceServerException) as file_:
            gclient.update_log_settings({"log_file": "/tmp/gateway.log"}, headers=gops)
        assert file_.value.status() == "StatusCode.INVALID_ARGUMENT" and "log_file" in file_.value.message()

        back = client.update_log_settings({"log_info": True}, headers=ops)
        assert back["log_info"] is True and back["log_verbose_level"] == 0
    finally:
        client.close()
        gclient.close()


def test_trace_and_log_settings_are_admin_only(control):
    suite, keys, _ = control
    client, alice = _http(suite, keys["alice"])
    gclient, galice = _grpc(suite, keys["alice"])
    try:
        for call in (
            lambda: client.get_trace_settings(headers=alice),
            lambda: client.update_trace_settings(settings={"trace_rate": "2"}, headers=alice),
            lambda: client.update_trace_settings("double", {"trace_level": ["OFF"]}, headers=alice),
            lambda: client.get_log_settings(headers=alice),
            lambda: client.update_log_settings({"log_verbose_level": 1}, headers=alice),
        ):
            with pytest.raises(InferenceServerException) as refused:
                call()
            assert refused.value.status() == "403" and "admin: true" in refused.value.message()
        for call in (
            lambda: gclient.get_trace_settings(headers=galice),
            lambda: gclient.update_trace_settings(settings={"trace_rate": "2"}, headers=galice),
            lambda: gclient.get_log_settings(headers=galice),
            lambda: gclient.update_log_settings({"log_verbose_level": 1}, headers=galice),
        ):
            with pytest.raises(InferenceServerException) as refused:
                call()
            assert refused.value.status() == "StatusCode.PERMISSION_DENIED"
        with pytest.raises(InferenceServerException) as anonymous:
            httpclient.InferenceServerClient(suite.http_url).get_log_settings()
        assert anonymous.value.status() == "401"
    finally:
        client.close()
        gclient.close()
    admin = httpclient.InferenceServerClient(suite.http_url)
    try:
        assert admin.get_trace_settings(headers={"x-api-key": keys["ops"]})["trace_rate"] == "1"
    finally:
        admin.close()


def test_server_metadata_lists_the_trace_and_logging_extensions(control):
    suite, _, _ = control
    client = httpclient.InferenceServerClient(suite.http_url)
    gclient = grpcclient.InferenceServerClient(suite.grpc_url)
    try:
        assert {"trace", "logging", "model_repository"} <= set(client.get_server_metadata()["extensions"])
        assert {"trace", "logging"} <= set(gclient.get_server_metadata().extensions)
    finally:
        client.close()
        gclient.close()
