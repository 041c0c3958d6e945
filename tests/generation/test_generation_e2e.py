"""Generation through the whole suite: gRPC ModelStreamInfer with tritonclient, Triton's generate extension.

One suite of its own (scheduler, two runtime replicas, gateway) over the tiny
random-weight ``codegen`` model: texts are gibberish but deterministic
(greedy), which is what these tests compare.
"""

from __future__ import annotations

import queue
import time

import numpy as np
import orjson
import pytest
import requests
import tritonclient.grpc as grpcclient
from e2e.e2e_support import start_suite
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def suite(tiny_llm_repo, tmp_path_factory):
    s = start_suite(tiny_llm_repo, tmp_path_factory.mktemp("logs"), cache=False)
    yield s
    s.supervisor.stop()


def url(suite, path: str) -> str:
    return f"http://{suite.http_url}{path}"


def sse(response) -> list[dict]:
    return [orjson.loads(line[6:]) for line in response.iter_lines() if line.startswith(b"data: ")]


def llm_gauges(suite) -> dict[tuple[str, str], float]:
    """Summed over the runtime replicas: (metric, kind/state) -> value."""
    out: dict[tuple[str, str], float] = {}
    for target in suite.supervisor.metrics_targets()["runtime"]:
        text = requests.get(f"http://{target}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            if family.name in ("aiworks_runtime_llm_kv_tokens", "aiworks_runtime_llm_sequences"):
                for s in family.samples:
                    key = (family.name, s.labels.get("kind") or s.labels.get("state"))
                    out[key] = out.get(key, 0.0) + s.value
    return out


def test_model_stream_infer_sends_a_response_per_token_then_the_final_flag(suite):
    body = {"text_input": "def main(", "parameters": {"max_tokens": 12, "ignore_eos": True}}
    whole = requests.post(url(suite, "/v2/models/codegen/generate"), json=body)
    assert whole.status_code == 200, whole.text
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(suite.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.asarray([b"def main("], dtype=object))
        client.async_stream_infer("codegen", [text], request_id="g1", parameters={"max_tokens": 12, "ignore_eos": True},
                                  enable_empty_final_response=True)  # fmt: skip
        results = []
        while True:
            result, error = got.get(timeout=60)
            assert error is None, error.message()
            results.append(result)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        client.stop_stream()
    finally:
        client.close()
    pieces = [r.as_numpy("text_output")[0].decode() for r in results[:-1]]
    assert len(pieces) >= 2 and results[-1].as_numpy("text_output") is None  # the bare final flag
    assert all(r.get_response().id == "g1" for r in results)
    assert "".join(pieces) == whole.json()["text_output"]
    last = results[-2].get_response().parameters
    assert last["completion_tokens"].int64_param == 12 and last["finish_reason"].string_param == "length"
    assert whole.json()["model_name"] == "codegen" and whole.json()["model_version"] == "1"


def test_generate_stream_sends_server_sent_events_as_they_are_made(suite):
    body = {"text_input": "import ", "max_tokens": 10, "ignore_eos": True, "stream": True}
    once = requests.post(url(suite, "/v2/models/codegen/generate"), json=body).json()
    with requests.post(url(suite, "/v2/models/codegen/generate_stream"), json=body, stream=True) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    assert len(events) >= 2 and all(e["model_name"] == "codegen" and "text_output" in e for e in events)
    assert "".join(e["text_output"] for e in events) == once["text_output"]
    # Sampling with a seed repeats; a stop string ends the text before it.
    seeded = {"text_input": "class ", "parameters": {"max_tokens": 16, "temperature": 1.0, "top_k": 40, "seed": 5}}
    a, b = (requests.post(url(suite, "/v2/models/codegen/generate"), json=seeded).json()["text_output"] for _ in "ab")
    assert a == b
    stop = once["text_output"][3:6]
    cut = requests.post(url(suite, "/v2/models/codegen/generate"), json={**body, "stop": [stop]}).json()
    assert cut["text_output"] == once["text_output"][: once["text_output"].find(stop)]


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"text_input": "def f(x): return x\n" * 60}, r"the prompt is \d+ tokens; the context window is 256"),
        ({"text_input": "x", "parameters": {"max_tokens": 0}}, "max_tokens"),
        ({"text_input": "x", "parameters": {"max_tokens": 100000}}, "max_tokens"),
        ({"text_input": "x", "parameters": {"presence_penalty": 1}}, "unknown sampling parameter"),
        ({"prompt": "x"}, "text_input"),
        ({"text_input": "x", "parameters": {"temperature": [1]}}, "temperature"),
    ],
)
def test_bad_generate_requests_get_a_400_that_says_why(suite, body, words):
    import re

    for route in ("generate", "generate_stream"):
        r = requests.post(url(suite, f"/v2/models/codegen/{route}"), json=body)
        assert r.status_code == 400, (route, r.status_code, r.text)
        assert r.headers["content-type"].startswith("application/json")
        assert re.search(words, r.json()["error"]), r.json()


def test_abandoned_streams_leave_the_kv_cache_as_it_was(suite):
    before = llm_gauges(suite)
    assert before[("aiworks_runtime_llm_kv_tokens", "used")] == 0
    body = {"text_input": "def ", "parameters": {"max_tokens": 200, "ignore_eos": True}}
    for _ in range(50):
        with requests.post(url(suite, "/v2/models/codegen/generate_stream"), json=body, stream=True, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the first token came; the client goes away mid-stream
    kv, seqs = "aiworks_runtime_llm_kv_tokens", "aiworks_runtime_llm_sequences"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = llm_gauges(suite)
        if now[(kv, "used")] == 0 and now[(seqs, "running")] == 0:
            break
        time.sleep(0.2)
    assert now[(kv, "used")] == 0, now
    assert now[(seqs, "running")] == 0 and now[(seqs, "waiting")] == 0
    assert now[(kv, "budget")] == before[(kv, "budget")]
    # The model still answers.
    r = requests.post(url(suite, "/v2/models/codegen/generate"), json={"text_input": "x", "max_tokens": 3})
    assert r.status_code == 200
