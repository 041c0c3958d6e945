"""Generation metered in tokens, a tokens-per-minute limit shared through Redis, abandoned non-streamed calls,
and the audit line of each generation.

One suite of its own over the tiny ``codegen`` model, with a tenants file and
a private redis-server that holds the gateway's limits and usage. Each test
uses a tenant of its own, so their usage and buckets do not mix. Clients are
the real ones: the ``openai`` package, requests/httpx and tritonclient.
"""

from __future__ import annotations

import asyncio
import json
import queue
import time

import httpx
import numpy as np
import openai
import pytest
import requests
import tritonclient.grpc as grpcclient
import yaml
from cache.support import RedisServer
from e2e.e2e_support import start_suite
from prometheus_client.parser import text_string_to_metric_families

from aiworks.core.errors import AIWorksError, Status
from aiworks.gateway.auth import generate_api_key
from aiworks.gateway.limits import TenantLimiter
from aiworks.gateway.tenancy import Tenant
from aiworks.security.audit import verify_audit_log

pytestmark = pytest.mark.e2e

TPM = 150  # the limited tenant's tokens per minute: 2.5 tokens/s come back
TENANTS = {
    "meter": {"models": ["codegen"]},
    "tpm": {"models": ["codegen"], "max_tokens_per_minute": TPM},
    "gone": {"models": ["codegen"]},
    "audit": {"models": ["codegen"]},
}


@pytest.fixture(scope="module")
def env(tiny_llm_repo, tmp_path_factory):
    work = tmp_path_factory.mktemp("genusage")
    store = RedisServer(work / "redis")
    store.start()
    keys, tenants = {}, []
    for tenant_id, fields in TENANTS.items():
        keys[tenant_id], digest = generate_api_key()
        tenants.append({"id": tenant_id, **fields, "api_keys": [digest]})
    (work / "tenants.yaml").write_text(yaml.safe_dump({"tenants": tenants}))
    extra = {
        "AIWORKS_GATEWAY_TENANTS_FILE": str(work / "tenants.yaml"),
        "AIWORKS_GATEWAY_REDIS_URL": store.url,
        "AIWORKS_GATEWAY_LIMITS_TIMEOUT_S": "0.5",  # a loaded 2-core machine: no fallback to local limits
        "AIWORKS_GATEWAY_AUDIT_LOG": str(work / "audit.jsonl"),
    }
    try:
        s = start_suite(tiny_llm_repo, work / "logs", replicas=1, cache=False, extra_env=extra)
    except Exception:
        store.stop()
        raise
    yield s, keys, store, work / "audit.jsonl"
    s.supervisor.stop()
    store.stop()


def auth(key: str) -> dict:
    return {"authorization": f"Bearer {key}"}


def usage(suite, key: str) -> dict:
    r = requests.get(f"http://{suite.http_url}/v2/usage", params={"model": "codegen"}, headers=auth(key), timeout=10)
    assert r.status_code == 200, r.text
    totals = r.json()["totals"]
    return totals[0] if totals else {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}


def gateway_tokens(suite, tenant: str) -> dict[str, float]:
    (target,) = suite.supervisor.metrics_targets()["gateway"]
    text = requests.get(f"http://{target}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "aiworks_tenant_tokens":
            for s in family.samples:
                if s.name.endswith("_total") and s.labels["tenant"] == tenant and s.labels["model"] == "codegen":
                    out[s.labels["kind"]] = s.value
    return out


def kv_used(suite) -> float:
    used = 0.0
    for target in suite.supervisor.metrics_targets()["runtime"]:
        text = requests.get(f"http://{target}/metrics", timeout=5).text
        for family in text_string_to_metric_families(text):
            if family.name == "aiworks_runtime_llm_kv_tokens":
                used += sum(s.value for s in family.samples if s.labels.get("kind") == "used")
    return used


def grpc_stream_tokens(suite, key: str, prompt: str, max_tokens: int) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens) of one ModelStreamInfer generation, from its responses' parameters."""
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(suite.grpc_url)
    try:
        client.start_stream(callback=lambda result, error: got.put((result, error)), headers=auth(key))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.asarray([prompt.encode()], dtype=object))
        client.async_stream_infer("codegen", [text], parameters={"max_tokens": max_tokens, "ignore_eos": True},
                                  enable_empty_final_response=True)  # fmt: skip
        prompt_tokens = completion = None
        while True:
            result, error = got.get(timeout=60)
            assert error is None, error.message()
            params = result.get_response().parameters
            if "prompt_tokens" in params:
                prompt_tokens = params["prompt_tokens"].int64_param
            if "completion_tokens" in params:
                completion = params["completion_tokens"].int64_param
            if params["triton_final_response"].bool_param:
                break
        client.stop_stream()
    finally:
        client.close()
    return prompt_tokens, completion


