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


def runtimes_sample(suite, sample: str) -> float:
    """One sample's value summed over the runtime replicas' /metrics (e.g. a counter's ``..._total``)."""
    total = 0.0
    for target in suite.supervisor.metrics_targets()["runtime"]:
        text = requests.get(f"http://{target}/metrics", timeout=5).text
        total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == sample)
    return total


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


# ---- OpenAI-compatible routes, with the official client unchanged ----------------------------------


@pytest.fixture
def openai_client(suite):
    import openai

    return openai.OpenAI(base_url=f"http://{suite.http_url}/v1", api_key="demo-mode-takes-any-key", max_retries=0)


def test_openai_completions_streaming_and_not(suite, openai_client):
    assert "codegen" in [m.id for m in openai_client.models.list()]
    once = requests.post(url(suite, "/v2/models/codegen/generate"),
                         json={"text_input": "import ", "max_tokens": 8, "ignore_eos": True}).json()  # fmt: skip
    more = {"ignore_eos": True}  # a random model may end at once; vLLM's extension keeps it going
    done = openai_client.completions.create(model="codegen", prompt="import ", max_tokens=8, temperature=0,
                                            extra_body=more)  # fmt: skip
    assert done.object == "text_completion" and done.model == "codegen"
    assert done.choices[0].text == once["text_output"][: len(done.choices[0].text)]
    assert done.choices[0].finish_reason in ("length", "stop")
    assert done.usage.prompt_tokens >= 1 and done.usage.completion_tokens == 8
    assert done.usage.total_tokens == done.usage.prompt_tokens + done.usage.completion_tokens
    chunks = list(openai_client.completions.create(model="codegen", prompt="import ", max_tokens=8, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body=more))  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == done.choices[0].text and len(chunks) >= 3
    assert chunks[-1].usage.completion_tokens == done.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == done.choices[0].finish_reason
    with requests.post(url(suite, "/v1/completions"), stream=True,
                       json={"model": "codegen", "prompt": "x", "max_tokens": 3, "stream": True}) as r:  # fmt: skip
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]"


def test_openai_chat_completions(openai_client):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
    done = openai_client.chat.completions.create(model="codegen", messages=messages, max_tokens=10, seed=3,
                                                 extra_body={"ignore_eos": True})  # fmt: skip
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant"
    assert done.usage.prompt_tokens > 10 and done.usage.completion_tokens >= 1
    again = openai_client.chat.completions.create(model="codegen", messages=messages, max_tokens=10, seed=3,
                                                  extra_body={"ignore_eos": True})  # fmt: skip
    assert again.choices[0].message.content == done.choices[0].message.content  # the seed repeats
    stream = openai_client.chat.completions.create(model="codegen", messages=messages, max_tokens=10, seed=3,
                                                   stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == done.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_openai_n_choices_streaming_and_not(suite, openai_client):
    """``n`` choices of one prompt, side by side: each its own generation (choice i samples with seed + i), the
    usage counts the prompt once and every choice's tokens, and streamed chunks carry each choice's index."""
    import openai

    ask = {"model": "codegen", "prompt": "def ", "max_tokens": 6, "temperature": 1.0, "seed": 7,
           "extra_body": {"ignore_eos": True, "top_k": 50}}  # fmt: skip
    three = openai_client.completions.create(n=3, **ask)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.text for c in three.choices]
    assert len(set(texts)) > 1, texts  # their own seeds: different samples
    assert all(c.finish_reason == "length" for c in three.choices)
    one = openai_client.completions.create(**ask)
    assert one.choices[0].text == texts[0]  # choice 0 is the request's own seed
    assert three.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert three.usage.completion_tokens == 3 * one.usage.completion_tokens == 18
    assert openai_client.completions.create(n=3, **ask).choices[2].text == texts[2]  # and they repeat
    chunks = list(openai_client.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **ask))
    streamed = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)}
    assert [streamed[i] for i in range(3)] == texts
    ends = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(e.index for e in ends) == [0, 1, 2] and {e.finish_reason for e in ends} == {"length"}
    assert chunks[-1].usage.completion_tokens == 18 and chunks[-1].usage.prompt_tokens == one.usage.prompt_tokens
    messages = [{"role": "user", "content": "def add(a, b):"}]
    chat = openai_client.chat.completions.create(model="codegen", messages=messages, max_tokens=4, n=2, seed=1,
                                                 extra_body={"ignore_eos": True})  # fmt: skip
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
    chat_chunks = list(openai_client.chat.completions.create(model="codegen", messages=messages, max_tokens=4, n=2,
                                                             seed=1, stream=True, extra_body={"ignore_eos": True}))  # fmt: skip
    roles = sorted(c.choices[0].index for c in chat_chunks if c.choices[0].delta.role == "assistant")
    assert roles == [0, 1]
    for i in (0, 1):
        text = "".join(c.choices[0].delta.content or "" for c in chat_chunks if c.choices[0].index == i)
        assert text == chat.choices[i].message.content
    # A list of prompts: n choices each, choice j of prompt p at index p * n + j, each prompt counted once.
    other = openai_client.completions.create(**{**ask, "prompt": "class "})
    both = openai_client.completions.create(n=2, **{**ask, "prompt": ["def ", "class "]})
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [both.choices[0].text, both.choices[1].text, both.choices[2].text] == [texts[0], texts[1],
                                                                                  other.choices[0].text]  # fmt: skip
    assert both.usage.prompt_tokens == one.usage.prompt_tokens + other.usage.prompt_tokens
    assert both.usage.completion_tokens == 4 * 6
    with pytest.raises(openai.BadRequestError) as too_many:
        openai_client.completions.create(model="codegen", prompt=["x"] * 5, max_tokens=2, n=4)
    assert "asks for 20 generations; at most 16" in too_many.value.message
    for bad in (0, 9, 1.5, True):
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client.completions.create(model="codegen", prompt="x", max_tokens=2, n=bad)
        assert "'n' must be an integer from 1 to 8" in refused.value.message
    assert llm_gauges(suite).get(("aiworks_runtime_llm_sequences", "running"), 0) == 0  # every choice ended


