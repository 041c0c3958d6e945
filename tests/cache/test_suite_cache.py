"""The result cache in the running suite, through real tritonclient clients (cache on a private Redis)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from .support import write_scale

RNG = np.random.default_rng(4)


def fresh(rows: int = 1) -> np.ndarray:
    return RNG.random((rows, 4), dtype=np.float32)


def infer(url: str, model: str, x: np.ndarray, **kwargs) -> tuple[np.ndarray, dict, bool | None]:
    """(output y, the response's JSON header, cache_hit or None) over HTTP."""
    client = httpclient.InferenceServerClient(url)
    try:
        inp = httpclient.InferInput("x", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer(model, [inp], **kwargs)
        response = result.get_response()
        return result.as_numpy("y"), response, response.get("parameters", {}).get("cache_hit")
    finally:
        client.close()


def until_hit(url: str, model: str, x: np.ndarray, timeout_s: float = 3.0, **kwargs):
    """Repeat a request until the cache answers it (results are stored after the response)."""
    deadline = time.monotonic() + timeout_s
    while True:
        y, response, hit = infer(url, model, x, **kwargs)
        if hit:
            return y, response
        assert time.monotonic() < deadline, f"{model}: never a cache hit"
        time.sleep(0.02)


def test_a_preloaded_model_answers_its_first_request_within_200_ms(suite):
    assert suite.first_request_s < 0.2, f"first request took {suite.first_request_s * 1e3:.0f} ms"


def test_a_miss_then_hits_over_http_and_grpc(suite):
    x = fresh()
    y, response, hit = infer(suite.http_url, "scale", x)
    assert hit is False
    np.testing.assert_allclose(y, x * 2)
    y_hit, response_hit = until_hit(suite.http_url, "scale", x, request_id="req-42")
    np.testing.assert_array_equal(y_hit, y)
    assert response_hit["id"] == "req-42" and response_hit["model_version"] == "1"

    client = grpcclient.InferenceServerClient(suite.grpc_url)
    try:
        inp = grpcclient.InferInput("x", [1, 4], "FP32")
        inp.set_data_from_numpy(x)
        result = client.infer("scale", [inp])
        assert result.get_response().parameters["cache_hit"].bool_param is True
        np.testing.assert_array_equal(result.as_numpy("y"), y)
    finally:
        client.close()


def test_a_relevant_difference_misses(suite):
    x = fresh()
    until_hit(suite.http_url, "scale", x)
    assert infer(suite.http_url, "scale", x, parameters={"temperature": 1})[2] is False
    assert infer(suite.http_url, "scale", np.vstack([x, x]))[2] is False  # other shape
    assert infer(suite.http_url, "scale", x + np.float32(1e-6))[2] is False
    assert infer(suite.http_url, "scale", x, priority=1)[2] is True  # priority cannot change the result


def test_uncached_models_and_bypassing_requests_skip_the_cache(suite):
    x = fresh()
    for _ in range(3):
        _, response, hit = infer(suite.http_url, "plain", x)
        assert hit is None and "parameters" not in response  # exactly as without a cache
    until_hit(suite.http_url, "scale", x)
    for bypass in ({"cache": False}, {"cache_bypass": True}, {"nondeterministic": True}):
        assert infer(suite.http_url, "scale", x, parameters=bypass)[2] is None


def test_similar_inputs_hit_in_similar_mode_and_only_there(suite):
    x = np.array([[0.1234, 0.5, -0.0001, 7.0]], dtype=np.float32)
    y, _ = until_hit(suite.http_url, "scale_similar", x)
    near = np.array([[0.1203, 0.5021, 0.0004, 7.0]], dtype=np.float32)
    y_near, _, hit = infer(suite.http_url, "scale_similar", near)
    assert hit is True
    np.testing.assert_array_equal(y_near, y)  # the stored answer, computed for x
    far = np.array([[0.1251, 0.5, 0.0, 7.0]], dtype=np.float32)  # 0.13, not 0.12
    assert infer(suite.http_url, "scale_similar", far)[2] is False
    assert infer(suite.http_url, "scale", near)[2] is False  # exact mode: no

    client = httpclient.InferenceServerClient(suite.http_url)
    try:

        def echo(text: str):
            inp = httpclient.InferInput("text", [1, 1], "BYTES")
            inp.set_data_from_numpy(np.array([[text]], dtype=np.object_))
            result = client.infer("echo", [inp])
            return result.as_numpy("echo")[0, 0], result.get_response()["parameters"]["cache_hit"]

        deadline = time.monotonic() + 3
        while not echo("Hello  World")[1]:
            assert time.monotonic() < deadline
        assert echo("  hello world\n") == (b"Hello  World", True)
        assert echo("hello, world")[1] is False
    finally:
        client.close()


def test_entries_expire_after_the_models_ttl(suite):
    x = fresh()
    until_hit(suite.http_url, "scale_ttl", x)  # cache_ttl_s: 1
    time.sleep(1.2)
    assert infer(suite.http_url, "scale_ttl", x)[2] is False


def test_loading_a_new_version_or_new_weights_invalidates(suite):
    x = fresh()
    until_hit(suite.http_url, "versioned", x)
    invalidations = suite.cache_stats().invalidations
    client = httpclient.InferenceServerClient(suite.http_url)
    try:
        write_scale(suite.repository / "versioned" / "2", 3.0)
        client.load_model("versioned")
        y, response, hit = infer(suite.http_url, "versioned", x)
        assert (hit, response["model_version"]) == (False, "2")
        np.testing.assert_allclose(y, x * 3)
        until_hit(suite.http_url, "versioned", x)
        # The same version number with new weights: only the invalidation stops a stale hit.
        write_scale(suite.repository / "versioned" / "2", 5.0)
        client.load_model("versioned")
        y, _, hit = infer(suite.http_url, "versioned", x)
        assert hit is False
        np.testing.assert_allclose(y, x * 5)
    finally:
        client.close()
    assert suite.cache_stats().invalidations == invalidations + 2


def test_models_not_marked_preload_load_on_explicit_load(suite):
    client = httpclient.InferenceServerClient(suite.http_url)
    try:
        states = {m["name"]: m.get("state") for m in client.get_model_repository_index()}
        assert states["lazy"] != "READY" and states["scale"] == "READY"
        with pytest.raises(InferenceServerException):
            infer(suite.http_url, "lazy", fresh())
        client.load_model("lazy")
        assert infer(suite.http_url, "lazy", fresh())[2] is False
    finally:
        client.close()


def test_killing_redis_mid_traffic_fails_no_request_and_caching_recovers(suite, redis_server):
    inputs = [fresh() for _ in range(10)]
    outcomes: list[tuple[float, bool | None]] = []
    errors: list[Exception] = []
    stop = threading.Event()

    def traffic():
        client = grpcclient.InferenceServerClient(suite.grpc_url)
        i = 0
        while not stop.is_set():
            inp = grpcclient.InferInput("x", [1, 4], "FP32")
            inp.set_data_from_numpy(inputs[i % len(inputs)])
            i += 1
            try:
                result = client.infer("scale", [inp])
                outcomes.append((time.monotonic(), result.get_response().parameters["cache_hit"].bool_param))
            except Exception as exc:  # noqa: BLE001 - every failure counts
                errors.append(exc)
        client.close()

    before = suite.cache_stats()
    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        time.sleep(1.0)
        redis_server.kill()
        time.sleep(1.5)
        during = suite.cache_stats()
        redis_server.start()
        restarted = time.monotonic()
        time.sleep(2.5)
    finally:
        stop.set()
        worker.join(30)
        if redis_server.process is None:
            redis_server.start()
    assert not errors, f"{len(errors)} failed requests, first: {errors[0]}"
    assert during.store_errors > before.store_errors and during.bypassed > before.bypassed
    assert not during.store_available
    recovered = [hit for t, hit in outcomes if t > restarted + 1.0]
    assert recovered and any(recovered), "caching did not resume after Redis came back"
    assert suite.cache_stats().store_available


def test_a_classified_output_is_cached_apart_from_the_raw_tensor(suite):
    x = np.array([[0.5, 3.0, -1.0, 2.0]], dtype=np.float32)
    # The same request but for the class count: the raw tensor is cached now.
    y_raw, _ = until_hit(suite.http_url, "scale", x, outputs=[httpclient.InferRequestedOutput("y")])
    wanted = [httpclient.InferRequestedOutput("y", class_count=2)]
    top, response, hit = infer(suite.http_url, "scale", x, outputs=wanted)
    assert hit is False  # another answer than the cached tensor: its own key
    assert response["outputs"][0]["datatype"] == "BYTES"
    assert [s.decode() for s in top.ravel().tolist()] == [f"{y_raw[0, 1]:f}:1", f"{y_raw[0, 3]:f}:3"]
    top_hit, _ = until_hit(suite.http_url, "scale", x, outputs=wanted)
    np.testing.assert_array_equal(top_hit, top)