def test_usage_counts_prompt_and_completion_tokens_on_every_front_end(env):
    suite, keys, *_ = env
    key = keys["meter"]
    base = f"http://{suite.http_url}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    more = {"ignore_eos": True}
    done = client.completions.create(model="codegen", prompt="def main(", max_tokens=5, temperature=0, extra_body=more)
    prompt = done.usage.prompt_tokens
    assert prompt >= 2 and done.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model="codegen", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, stream=True, stream_options={"include_usage": True},
                                                 extra_body=more))  # fmt: skip
    chat = chunks[-1].usage
    assert chat.completion_tokens == 4 and chat.prompt_tokens > prompt
    body = {"text_input": "def main(", "max_tokens": 6, "ignore_eos": True}
    r = requests.post(f"{base}/v2/models/codegen/generate", json=body, headers=auth(key), timeout=30)
    assert r.status_code == 200, r.text
    with requests.post(f"{base}/v2/models/codegen/generate_stream", json={**body, "max_tokens": 7},
                       headers=auth(key), stream=True, timeout=30) as r:  # fmt: skip
        assert r.status_code == 200
        assert sum(1 for line in r.iter_lines() if line.startswith(b"data: ")) >= 2
    assert grpc_stream_tokens(suite, key, "def main(", 8) == (prompt, 8)

    got = usage(suite, key)
    assert got["requests"] == 5
    assert got["prompt_tokens"] == 4 * prompt + chat.prompt_tokens
    assert got["completion_tokens"] == 5 + 4 + 6 + 7 + 8
    assert gateway_tokens(suite, "meter") == {"prompt": got["prompt_tokens"], "completion": got["completion_tokens"]}
    # A tenant sees its own usage only; another's tokens are not in it.
    assert usage(suite, keys["gone"])["completion_tokens"] == 0