def test_the_n_choices_of_a_request_share_their_prompts_cache_entries(suite, openai_client):
    """The ``n`` choices go to the replica, then the engine, that holds their prompt already; all but the first copy
    its keys and values instead of reading it (docs/generation.md, "Shared prompts"), and sample on their own."""
    prompt = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n"
    ask = {"model": "codegen", "prompt": prompt, "max_tokens": 40, "temperature": 1.0, "seed": 11,
           "extra_body": {"ignore_eos": True}}  # fmt: skip
    reused = "aiworks_runtime_llm_prompt_tokens_reused_total"
    # Both replicas answer something first: affinity, like any routing, keeps a replica never measured (on
    # probation, one request at a time) out of a burst, and then the choices would meet only by room.
    openai_client.completions.create(model="codegen", prompt=["a = 1", "b = 2", "c = 3", "d = 4"], max_tokens=2)
    before = runtimes_sample(suite, reused)
    four = openai_client.completions.create(n=4, **ask)
    copied = runtimes_sample(suite, reused) - before
    tokens = four.usage.prompt_tokens
    assert tokens > 16 and four.usage.completion_tokens == 4 * 40  # the usage still counts the prompt once
    # The suite has two replicas, but the gateway sends the four where the first went (prompt affinity), and that
    # replica's engine reads the prompt once: three choices copied it (all of it, or all but its last token when
    # the first had read it already).
    assert copied >= 3 * (tokens - 1), (copied, tokens)
    texts = [c.text for c in four.choices]
    assert len(set(texts)) == 4  # each sampled on its own
    assert four.usage.prompt_tokens_details.cached_tokens == 0  # one choice read the prompt for the others
    # The gateway counts the four's KV reserves on their replica until its next figures (heartbeats, 1 s), and
    # affinity yields while that replica looks three reserves fuller than the other: wait for fresh figures.
    time.sleep(2.5)
    alone = openai_client.completions.create(**{**ask, "seed": 11 + 3})  # choice i samples with seed + i
    assert alone.choices[0].text == texts[3]
    # It went where the four went (affinity), whose engine kept their rows: it copied all but the last token,
    # and says so as OpenAI does.
    assert alone.usage.prompt_tokens == tokens and alone.usage.prompt_tokens_details.cached_tokens == tokens - 1
    before = runtimes_sample(suite, reused)
    chunks = list(openai_client.completions.create(n=4, stream=True, **ask))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(4)]
    assert streamed == texts and runtimes_sample(suite, reused) - before >= 3 * (tokens - 1)


