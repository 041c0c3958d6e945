"""The MiniLM text model served through the whole suite: clients send text, get embeddings."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from e2e_support import start_suite

SENTENCES = ["A cat sits on the mat.", "A kitten rests on a rug.", "Stock markets fell sharply today."]


# Built in a child process: importing torch and onnxruntime-extensions into the
# test process next to everything else the e2e tests load has aborted it
# intermittently (a native-library clash at import), so they stay out of it.
_BUILD = """
import sys
from pathlib import Path
import numpy as np
from aiworks.lifecycle import minilm
root = Path(sys.argv[1])
minilm.build(root / "repo", int8=False, workdir=root / "work")
np.save(root / "reference.npy", minilm.torch_embeddings(sys.argv[2:]))
"""


@pytest.fixture(scope="module")
def minilm_suite(tmp_path_factory):
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("onnxruntime_extensions") is None:
        pytest.skip("needs the lifecycle extras (requirements-lifecycle.txt)")
    root = tmp_path_factory.mktemp("minilm")
    subprocess.run([sys.executable, "-c", _BUILD, str(root), *SENTENCES], check=True, timeout=600)
    suite = start_suite(root / "repo", root / "logs", replicas=1, cache=False)
    yield suite, np.load(root / "reference.npy")
    suite.supervisor.stop()


def test_text_in_embeddings_out_over_http_and_grpc(minilm_suite):
    suite, reference = minilm_suite
    text = np.array([[s.encode()] for s in SENTENCES], dtype=object)
    http = httpclient.InferenceServerClient(suite.http_url)
    inp = httpclient.InferInput("text", list(text.shape), "BYTES")
    inp.set_data_from_numpy(text)
    over_http = http.infer("minilm", [inp]).as_numpy("embedding")

    grpc = grpcclient.InferenceServerClient(suite.grpc_url)
    inp = grpcclient.InferInput("text", list(text.shape), "BYTES")
    inp.set_data_from_numpy(text)
    over_grpc = grpc.infer("minilm", [inp]).as_numpy("embedding")

    assert over_http.shape == (3, 384)
    np.testing.assert_allclose(over_http, over_grpc, rtol=1e-5, atol=1e-6)
    cosine = np.sum(over_http * reference, axis=1) / (
        np.linalg.norm(over_http, axis=1) * np.linalg.norm(reference, axis=1)
    )
    assert cosine.min() >= 0.999, cosine
    # Similar sentences are closer than unrelated ones.
    unit = over_http / np.linalg.norm(over_http, axis=1, keepdims=True)
    assert unit[0] @ unit[1] > unit[0] @ unit[2]