def test_a_tokens_per_minute_limit_reserves_settles_and_answers_429_everywhere(env):
    suite, keys, store, _ = env
    key = keys["tpm"]
    base = f"http://{suite.http_url}"
    # Learn the greedy text of a prompt (another tenant), to stop this tenant's generation early on it.
    probe = {"text_input": "x", "max_tokens": 30, "ignore_eos": True, "temperature": 0}
    text = requests.post(f"{base}/v2/models/codegen/generate", json=probe, headers=auth(keys["meter"]), timeout=30)
    text = text.json()["text_output"]
    stop = text[2:5]
    assert stop and text.find(stop) < 10, text

    # 1. Reserves 1 + 100 of 150 tokens, uses a handful: the settle gives the rest back...
    early = {**probe, "max_tokens": 100, "stop": [stop]}
    r = requests.post(f"{base}/v2/models/codegen/generate", json=early, headers=auth(key), timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["text_output"] == text[: text.find(stop)]
    # ...so a second reserve of 101 fits. Without the settle, 150 - 101 would leave 49.
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    done = client.completions.create(model="codegen", prompt="x", max_tokens=100, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip
    assert done.usage.completion_tokens == 100

    # 2. Now the bucket holds ~150 - (a few) - (prompt + 100) plus what refilled: far below 101.
    with pytest.raises(openai.RateLimitError) as limited:
        client.completions.create(model="codegen", prompt="x", max_tokens=100)
    err = limited.value
    assert err.status_code == 429 and "rule max_tokens_per_minute" in err.message
    assert f"limit of {TPM} tokens per minute" in err.message and "reserves 101 tokens" in err.message
    assert err.body["type"] == "rate_limit_error" and err.body["code"] == "resource_exhausted"
    assert int(err.response.headers["retry-after"]) >= 5
    r = requests.post(f"{base}/v2/models/codegen/generate", json={"text_input": "x", "max_tokens": 100},
                      headers=auth(key), timeout=30)  # fmt: skip
    assert r.status_code == 429 and "rule max_tokens_per_minute" in r.json()["error"]
    assert int(r.headers["retry-after"]) >= 5
    with pytest.raises(openai.RateLimitError):
        client.chat.completions.create(model="codegen", messages=[{"role": "user", "content": "x"}], max_tokens=100,
                                       stream=True)  # fmt: skip
    got: queue.Queue = queue.Queue()
    stream = grpcclient.InferenceServerClient(suite.grpc_url)
    try:
        stream.start_stream(callback=lambda result, error: got.put((result, error)), headers=auth(key))
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.asarray([b"x"], dtype=object))
        stream.async_stream_infer("codegen", [text], parameters={"max_tokens": 100})
        result, error = got.get(timeout=60)
        # A stream's error travels as its message only (ModelStreamInferResponse.error_message, as Triton's).
        assert result is None and "rule max_tokens_per_minute" in error.message(), error
        stream.stop_stream()
    finally:
        stream.close()
    # A small generation still fits: the limit is on tokens, not requests.
    small = client.completions.create(model="codegen", prompt="x", max_tokens=2, extra_body={"ignore_eos": True})
    assert small.usage.completion_tokens == 2

    # 3. Another gateway sharing the Redis sees the same bucket.
    async def other_gateway():
        limiter = TenantLimiter(store.url, timeout_s=0.5)
        await limiter.start()
        try:
            with pytest.raises(AIWorksError) as info:
                await limiter.admit(Tenant(id="tpm", max_tokens_per_minute=TPM), reserve=101)
            return info.value
        finally:
            await limiter.close()

    shared = asyncio.run(other_gateway())
    assert shared.status is Status.RESOURCE_EXHAUSTED and "rule max_tokens_per_minute" in shared.message
    assert not shared.message.endswith("unreachable)")
    # The tenant's usage holds what the model counted (the refused requests are not in it).
    got = usage(suite, key)
    assert got["requests"] == 3 and 102 < got["completion_tokens"] <= 102 + 30  # the early stop made a few


def test_abandoned_non_streamed_calls_cancel_their_sequences(env):
    suite, keys, *_ = env
    key = keys["gone"]
    base = f"http://{suite.http_url}"
    # 24 calls, of which the KV budget (2,048 tokens) runs 8 at once: the tiny model's engine can outrun the
    # transport (a fifth of the wall time may be most of a wave's tokens), but the waves behind it are cut.
    max_tokens, calls = 240, 24
    body = {"model": "codegen", "prompt": "d", "max_tokens": max_tokens, "ignore_eos": True}

    async def burst(timeout_s: float | None, route: str) -> tuple[float, int]:
        started = time.monotonic()
        async with httpx.AsyncClient(headers=auth(key), timeout=timeout_s) as client:

            async def one(i: int):
                if route == "generate":
                    doc = {"text_input": "d", "max_tokens": max_tokens, "ignore_eos": True}
                    return await client.post(f"{base}/v2/models/codegen/generate", json=doc)
                return await client.post(f"{base}/v1/completions", json=body)

            results = await asyncio.gather(*(one(i) for i in range(calls)), return_exceptions=True)
        answered = [x for x in results if isinstance(x, httpx.Response) and x.status_code == 200]
        if timeout_s is None:
            assert len(answered) == calls, results
        else:  # the first wave may end before the cut; the rest were cut off
            assert len(answered) + sum(isinstance(x, httpx.TimeoutException) for x in results) == calls, results
            assert len(answered) <= calls // 3, results
        return time.monotonic() - started, len(answered)

    asyncio.run(burst(None, "openai"))  # the whole generations; the first burst also pays the engine's warm-up
    assert usage(suite, key)["completion_tokens"] == calls * max_tokens
    for route in ("openai", "generate"):
        # For scale, the whole generations again on this route, warm: timed against a cold first burst, the
        # clients stayed long enough for two of the three waves to end (16 answered under CI's load).
        full_s, _ = asyncio.run(burst(None, route))
        before = usage(suite, key)
        _, answered = asyncio.run(burst(max(0.05, full_s / 5), route))  # the clients go away a fifth of the way in
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and kv_used(suite) != 0:
            time.sleep(0.2)
        assert kv_used(suite) == 0
        after = usage(suite, key)
        abandoned = after["completion_tokens"] - before["completion_tokens"]
        print(route, "full burst", round(full_s, 3), "s; abandoned burst made", abandoned, "tokens")
        # Had they run on, calls * max_tokens more tokens: cancelled, they stopped well short of that.
        assert abandoned < 0.6 * calls * max_tokens, (route, abandoned, full_s)
        # Cut off: not counted as requests (their tokens are). A generation may end while its answer is on the
        # way to a client that leaves: counted, not received.
        assert answered <= after["requests"] - before["requests"] <= calls // 3, route
        assert after["prompt_tokens"] > before["prompt_tokens"], route


def audit_lines(path, tenant: str, count: int, timeout_s: float = 30.0) -> list[dict]:
    """The audit records of ``tenant`` once there are ``count`` of them (the gateway writes every 50 ms)."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = [json.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []
        mine = [r for r in records if r["tenant"] == tenant]
        if len(mine) >= count or time.monotonic() > deadline:
            return mine
        time.sleep(0.2)


def test_each_generation_writes_one_audit_line_with_its_tokens_and_never_its_text(env):
    suite, keys, _, audit_path = env
    key = keys["audit"]
    base = f"http://{suite.http_url}"
    more = {"ignore_eos": True}
    texts = {}  # request id -> the text the client got
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)

    done = client.completions.create(model="codegen", prompt="zebra_quokka_alpha(", max_tokens=12, temperature=0,
                                     extra_body=more)  # fmt: skip
    texts[done.id] = done.choices[0].text
    chunks = list(client.chat.completions.create(
        model="codegen", messages=[{"role": "user", "content": "zebra_quokka_beta("}], max_tokens=10, stream=True,
        stream_options={"include_usage": True}, extra_body=more))  # fmt: skip
    chat_id, chat_usage = chunks[0].id, chunks[-1].usage
    texts[chat_id] = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    body = {"text_input": "zebra_quokka_gamma(", "max_tokens": 11, "ignore_eos": True}
    r = requests.post(f"{base}/v2/models/codegen/generate", json=body,
                      headers={**auth(key), "x-request-id": "audit-generate"}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    texts["audit-generate"] = r.json()["text_output"]
    body = {"text_input": "zebra_quokka_delta(", "max_tokens": 9, "ignore_eos": True, "top_k": 5, "seed": 11,
            "stop": ["zebra_quokka_stop_one", "zebra_quokka_stop_two"]}  # fmt: skip
    with requests.post(f"{base}/v2/models/codegen/generate_stream", json=body, stream=True, timeout=30,
                       headers={**auth(key), "x-request-id": "audit-stream"}) as r:  # fmt: skip
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: ")]
    texts["audit-stream"] = "".join(e["text_output"] for e in events)
    got: queue.Queue = queue.Queue()
    grpc_client = grpcclient.InferenceServerClient(suite.grpc_url)
    try:
        grpc_client.start_stream(callback=lambda result, error: got.put((result, error)),
                                 headers={**auth(key), "x-request-id": "audit-grpc"})  # fmt: skip
        text = grpcclient.InferInput("text_input", [1], "BYTES")
        text.set_data_from_numpy(np.asarray([b"zebra_quokka_epsilon("], dtype=object))
        grpc_client.async_stream_infer("codegen", [text], parameters={"max_tokens": 8, "ignore_eos": True},
                                       enable_empty_final_response=True)  # fmt: skip
        pieces = []
        while True:
            result, error = got.get(timeout=60)
            assert error is None, error.message()
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            pieces.append(result.as_numpy("text_output")[0].decode())
        grpc_client.stop_stream()
    finally:
        grpc_client.close()
    texts["audit-grpc"] = "".join(pieces)
    # A client that leaves after its first piece, and a request the model refuses. The tiny model makes 240
    # tokens in well under a second, so the cancel can arrive after the last: then it is audited as complete
    # (finish "length"), and the client leaves again, up to five times, until one is cut short.
    left_ids = []
    for attempt in range(5):
        left_ids.append(f"audit-left-{attempt}")
        body = {"text_input": "zebra_quokka_zeta(", "max_tokens": 240, "ignore_eos": True}
        with requests.post(f"{base}/v2/models/codegen/generate_stream", json=body, stream=True, timeout=30,
                           headers={**auth(key), "x-request-id": left_ids[-1]}) as r:  # fmt: skip
            first = next(line for line in r.iter_lines() if line.startswith(b"data: "))
        texts[left_ids[-1]] = json.loads(first[6:])["text_output"]
        record = {rec["request_id"]: rec for rec in audit_lines(audit_path, "audit", 5 + len(left_ids))}
        if record[left_ids[-1]]["details"]["finish_reason"] == "cancelled":
            break
    body = {"text_input": "zebra_quokka_eta(", "max_tokens": 5, "temperature": -1}
    r = requests.post(f"{base}/v2/models/codegen/generate", json=body,
                      headers={**auth(key), "x-request-id": "audit-refused"}, timeout=30)  # fmt: skip
    assert r.status_code == 400, r.text

    records = {rec["request_id"]: rec for rec in audit_lines(audit_path, "audit", 6 + len(left_ids))}
    assert set(records) == {done.id, chat_id, "audit-generate", "audit-stream", "audit-grpc", *left_ids,
                            "audit-refused"}  # fmt: skip
    expected = {done.id: (done.usage.prompt_tokens, 12), chat_id: (chat_usage.prompt_tokens, 10),
                "audit-generate": (None, 11), "audit-stream": (None, 9), "audit-grpc": (None, 8)}  # fmt: skip
    for rid, (prompt_tokens, completion_tokens) in expected.items():
        rec = records[rid]
        d = rec["details"]
        assert (rec["kind"], rec["model"], rec["version"], rec["status"]) == ("inference", "codegen", "1", "ok"), rec
        assert d["completion_tokens"] == completion_tokens and d["finish_reason"] == "length", rec
        assert d["prompt_tokens"] == (prompt_tokens or d["prompt_tokens"]) and d["prompt_tokens"] >= 4, rec
        assert 0 < d["ttft_ms"] <= rec["latency_ms"] and d["responses"] >= 1, rec
    # The sampling asked for, as numbers and flags; of the stop strings only their count (they are text).
    counts = {"prompt_tokens", "completion_tokens", "finish_reason", "responses", "ttft_ms"}

    def sampling(rid: str) -> dict:
        return {k: v for k, v in records[rid]["details"].items() if k not in counts}

    assert sampling("audit-generate") == {"max_tokens": 11, "ignore_eos": True}
    assert sampling("audit-stream") == {"max_tokens": 9, "ignore_eos": True, "top_k": 5, "seed": 11,
                                        "stop_strings": 2}  # fmt: skip
    assert sampling("audit-grpc") == {"max_tokens": 8, "ignore_eos": True}
    assert sampling(done.id)["max_tokens"] == 12 and sampling(done.id)["temperature"] == 0, records[done.id]
    left = records[left_ids[-1]]
    assert left["details"]["finish_reason"] == "cancelled" and left["status"] != "ok", left
    assert 1 <= left["details"]["completion_tokens"] < 240 and left["details"]["ttft_ms"] > 0, left
    for rid in left_ids[:-1]:  # the ones that finished before their client's leave reached the runtime
        assert records[rid]["details"]["finish_reason"] == "length", records[rid]
        assert records[rid]["details"]["completion_tokens"] == 240, records[rid]
    refused = records["audit-refused"]
    assert refused["status"] == "invalid_argument" and refused["details"]["finish_reason"] == "error", refused
    assert refused["details"]["completion_tokens"] == 0 and refused["details"]["ttft_ms"] is None, refused

    assert verify_audit_log(audit_path).ok
    raw = audit_path.read_text()
    assert "zebra_quokka" not in raw  # no prompt
    long_texts = [t for t in texts.values() if len(t.strip()) >= 8]
    assert len(long_texts) >= 5, texts
    for t in long_texts:  # nor any text the model made, raw or as JSON would write it
        assert t not in raw and json.dumps(t)[1:-1] not in raw, t
