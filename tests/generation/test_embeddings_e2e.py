"""``/v1/embeddings`` through ``minilm`` with the official openai client (base64 by default, and float)."""

from __future__ import annotations

import numpy as np
import openai
import pytest
import requests
from e2e.e2e_support import start_suite

from aiworks.lifecycle import minilm
from aiworks.lifecycle.layout import find_onnx

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def minilm_suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    minilm.build(root / "repo", workdir=root / "work")
    s = start_suite(root / "repo", root / "logs", replicas=1, cache=False)
    yield s, root / "repo" / "minilm"
    s.supervisor.stop()


def test_openai_embeddings_match_the_model_in_process(minilm_suite):
    suite, folder = minilm_suite
    texts = ["How do I reset my password?", "The cat sits on the mat."]
    want = minilm.embed(find_onnx(folder), texts)
    client = openai.OpenAI(base_url=f"http://{suite.http_url}/v1", api_key="demo", max_retries=0)
    for fmt in (openai.NOT_GIVEN, "float"):  # the client asks for base64 unless told otherwise
        got = client.embeddings.create(model="minilm", input=texts, encoding_format=fmt)
        assert [d.index for d in got.data] == [0, 1] and got.model == "minilm"
        np.testing.assert_allclose(np.asarray([d.embedding for d in got.data]), want, atol=1e-5)
    one = client.embeddings.create(model="minilm", input="Short.")
    assert len(one.data) == 1 and len(one.data[0].embedding) == minilm.DIM
    with pytest.raises(openai.BadRequestError, match="at most 64"):
        client.embeddings.create(model="minilm", input=["x"] * 65)
    r = requests.post(f"http://{suite.http_url}/v1/embeddings", json={"model": "minilm", "input": []})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_embeddings_usage_is_the_models_own_token_count(minilm_suite):
    suite, _ = minilm_suite
    texts = ["How do I reset my password?", "Short.", "Café au lait, naïve résumé — accents are stripped."]
    # The tokenizer in process (Hugging Face's, outside the graph): [CLS] and [SEP] included.
    want = int(minilm.tokenize(texts)["attention_mask"].sum())
    assert want > 3 * 2
    base = f"http://{suite.http_url}"
    before = requests.get(f"{base}/v2/usage", params={"model": "minilm"}, timeout=10).json()["totals"]
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="demo", max_retries=0)
    got = client.embeddings.create(model="minilm", input=texts)
    assert got.usage.prompt_tokens == want and got.usage.total_tokens == want
    after = requests.get(f"{base}/v2/usage", params={"model": "minilm"}, timeout=10).json()["totals"]
    metered = after[0]["prompt_tokens"] - (before[0]["prompt_tokens"] if before else 0)
    assert metered == want and after[0]["completion_tokens"] == 0
