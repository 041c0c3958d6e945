"""Concurrent requests are batched, split back exactly, and both replicas serve."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnxruntime as ort
import requests
import tritonclient.grpc as grpcclient

from aiworks.demo.models import digits_split


def stats(suite, model, version):
    doc = requests.get(f"{suite.base}/v2/models/{model}/versions/{version}/stats", timeout=10).json()
    (entry,) = doc["model_stats"]
    return entry


def test_concurrent_multi_row_requests_are_batched_and_split_exactly(suite):
    x_test = digits_split()[1]
    session = ort.InferenceSession(str(suite.model_repository / "digits" / "2" / "model.onnx"))
    before = stats(suite, "digits", "2")
    rows = [1, 2, 3, 1, 4, 1, 2, 5] * 8  # 64 requests, 144 rows

    def one(i_n):
        i, n = i_n
        x = np.ascontiguousarray(x_test[i : i + n], dtype=np.float32)
        client = grpcclient.InferenceServerClient(suite.grpc_url)
        try:
            inp = grpcclient.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            result = client.infer("digits", [inp], model_version="2")
            return x, result.as_numpy("probabilities")
        finally:
            client.close()

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(one, enumerate(rows)))
    for x, probabilities in results:
        (expected,) = session.run(["probabilities"], {"input": x})
        np.testing.assert_allclose(probabilities, expected, rtol=1e-5, atol=1e-6)

    after = stats(suite, "digits", "2")
    inferences = after["inference_count"] - before["inference_count"]
    executions = after["execution_count"] - before["execution_count"]
    assert inferences == sum(rows)
    assert executions < len(rows), f"{len(rows)} requests ran as {executions} batches: nothing was batched"
    served = {r["replica_id"]: r["inference_count"] for r in after["replicas"]}
    assert len(served) == 2 and all(count > 0 for count in served.values()), served
