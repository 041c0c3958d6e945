"""End to end: gateway, scheduler and a runtime serving PyTorch models to tritonclient, against PyTorch itself."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from torch_support import FEATURES, reference, rows, start_suite

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def suite(torch_repository, minilm_repository, tmp_path_factory):
    repo = tmp_path_factory.mktemp("served")
    for source in (torch_repository / "mlp_ts", torch_repository / "mlp_ep", minilm_repository / "minilm_torch"):
        shutil.copytree(source, repo / source.name)
    running = start_suite(repo, tmp_path_factory.mktemp("logs"), replicas=1, cache=False)
    yield running
    running.supervisor.stop()


def embed(url: str, model: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    client = grpcclient.InferenceServerClient(url)
    try:
        inputs = []
        for name in ("input_ids", "attention_mask"):
            tensor = grpcclient.InferInput(name, list(feeds[name].shape), "INT64")
            tensor.set_data_from_numpy(feeds[name])
            inputs.append(tensor)
        return client.infer(model, inputs).as_numpy("embedding")
    finally:
        client.close()


def test_minilm_through_the_suite_matches_pytorch(suite, minilm_feeds):
    feeds, want = minilm_feeds
    got = embed(suite.grpc_url, "minilm_torch", feeds)
    cosine = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() > 0.99999
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_metadata_and_config_are_tritons(suite):
    client = httpclient.InferenceServerClient(suite.http_url)
    try:
        meta = client.get_model_metadata("minilm_torch")
        assert meta["platform"] == "pytorch_libtorch"
        assert [(t["name"], t["datatype"], t["shape"]) for t in meta["inputs"]] == [
            ("input_ids", "INT64", [-1, -1]),
            ("attention_mask", "INT64", [-1, -1]),
        ]
        # The exported program's tensors came from the program itself (auto-complete).
        meta = client.get_model_metadata("mlp_ep")
        assert [t["name"] for t in meta["inputs"]] == ["features"]
        assert [t["name"] for t in meta["outputs"]] == ["OUTPUT__0", "OUTPUT__1"]
    finally:
        client.close()


def test_mlp_over_http_binary_and_concurrent_grpc_requests_batch(suite):
    x = rows(4, seed=7)
    client = httpclient.InferenceServerClient(suite.http_url)
    try:
        tensor = httpclient.InferInput("INPUT__0", list(x.shape), "FP32")
        tensor.set_data_from_numpy(x, binary_data=True)
        result = client.infer(
            "mlp_ts", [tensor], outputs=[httpclient.InferRequestedOutput("OUTPUT__1", binary_data=True)]
        )
        np.testing.assert_allclose(result.as_numpy("OUTPUT__1"), reference(x)[1], rtol=1e-5, atol=1e-5)
    finally:
        client.close()

    errors, answers = [], []

    def one_client(seed: int) -> None:
        c = grpcclient.InferenceServerClient(suite.grpc_url)
        try:
            for i in range(15):
                row = rows(1, seed=seed * 100 + i)
                t = grpcclient.InferInput("features", [1, FEATURES], "FP32")
                t.set_data_from_numpy(row)
                got = c.infer("mlp_ep", [t]).as_numpy("OUTPUT__0")
                answers.append(np.abs(got - reference(row)[0]).max())
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=one_client, args=(s,)) for s in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors and len(answers) == 120 and max(answers) < 1e-5
    stats = grpcclient.InferenceServerClient(suite.grpc_url).get_inference_statistics("mlp_ep", as_json=True)
    (version,) = stats["model_stats"]
    assert int(version["inference_count"]) >= 120
    assert int(version["execution_count"]) < int(version["inference_count"])  # requests shared batches
