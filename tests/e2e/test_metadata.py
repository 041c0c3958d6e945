"""Health, metadata, config, statistics and the model repository API."""

from __future__ import annotations

import numpy as np
import requests
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient


def test_health_over_both_protocols(http_client, grpc_client):
    assert http_client.is_server_live() and http_client.is_server_ready()
    assert grpc_client.is_server_live() and grpc_client.is_server_ready()
    assert http_client.is_model_ready("iris") and grpc_client.is_model_ready("digits", "1")
    assert not http_client.is_model_ready("nope")


def test_server_and_model_metadata(http_client, grpc_client):
    assert http_client.get_server_metadata()["name"] == "aiworks"
    meta = grpc_client.get_model_metadata("iris", as_json=True)
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "4"]}]
    assert {o["name"] for o in meta["outputs"]} == {"label", "probabilities"}
    config = http_client.get_model_config("digits")
    assert config["max_batch_size"] == 64 and config["dynamic_batching"]["max_queue_delay_microseconds"] == 2000
    assert grpc_client.get_model_config("iris").config.max_batch_size == 64


def test_repository_index_unload_and_load(suite, http_client, grpc_client):
    index = {(m["name"], m.get("version", "")): m["state"] for m in http_client.get_model_repository_index()}
    assert index[("iris", "1")] == "READY" and index[("digits", "2")] == "READY"

    grpc_client.unload_model("iris")
    assert not http_client.is_model_ready("iris")
    inp = httpclient.InferInput("input", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    resp = requests.post(
        f"{suite.base}/v2/models/iris/infer",
        json={"inputs": [{"name": "input", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]},
        timeout=10,
    )
    assert resp.status_code == 404, resp.text  # as Triton: a model of the repository, not loaded
    assert resp.json()["error"].startswith("Request for unknown model: 'iris' has no available versions")
    index = {m["name"]: m["state"] for m in http_client.get_model_repository_index()}
    assert index["iris"] == "UNAVAILABLE"

    http_client.load_model("iris")
    assert grpc_client.is_model_ready("iris")
    assert http_client.infer("iris", [inp]).as_numpy("label").shape == (1, 1)


def test_statistics_over_grpc(grpc_client):
    inp = grpcclient.InferInput("input", [1, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4), np.float32))
    grpc_client.infer("iris", [inp])
    stats = grpc_client.get_inference_statistics("iris", as_json=True)
    assert int(stats["model_stats"][0]["inference_count"]) >= 1