def test_openai_log_probabilities_and_echo_streaming_and_not(suite, openai_client):
    """Chat's logprobs/top_logprobs and completions' logprobs come in each API's own shape, through the official
    client, streamed and not, one entry per generated token; echo puts the prompt first; bad mixes get a 400."""
    import openai

    more = {"ignore_eos": True}
    chat_ask = {"model": "codegen", "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 6,
                "temperature": 0, "logprobs": True, "top_logprobs": 3, "extra_body": more}  # fmt: skip
    chat = openai_client.chat.completions.create(**chat_ask)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    assert "".join(t.token for t in content).startswith(chat.choices[0].message.content)
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob  # greedy
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        if "\ufffd" not in t.token:
            assert bytes(t.bytes).decode() == t.token
    streamed = [t for c in openai_client.chat.completions.create(stream=True, **chat_ask)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]  # fmt: skip
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]
    bare = openai_client.chat.completions.create(**{**chat_ask, "logprobs": False, "top_logprobs": None})
    assert bare.choices[0].logprobs is None and bare.choices[0].message.content == chat.choices[0].message.content

    ask = {"model": "codegen", "prompt": "import ", "max_tokens": 8, "temperature": 0, "extra_body": more}
    done = openai_client.completions.create(logprobs=2, **ask)
    lp, text = done.choices[0].logprobs, done.choices[0].text
    assert "".join(lp.tokens) == text and len(lp.tokens) == len(lp.token_logprobs) == 8
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert token in top and top[token] == value and len(top) <= 3 and max(top.values()) == value
    chunks = [c.choices[0] for c in openai_client.completions.create(logprobs=2, stream=True, **ask) if c.choices]
    tokens = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset
    assert openai_client.completions.create(**ask).choices[0].logprobs is None

    echoed = openai_client.completions.create(echo=True, **ask)
    assert echoed.choices[0].text == "import " + text
    echo_chunks = openai_client.completions.create(echo=True, stream=True, **ask)
    assert "".join(c.choices[0].text for c in echo_chunks if c.choices) == "import " + text
    # echo with logprobs scores the prompt too (how evaluation harnesses read a text's likelihood: max_tokens 1).
    scored_ask = {**ask, "prompt": "import os\nimport sys\n", "max_tokens": 1}
    scored = openai_client.completions.create(echo=True, logprobs=1, **scored_ask)
    slp, prompt_tokens = scored.choices[0].logprobs, scored.usage.prompt_tokens
    assert "".join(slp.tokens) == scored.choices[0].text and scored.choices[0].text.startswith("import os\nimport sys\n")
    assert len(slp.tokens) == prompt_tokens + 1 and slp.token_logprobs[0] is None and slp.top_logprobs[0] is None
    assert all(v <= 0 for v in slp.token_logprobs[1:]) and all(len(t) <= 2 for t in slp.top_logprobs[1:])
    assert slp.text_offset == [sum(len(t) for t in slp.tokens[:i]) for i in range(len(slp.tokens))]
    streamed_scores = [(t, v) for c in openai_client.completions.create(echo=True, logprobs=1, stream=True,
                                                                        **scored_ask)
                       if c.choices and c.choices[0].logprobs
                       for t, v in zip(c.choices[0].logprobs.tokens, c.choices[0].logprobs.token_logprobs)]  # fmt: skip
    assert [t for t, _ in streamed_scores] == slp.tokens
    zero = openai_client.completions.create(echo=True, logprobs=1, **{**scored_ask, "max_tokens": 0})  # score only
    assert zero.choices[0].text == "import os\nimport sys\n" and zero.usage.completion_tokens == 0
    assert zero.choices[0].logprobs.tokens == slp.tokens[:-1] and zero.choices[0].finish_reason == "length"
    assert [round(v, 4) for v in zero.choices[0].logprobs.token_logprobs[1:]] == [
        round(v, 4) for v in slp.token_logprobs[1:-1]
    ]
    with pytest.raises(openai.BadRequestError) as no_tokens:
        openai_client.completions.create(**{**scored_ask, "max_tokens": 0})
    assert "'max_tokens'" in no_tokens.value.message
    assert [round(v, 4) if v is not None else None for _, v in streamed_scores] == [
        round(v, 4) if v is not None else None for v in slp.token_logprobs
    ]

    # Triton's generate extension passes the parameter to the backend and answers its entries as they are.
    healed = requests.post(url(suite, "/v2/models/codegen/generate"),
                           json={"text_input": "def ", "max_tokens": 5, "ignore_eos": True, "logprobs": 1}).json()  # fmt: skip
    assert len(healed["logprobs"]) == 5 and "".join(e[0] for e in healed["logprobs"]) == healed["text_output"]
    prompt_only = requests.post(url(suite, "/v2/models/codegen/generate"),
                                json={"text_input": "import os\n", "max_tokens": 0, "prompt_logprobs": 0}).json()  # fmt: skip
    assert prompt_only["text_output"] == "" and "".join(e[0] for e in prompt_only["prompt_logprobs"]) == "import os\n"
    assert prompt_only["prompt_logprobs"][0][2] is None and all(e[2] <= 0 for e in prompt_only["prompt_logprobs"][1:])
    for bad, words in (({"logprobs": 6}, "'logprobs' must be an integer from 0 to 5"),
                       ({"echo": "yes"}, "'echo' must be a boolean")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client.completions.create(model="codegen", prompt="x", max_tokens=2, **bad)
        assert words in refused.value.message
    for bad, words in (({"top_logprobs": 2}, "'top_logprobs' needs 'logprobs': true"),
                       ({"logprobs": True, "top_logprobs": 21}, "'top_logprobs' must be an integer from 0 to 20")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as refused:
            openai_client.chat.completions.create(model="codegen", messages=chat_ask["messages"], max_tokens=2, **bad)
        assert words in refused.value.message


def test_clients_that_leave_n_choices_leave_no_sequence_running(suite):
    """Several choices of one request, abandoned streamed after the first chunk or unstreamed mid-generation: every
    choice's sequence is cancelled, and the KV cache is as it was."""
    kv, seqs = "aiworks_runtime_llm_kv_tokens", "aiworks_runtime_llm_sequences"
    body = {"model": "codegen", "prompt": "def ", "max_tokens": 200, "ignore_eos": True, "n": 4}
    for _ in range(10):
        with requests.post(url(suite, "/v1/completions"), json={**body, "stream": True}, stream=True, timeout=30) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # a first chunk came; the client goes away with four choices running
    for _ in range(3):  # eight choices of 250 tokens take about 0.5 s here: the connection closes long before
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(url(suite, "/v1/completions"), json={**body, "n": 8, "max_tokens": 250}, timeout=(5, 0.05))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = llm_gauges(suite)
        if now[(kv, "used")] == 0 and now[(seqs, "running")] == 0 and now[(seqs, "waiting")] == 0:
            break
        time.sleep(0.2)
    assert now[(kv, "used")] == 0 and now[(seqs, "running")] == 0 and now[(seqs, "waiting")] == 0, now


def test_openai_errors_come_in_openais_format(suite, openai_client):
    import openai

    with pytest.raises(openai.BadRequestError) as bad:
        openai_client.completions.create(model="codegen", prompt="x", max_tokens=0)
    assert bad.value.status_code == 400 and "max_tokens" in bad.value.message
    assert bad.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError):
        openai_client.completions.create(model="no-such-model", prompt="x")
    assert openai_client.models.retrieve("codegen").id == "codegen"
    with pytest.raises(openai.NotFoundError) as unknown:
        openai_client.models.retrieve("no-such-model")
    assert unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as long_prompt:
        openai_client.completions.create(model="codegen", prompt="def f(x): return x\n" * 60, stream=True)
    assert "context window" in long_prompt.value.message
    r = requests.post(url(suite, "/v1/completions"), json={"model": "codegen", "prompt": "x", "best_of": 3})
    assert r.status_code == 400 and "best_of" in r.json()["error"]["message"]


def test_the_usage_counts_as_cached_what_every_choice_of_a_prompt_copied():
    """``prompt_tokens_details.cached_tokens`` (OpenAI's field): per prompt, the fewest of its choices' copied
    tokens, since the prompt is counted once; the first responses of two prompts with two choices each."""
    from types import SimpleNamespace

    from aiworks.gateway.openai_routes import _usage

    def first(prompt: int, cached: int = 0):
        params = {"prompt_tokens": prompt} | ({"cached_prompt_tokens": cached} if cached else {})
        return SimpleNamespace(parameters=params)

    last = SimpleNamespace(parameters={"completion_tokens": 5})
    usage = _usage([first(40), first(40, 39), first(30, 29), first(30, 20)], [last] * 4, n=2)
    assert usage == {"prompt_tokens": 70, "completion_tokens": 20, "total_tokens": 90,
                     "prompt_tokens_details": {"cached_tokens": 20}}  # fmt: skip
