"""``/v1/embeddings`` through ``minilm`` with the official openai client (base64 by default, and float), and the
tokens-per-minute bucket it draws on."""

from __future__ import annotations

import time

import numpy as np
import openai
import pytest
import redis
import requests
import yaml
from cache.support import RedisServer
from e2e.e2e_support import start_suite

from aiworks.gateway.auth import generate_api_key
from aiworks.lifecycle import minilm
from aiworks.lifecycle.layout import find_onnx

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def minilm_repo(tmp_path_factory):
    root = tmp_path_factory.mktemp("embed")
    minilm.build(root / "repo", workdir=root / "work")
    return root / "repo"


@pytest.fixture(scope="module")
def minilm_suite(minilm_repo, tmp_path_factory):
    s = start_suite(minilm_repo, tmp_path_factory.mktemp("embed-logs"), replicas=1, cache=False)
    yield s, minilm_repo / "minilm"
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


TPM = 60  # one token a second comes back


@pytest.fixture(scope="module")
def limited_suite(minilm_repo, tmp_path_factory):
    """The same model behind a gateway with tenants and Redis: tenant ``emb`` may use TPM tokens a minute."""
    work = tmp_path_factory.mktemp("embed-tpm")
    store = RedisServer(work / "redis")
    store.start()
    key, digest = generate_api_key()
    tenants = [{"id": "emb", "models": ["minilm"], "max_tokens_per_minute": TPM, "api_keys": [digest]}]
    (work / "tenants.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    extra = {"AIWORKS_GATEWAY_TENANTS_FILE": str(work / "tenants.yaml"), "AIWORKS_GATEWAY_REDIS_URL": store.url,
             "AIWORKS_GATEWAY_LIMITS_TIMEOUT_S": "2"}  # a loaded machine: no fallback to local limits  # fmt: skip
    try:
        s = start_suite(minilm_repo, work / "logs", replicas=1, cache=False, extra_env=extra)
    except Exception:
        store.stop()
        raise
    yield s, key, store.url
    s.supervisor.stop()
    store.stop()


def test_embeddings_draw_on_the_tokens_per_minute_bucket_and_settle_to_the_models_count(limited_suite):
    suite, key, redis_url = limited_suite
    base = f"http://{suite.http_url}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    # 1. Estimated at 202 bytes / 4 + 2 = 53 tokens (of the 60 in the bucket), counted 4:
    #    [CLS] x y [SEP]. The settle gives 49 back.
    sparse = client.embeddings.create(model="minilm", input="x" + " " * 200 + "y")
    assert sparse.usage.prompt_tokens == 4
    # The release goes out as the answer does, a Redis round trip later (a few ms here); a client quicker than
    # that would find the reserve still taken (the safe side).
    bucket = redis.Redis.from_url(redis_url)
    deadline = time.monotonic() + 10
    while float(bucket.hget("aiworks:limits:v1:{emb}:tokens", "tokens")) < 50 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert 55 <= float(bucket.hget("aiworks:limits:v1:{emb}:tokens", "tokens")) <= 60
    # 2. Reserves 4 x 27 bytes / 4 + 4 x 2 = 35: it fits only because the first request settled (60 - 4 = 56 left;
    #    unsettled, 60 - 53 = 7 and a token a second).
    question = "How do I reset my password?"
    second = client.embeddings.create(model="minilm", input=[question] * 4)
    assert second.usage.prompt_tokens == 36  # 9 tokens each, [CLS] and [SEP] included
    # 3. About 56 - 36 = 20 left now: the same request again is over the limit, with the time until it fits.
    with pytest.raises(openai.RateLimitError) as limited:
        client.embeddings.create(model="minilm", input=[question] * 4)
    err = limited.value
    assert "rule max_tokens_per_minute" in err.message and "reserves 35 tokens" in err.message, err.message
    assert err.body["type"] == "rate_limit_error" and int(err.response.headers["retry-after"]) >= 5
    # 4. The bucket is the tenant's on every front end: the model's own infer route draws on it too.
    meta = requests.get(f"{base}/v2/models/minilm", headers={"authorization": f"Bearer {key}"}, timeout=10).json()
    body = {"inputs": [{"name": meta["inputs"][0]["name"], "datatype": "BYTES", "shape": [4, 1],
                        "data": [question] * 4}]}  # fmt: skip
    r = requests.post(f"{base}/v2/models/minilm/infer", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=10)  # fmt: skip
    assert r.status_code == 429 and "rule max_tokens_per_minute" in r.json()["error"], r.text
    # Usage holds what the model counted; the refused requests are not in it.
    usage = requests.get(f"{base}/v2/usage", params={"model": "minilm"}, headers={"authorization": f"Bearer {key}"},
                         timeout=10).json()["totals"][0]  # fmt: skip
    assert usage["requests"] == 2 and usage["prompt_tokens"] == 4 + 36
