"""The continuous-batching engine on the real ONNX decoder (random weights): join/leave, budget, cancel, sampling."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest
from tokenizers import Tokenizer

from aiworks.core.errors import InvalidArgument
from aiworks.runtime.llm_backend import OnnxDecoder, parse_sampling
from aiworks.runtime.llm_driver import AsyncEngine
from aiworks.runtime.llm_engine import Engine, Sampling, sample


@pytest.fixture(scope="module")
def parts(tiny_llm_repo):
    version = tiny_llm_repo / "codegen" / "1"
    return OnnxDecoder(version / "model.onnx", 1), Tokenizer.from_file(str(version / "tokenizer.json"))


def make_engine(parts, **kw) -> Engine:
    decoder, tokenizer = parts
    args = dict(context=256, kv_budget_tokens=4096, max_sequences=8, prefill_chunk=64, eos_id=None)
    args.update(kw)
    return Engine(decoder, tokenizer, layers=decoder.layers, heads=decoder.heads, head_dim=decoder.head_dim, **args)


def run_all(engine: Engine, adds=(), max_steps=500):
    """Step until idle; ``adds`` is [(step, prompt, sampling)]: sequences that join at that step."""
    adds = sorted(adds, key=lambda a: a[0])
    seqs, texts, per_step = [], {}, []
    for step in range(max_steps):
        while adds and adds[0][0] <= step:
            _, prompt, sampling = adds.pop(0)
            seqs.append(engine.add(engine.encode(prompt), sampling))
        if not adds and not engine.busy():
            break
        events = engine.step()
        per_step.append(events)
        for e in events:
            texts[id(e.seq)] = texts.get(id(e.seq), "") + e.text
    return [texts.get(id(s), "") for s in seqs], seqs, per_step


def alone(parts, prompt, sampling, **kw):
    return run_all(make_engine(parts, **kw), [(0, prompt, sampling)])[0][0]


def test_sequences_join_and_leave_the_batch_without_changing_their_text(parts):
    prompts = ["def main(args):\n", "import os\nimport sys\n", "class Foo(object):\n    def __init__(self", "x = 1"]
    lengths = [12, 5, 20, 9]
    solo = [alone(parts, p, Sampling(max_tokens=n)) for p, n in zip(prompts, lengths)]
    engine = make_engine(parts)
    # They join at steps 0, 0, 3 and 7 and leave after 12, 5, 20 and 9 tokens.
    joins = [(s, p, Sampling(max_tokens=n)) for s, p, n in zip([0, 0, 3, 7], prompts, lengths)]
    texts, seqs, per_step = run_all(engine, joins)
    assert texts == solo
    assert [len(s.generated) for s in seqs] == lengths and all(s.finish_reason == "length" for s in seqs)
    assert max(len({id(e.seq) for e in events}) for events in per_step) >= 3  # several decoded in one step
    assert engine.used_tokens == 0 and not engine.running and engine.free_slots == 8


def test_a_long_prompt_is_prefilled_in_chunks_while_others_keep_decoding(parts):
    long_prompt = "def f(a, b):\n    return a + b\n" * 12
    engine = make_engine(parts, prefill_chunk=16)
    short = engine.add(engine.encode("import os\n"), Sampling(max_tokens=60, ignore_eos=True))
    engine.step()
    engine.step()
    long = engine.add(engine.encode(long_prompt), Sampling(max_tokens=4))
    chunks = -(-long.prompt.shape[0] // 16)
    assert chunks >= 4
    before = len(short.generated)
    for i in range(chunks):
        engine.step()
        # One chunk of the long prompt a step, and the short sequence's next token in the same step.
        assert long.length == min(16 * (i + 1), long.prompt.shape[0])
        assert len(short.generated) == before + i + 1
    assert long.state == "decode" and len(long.generated) == 1
    while long.state != "done":
        engine.step()
    # Chunked prefill gives the same tokens as one prefill.
    one = make_engine(parts, prefill_chunk=1024)
    same = one.add(one.encode(long_prompt), Sampling(max_tokens=4))
    while same.state != "done":
        one.step()
    assert long.generated == same.generated


def test_admission_waits_for_the_kv_budget_and_gets_it_back(parts):
    engine = make_engine(parts, kv_budget_tokens=40)
    first = engine.add(engine.encode("import os"), Sampling(max_tokens=30))
    second = engine.add(engine.encode("import sys"), Sampling(max_tokens=30))
    engine.step()
    assert first.state in ("decode", "done") and second.state == "waiting"
    assert engine.used_tokens == first.reserve <= 40
    while first.state != "done":
        engine.step()
    engine.step()
    assert second.state in ("prefill", "decode")
    assert engine.used_tokens == second.reserve
    with pytest.raises(InvalidArgument, match="KV budget"):
        engine.add(engine.encode("x"), Sampling(max_tokens=60))


def test_cancelling_frees_the_cache_before_the_next_step(parts):
    engine = make_engine(parts, kv_budget_tokens=200)
    running = engine.add(engine.encode("def f():"), Sampling(max_tokens=100))
    waiting = engine.add(engine.encode("def g():"), Sampling(max_tokens=100))
    for _ in range(3):
        engine.step()
    assert running.state == "decode" and waiting.state == "waiting" and engine.used_tokens == running.reserve
    engine.cancel(waiting)
    assert waiting.state == "done" and not engine.waiting
    engine.cancel(running)
    assert engine.step() == []
    assert engine.used_tokens == 0 and not engine.busy() and engine.free_slots == 8
    assert running.finish_reason == "cancelled"


def test_stop_strings_end_the_text_before_them(parts):
    free = alone(parts, "def main():\n", Sampling(max_tokens=24))
    stop = free[len(free) // 2 : len(free) // 2 + 3]
    assert len(stop) == 3
    cut = alone(parts, "def main():\n", Sampling(max_tokens=24, stop=("@@never@@", stop)))
    assert cut == free[: free.find(stop)]


def test_a_seed_makes_sampling_repeatable(parts):
    s = Sampling(max_tokens=16, temperature=1.0, top_k=50, top_p=0.95, seed=7)
    a, b = alone(parts, "import ", s), alone(parts, "import ", s)
    c = alone(parts, "import ", Sampling(max_tokens=16, temperature=1.0, top_k=50, top_p=0.95, seed=8))
    assert a == b and a != c


def test_sampling_filters():
    rng = np.random.default_rng(0)
    logits = np.asarray([0.0, 3.0, 2.9, -1.0], np.float32)
    assert sample(logits, Sampling(), rng) == 1
    assert {sample(logits, Sampling(temperature=5.0, top_k=2), rng) for _ in range(200)} == {1, 2}
    assert {sample(logits, Sampling(temperature=1.0, top_p=0.01), rng) for _ in range(50)} == {1}


def test_bad_requests_are_refused_with_their_reason(parts):
    engine = make_engine(parts, context=64)
    with pytest.raises(InvalidArgument, match=r"prompt is \d+ tokens; the context window is 64"):
        engine.add(engine.encode("def f(x): return x\n" * 30), Sampling())
    for params, words in (
        ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 10_000}, "max_tokens"), ({"top_p": 0}, "top_p"),
        ({"frequency_penalty": 1.0}, "unknown sampling parameter"), ({"stop": ["ok", 3]}, "stop"),
    ):  # fmt: skip
        with pytest.raises(InvalidArgument, match=words):
            parse_sampling(params, default_max_tokens=16, max_tokens_cap=256)
    s = parse_sampling({"max_tokens": 5, "temperature": 0.5, "stop": '["\\n\\n", "def"]', "seed": 3},
                       default_max_tokens=16, max_tokens_cap=256)  # fmt: skip
    assert s == Sampling(max_tokens=5, temperature=0.5, seed=3, stop=("\n\n", "def"))


async def test_an_abandoned_async_generation_releases_its_kv(parts):
    engine = make_engine(parts, kv_budget_tokens=1000)
    driver = AsyncEngine(engine)
    try:
        long = Sampling(max_tokens=200, ignore_eos=True)
        gens = [driver.generate(engine.encode(f"def f{i}():"), long) for i in range(20)]
        for gen in gens:
            await anext(gen)  # each has started (the budget holds 4 at once: the rest waited their turn)
            await gen.aclose()
        for _ in range(100):
            if not engine.busy():
                break
            await asyncio.sleep(0.01)
        assert engine.used_tokens == 0 and not engine.busy() and engine.free_slots == 8
        full = [e async for e in driver.generate(engine.encode("import os"), Sampling(max_tokens=5, ignore_eos=True))]
        assert full[-1].finished and len(full[-1].seq.generated) == 5
    finally:
        driver.close()


def test_a_trailing_space_is_healed_into_the_first_token(parts):
    engine = make_engine(parts)
    ids, heal = engine.prepare("def ")
    assert heal and ids.tolist() == engine.encode("def").tolist()
    assert engine.prepare("def  ")[1] is False and engine.prepare("x\n")[1] is False
    seq = engine.add(ids, Sampling(max_tokens=6, temperature=1.0, seed=1), heal)
    text = ""
    while seq.state != "done":
        text += "".join(e.text for e in engine.step() if e.seq is seq)
    whole = engine.tokenizer.decode(seq.generated)
    assert whole.startswith(" ") and text == whole[1:]


def test_admission_takes_the_most_urgent_class_first_then_arrival(parts):
    # A budget for one sequence at a time: whoever is admitted next is the admission order.
    engine = make_engine(parts, kv_budget_tokens=40)
    first = engine.add(engine.encode("import os"), Sampling(max_tokens=20, ignore_eos=True), rank=2)
    engine.step()
    assert first.state == "decode"
    arrivals = [("batch-1", 2), ("standard-1", 1), ("batch-2", 2), ("realtime-1", 0), ("standard-2", 1),
                ("realtime-2", 0)]  # fmt: skip
    seqs = {name: engine.add(engine.encode("x = 1"), Sampling(max_tokens=20, ignore_eos=True), rank=rank)
            for name, rank in arrivals}  # fmt: skip
    assert [s.rank for s in engine.waiting] == [0, 0, 1, 1, 2, 2]
    assert engine.waiting_by_rank() == (2, 2, 2)  # what the heartbeat reports, for the router's choice by class
    admitted = []
    for _ in range(500):
        if not engine.busy():
            break
        engine.step()
        admitted += [n for n, s in seqs.items() if s.state != "waiting" and n not in admitted]
        assert len(engine.running) <= 1  # one at a time: the order below is admission's, not a race
    assert admitted == ["realtime-1", "realtime-2", "standard-1", "standard-2", "batch-1", "batch-2"]
    assert all(s.finish_reason == "length" for s in seqs.values()) and engine.used_tokens == 0


def test_a_waiting_urgent_sequence_keeps_freed_room_from_a_later_smaller_one(parts):
    engine = make_engine(parts, kv_budget_tokens=64)
    running = engine.add(engine.encode("import os"), Sampling(max_tokens=30, ignore_eos=True), rank=1)
    engine.step()
    urgent = engine.add(engine.encode("def f():"), Sampling(max_tokens=40, ignore_eos=True), rank=0)
    small = engine.add(engine.encode("x"), Sampling(max_tokens=8, ignore_eos=True), rank=2)
    assert running.reserve + small.reserve <= 64 < running.reserve + urgent.reserve
    engine.step()
    # The small batch sequence would fit beside the running one, but the realtime one is first in line.
    assert small.state == "waiting" and urgent.state == "waiting"
    while running.state != "done":
        engine.step()
    engine.step()
    assert urgent.state in ("prefill", "decode")
    engine.cancel(urgent)
    engine.step()
    assert small.state in ("prefill", "decode", "done")


def test_a_batch_sequence_that_has_waited_competes_as_a_more_urgent_one(parts):
    """Aging: a sequence that has waited ``aging_s`` per class step is admitted ahead of more urgent ones that came
    later, so a stream of urgent generations does not hold batch work back for ever; before that, class order."""
    import time

    engine = make_engine(parts, kv_budget_tokens=40, aging_s=0.2)
    first = engine.add(engine.encode("import os"), Sampling(max_tokens=20, ignore_eos=True), rank=1)
    engine.step()  # it holds the only room
    old_batch = engine.add(engine.encode("x = 1"), Sampling(max_tokens=20, ignore_eos=True), rank=2)
    time.sleep(0.45)  # more than two class steps
    late_realtime = engine.add(engine.encode("y = 2"), Sampling(max_tokens=20, ignore_eos=True), rank=0)
    new_batch = engine.add(engine.encode("z = 3"), Sampling(max_tokens=20, ignore_eos=True), rank=2)
    assert list(engine.waiting) == [old_batch, late_realtime, new_batch]
    assert engine.waiting_by_rank() == (1, 0, 2)  # what the heartbeat reports stays the nominal class
    assert first.state == "decode"
    strict = make_engine(parts, kv_budget_tokens=40, aging_s=0)  # 0: classes strictly first, however long
    strict.add(strict.encode("import os"), Sampling(max_tokens=20, ignore_eos=True), rank=1)
    strict.step()
    waited = strict.add(strict.encode("x = 1"), Sampling(max_tokens=20, ignore_eos=True), rank=2)
    time.sleep(0.45)
    urgent = strict.add(strict.encode("y = 2"), Sampling(max_tokens=20, ignore_eos=True), rank=0)
    assert list(strict.waiting) == [urgent, waited]


async def test_the_backend_queues_by_the_requests_class(tiny_llm_repo):
    from aiworks.core.datatypes import Tensor, serialize_items
    from aiworks.core.inference import InferRequest
    from aiworks.core.model_config import read_config
    from aiworks.core.options import Priority, RequestOptions
    from aiworks.runtime.llm_backend import LlmModel

    folder = tiny_llm_repo / "codegen"
    one = dataclasses.replace(read_config(folder), instance_count=1)  # the order within one engine
    model = LlmModel(folder / "1" / "model.onnx", one, 1)
    model.engine.kv_budget_tokens = 80  # one sequence at a time: the first holds ~67 tokens, the others ~15 each
    try:
        order: list[str] = []

        async def generate(name: str, priority: Priority) -> None:
            raw = serialize_items([b"import os"])
            request = InferRequest("codegen", "1", [Tensor("text_input", "BYTES", (1,), raw)],
                                   parameters={"max_tokens": 64 if name == "first" else 12, "ignore_eos": True})  # fmt: skip
            async for _ in model.stream(request, RequestOptions(priority=priority)):
                if name not in order:
                    order.append(name)

        tasks = [asyncio.create_task(generate("first", Priority.STANDARD))]
        while not model.engine.running:
            await asyncio.sleep(0.001)
        for name, priority in (("batch", Priority.BATCH), ("standard", Priority.STANDARD),
                               ("realtime", Priority.REALTIME)):  # fmt: skip
            tasks.append(asyncio.create_task(generate(name, priority)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == ["first", "realtime", "standard", "batch"]
    finally:
        model.close()


async def test_a_consumer_that_falls_behind_gets_the_waiting_steps_joined(parts):
    engine = make_engine(parts)
    decoder = engine.runner

    def paced(*args):  # a step of a real model's length (the tiny one's outruns any reader), the GIL let go
        time.sleep(0.003)
        return decoder(*args)

    engine.runner = paced
    driver = AsyncEngine(engine)
    sampling = Sampling(max_tokens=40, ignore_eos=True)
    try:
        prompt = engine.encode("def main(args):\n")
        prompt_text = alone(parts, "def main(args):\n", sampling)
        eager = [e async for e in driver.generate(prompt, sampling)]
        slow = []
        async for event in driver.generate(prompt, sampling):
            slow.append(event)
            while engine.busy():  # read only after the engine has made every token
                await asyncio.sleep(0.005)
        assert "".join(e.text for e in eager) == "".join(e.text for e in slow) == prompt_text
        assert sum(e.tokens for e in eager) == sum(e.tokens for e in slow) == 40
        assert len(slow) == 2 and slow[1].tokens > 30 and slow[1].finished  # one event for the steps that waited
        assert len(eager) > len(slow)
        # An event loop that gets back to this generation only after it was all made (here it is blocked
        # on purpose) finds every step's events queued at once: the first token still goes out alone.
        late = driver.generate(prompt, sampling)
        head = asyncio.ensure_future(late.__anext__())
        await asyncio.sleep(0)  # the sequence is added; its reader waits on the queue
        while engine.busy():
            time.sleep(0.005)  # the loop blocked: no event is delivered meanwhile
        rest = [await head] + [e async for e in late]
        assert [e.tokens for e in rest] == [1, 39] and "".join(e.text for e in rest) == prompt_text
    finally:
        driver.close()


def test_a_new_sequences_first_token_comes_before_the_decode_batch(parts):
    engine = make_engine(parts)
    old = engine.add(engine.encode("import os\n"), Sampling(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    new = engine.add(engine.encode("def main():\n"), Sampling(max_tokens=50, ignore_eos=True))
    before = len(old.generated)
    first = engine.prefill_step()
    assert [e.seq for e in first] == [new] and len(new.generated) == 1 and len(old.generated) == before
    rest = engine.decode_step()  # the rows decoding when the step began; the new one decodes next step
    assert [e.seq for e in rest] == [old] and len(old.generated) == before + 1 and len(new.generated) == 1
    engine.step()
    assert len(new.generated) == 2 and len(old.generated) == before + 2


async def test_two_instances_share_the_replicas_budget_and_run_side_by_side(tiny_llm_repo):
    from aiworks.core.datatypes import Tensor, deserialize_bytes, serialize_items
    from aiworks.core.inference import InferRequest
    from aiworks.core.model_config import read_config
    from aiworks.core.options import RequestOptions
    from aiworks.runtime.llm_backend import LlmModel

    folder = tiny_llm_repo / "codegen"
    config = read_config(folder)
    assert config.instance_count == 2  # what `aiworks llm build` writes by default
    model = LlmModel(folder / "1" / "model.onnx", config, 1)
    try:
        assert [e.kv_budget_tokens for e in model.engines] == [1024, 1024]
        assert [e.max_sequences for e in model.engines] == [8, 8]
        assert model.kv_room() == (2048, 2048, 0, (0, 0, 0))

        async def generate(text: str) -> str:
            raw = serialize_items([text.encode()])
            request = InferRequest("codegen", "1", [Tensor("text_input", "BYTES", (1,), raw)],
                                   parameters={"max_tokens": 24, "ignore_eos": True})  # fmt: skip
            out = []
            async for answer in model.stream(request, RequestOptions()):
                out.append(deserialize_bytes(answer.outputs[0].raw, 1)[0].decode())
            return "".join(out)

        prompts = ["import os", "def main():", "class A:", "for i in range(3):"]
        together = await asyncio.gather(*(generate(p) for p in prompts))
        assert all(e.steps > 0 for e in model.engines)  # the four were spread over both engines
        alone = [await generate(p) for p in prompts]
        assert together == alone  # greedy: the same text whichever instance ran it, with whichever neighbours
        assert model.kv_use() == (0, 2048)
    finally:
        model.close()


async def test_generations_whose_prompts_begin_alike_join_one_instance_and_read_it_once(tiny_llm_repo):
    from aiworks.core.datatypes import Tensor, deserialize_bytes, serialize_items
    from aiworks.core.inference import InferRequest
    from aiworks.core.model_config import read_config
    from aiworks.core.options import RequestOptions
    from aiworks.runtime.llm_backend import LlmModel

    folder = tiny_llm_repo / "codegen"
    model = LlmModel(folder / "1" / "model.onnx", read_config(folder), 1)
    try:

        async def generate(text: str) -> str:
            raw = serialize_items([text.encode()])
            request = InferRequest("codegen", "1", [Tensor("text_input", "BYTES", (1,), raw)],
                                   parameters={"max_tokens": 24, "ignore_eos": True})  # fmt: skip
            return "".join([deserialize_bytes(a.outputs[0].raw, 1)[0].decode()
                            async for a in model.stream(request, RequestOptions())])  # fmt: skip

        n = model.engine.encode(SHARED).shape[0]
        together = await asyncio.gather(*(generate(p) for p in [SHARED] * 4 + ["x = 1"]))
        # The four alike went to one engine, which read the prompt once: the other three copied it whole (read in
        # the same batch) or all but its last token (read before they came); the short one went to the other.
        reused = sorted(e.reused_tokens for e in model.engines)
        assert reused[0] == 0 and 3 * (n - 1) <= reused[1] <= 3 * n, (reused, n)
        assert all(e.steps > 0 for e in model.engines)
        assert together == [await generate(p) for p in [SHARED] * 4 + ["x = 1"]]  # greedy: as read alone
        # A beginning that every request shares (a system prompt) does not pile them up on one engine: each takes
        # them while it holds at most SHARE_SLACK more than the other, so both hold it and copy it.
        before = [e.reused_tokens for e in model.engines]
        await asyncio.gather(*(generate(SHARED + f"x{i} = {i}\n") for i in range(8)))
        deltas = [e.reused_tokens - b for e, b in zip(model.engines, before)]
        assert all(d >= n - 1 for d in deltas), (deltas, n)
    finally:
        model.close()


def test_an_instance_count_that_leaves_an_instance_less_than_the_context_is_refused(tiny_llm_repo):
    from aiworks.core.model_config import read_config
    from aiworks.runtime.llm_backend import LlmModel

    folder = tiny_llm_repo / "codegen"
    config = dataclasses.replace(read_config(folder), instance_count=16)  # 2,048 tokens: 128 an instance
    with pytest.raises(InvalidArgument, match=r"instance_group count 16 leave an instance 128 tokens.*256 tokens"):
        LlmModel(folder / "1" / "model.onnx", config, 1)


def test_log_probabilities_are_the_models_distribution_over_each_chosen_token(parts):
    """Each generated token gets one entry: its log probability under the model's softmax (here the whole
    vocabulary's, so it sums to 1), the likeliest first; greedy picks the likeliest; EOS-free text unchanged."""
    decoder, tokenizer = parts
    vocab = tokenizer.get_vocab_size()
    plain = alone(parts, "def main(args):\n", Sampling(max_tokens=6, ignore_eos=True))
    engine = make_engine(parts)
    seq = engine.add(engine.encode("def main(args):\n"), Sampling(max_tokens=6, ignore_eos=True, logprobs=vocab))
    text, entries = "", []
    while seq.state != "done":
        for event in engine.step():
            text += event.text
            entries += event.logprobs
            assert len(event.logprobs) == event.tokens
    assert text == plain and [e[0] for e in entries] == seq.generated
    for token, lp, top in entries:
        assert len(top) == vocab and top[0][0] == token and top[0][1] == lp  # greedy: the likeliest
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert abs(sum(np.exp(v) for _, v in top) - 1.0) < 1e-6
    sampled = engine.add(engine.encode("x = "), Sampling(max_tokens=5, temperature=1.5, seed=4, logprobs=2))
    got = []
    while sampled.state != "done":
        got += [lp for e in engine.step() for lp in e.logprobs]
    assert [e[0] for e in got] == sampled.generated and all(len(e[2]) == 2 and e[1] <= e[2][0][1] for e in got)
    plain_seq = engine.add(engine.encode("x = "), Sampling(max_tokens=3))
    while plain_seq.state != "done":
        assert all(e.logprobs == () for e in engine.step())


def test_token_pieces_are_the_tokens_bytes(parts):
    from aiworks.runtime.llm_backend import TokenPieces

    _, tokenizer = parts
    pieces = TokenPieces(tokenizer).pieces
    assert len(pieces) == tokenizer.get_vocab_size()
    whole = 0
    for i, (text, raw) in enumerate(pieces):
        try:
            decoded = bytes(raw).decode("utf-8")
        except UnicodeDecodeError:  # part of a character: its text says so
            assert "\ufffd" in text
            continue
        whole += 1
        assert decoded == text == tokenizer.decode([i], skip_special_tokens=False), i
    assert whole > len(pieces) // 2
    eos = tokenizer.token_to_id("<|endoftext|>")
    assert pieces[eos] == ("<|endoftext|>", list(b"<|endoftext|>"))


def test_logprobs_and_prompt_logprobs_are_sampling_parameters_from_0_to_20():
    limits = {"default_max_tokens": 8, "max_tokens_cap": 64}
    assert parse_sampling({}, **limits).logprobs == -1
    assert parse_sampling({"logprobs": 0}, **limits).logprobs == 0
    assert parse_sampling({"logprobs": 20}, **limits).logprobs == 20
    assert parse_sampling({"prompt_logprobs": 3}, **limits).prompt_logprobs == 3
    assert parse_sampling({}, **limits).prompt_logprobs == -1
    for bad in (-1, 21, 1.5, "x", True):
        for name in ("logprobs", "prompt_logprobs"):
            with pytest.raises(InvalidArgument, match=name):
                parse_sampling({name: bad}, **limits)


def test_prompt_log_probabilities_read_across_chunks_match_one_read(parts):
    """A prompt scored in chunks (a long one, or beside others) gets the same log probabilities as in one read,
    one per token but the first, each under the logits of the position before it; its generation is unchanged."""
    decoder, tokenizer = parts
    prompt = "import os\nimport sys\n\ndef main(args):\n    return args\n"
    sampling = Sampling(max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    whole = make_engine(parts, prefill_chunk=256)
    one = whole.add(whole.encode(prompt), sampling)
    run_all(whole)
    chunked = make_engine(parts, prefill_chunk=5)
    other = chunked.add(chunked.encode("x = 1"), Sampling(max_tokens=3))  # read beside it, in its group
    many = chunked.add(chunked.encode(prompt), sampling)
    run_all(chunked)
    n = len(one.prompt)
    assert n > 10 and len(one.prompt_logprobs) == len(many.prompt_logprobs) == n - 1
    assert [e[0] for e in one.prompt_logprobs] == one.prompt[1:].tolist()
    for a, b in zip(one.prompt_logprobs, many.prompt_logprobs):
        assert a[0] == b[0] and abs(a[1] - b[1]) < 1e-4 and [t for t, _ in a[2]] == [t for t, _ in b[2]]
        assert len(a[2]) == 2 and a[2][0][1] >= a[1] - 1e-9  # the likeliest first
    assert one.generated == many.generated and other.prompt_logprobs == []
    assert one.generated[0] == int(np.argmax(one.carry))  # the prompt's last logits chose the first token (greedy)
    scored = whole.add(whole.encode(prompt), Sampling(max_tokens=0, prompt_logprobs=0))  # scored, nothing generated
    events = [e for step in run_all(whole)[2] for e in step]
    assert [(e.text, e.finished, e.tokens) for e in events] == [("", True, 0)] and scored.generated == []
    assert [e[0] for e in scored.prompt_logprobs] == [e[0] for e in one.prompt_logprobs]
    assert np.allclose([e[1] for e in scored.prompt_logprobs], [e[1] for e in one.prompt_logprobs], atol=1e-5)
    assert scored.finish_reason == "length" and whole.used_tokens == 0 and not whole.running


def counting_engine(parts, **kw) -> tuple[Engine, list[tuple[int, int]]]:
    """An engine whose decoder calls are recorded: each call's new tokens as (rows, columns), padding included."""
    decoder, _ = parts
    read: list[tuple[int, int]] = []

    def runner(ids, *rest):
        read.append(ids.shape)
        return decoder(ids, *rest)

    engine = make_engine(parts, **kw)
    engine.runner = runner
    return engine, read


SHARED = "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n"


def test_equal_prompts_in_one_batch_are_read_once_and_sampled_apart(parts):
    engine, read = counting_engine(parts, prefill_chunk=256)
    prompt = engine.encode(SHARED)
    n = int(prompt.shape[0])
    assert n > 16
    choices = [Sampling(max_tokens=12, temperature=0.9, seed=seed, ignore_eos=True) for seed in (1, 2, 3)]
    seqs = [engine.add(prompt, s) for s in choices] + [engine.add(engine.encode("x = 1\n"), Sampling(max_tokens=4))]
    texts = {}
    while engine.busy():
        for e in engine.step():
            texts[id(e.seq)] = texts.get(id(e.seq), "") + e.text
    # The first step read the prompt once (the other two copied its row), and the short one in a call of its own.
    assert read[:2] == [(1, n), (1, engine.encode("x = 1\n").shape[0])]
    assert [s.reused for s in seqs] == [0, n, n, 0] and engine.reused_tokens == 2 * n
    # Each choice samples on its own: its text is the one it makes alone with its seed.
    solo = [alone(parts, SHARED, s) for s in choices]
    assert [texts[id(s)] for s in seqs[:3]] == solo and len(set(solo)) > 1
    assert engine.used_tokens == 0 and not engine.running


def test_a_prompt_that_begins_like_a_running_sequence_reads_only_the_rest(parts):
    engine, read = counting_engine(parts)
    head = engine.encode(SHARED)
    first = engine.add(head, Sampling(max_tokens=30, ignore_eos=True))
    for _ in range(3):
        engine.step()
    tail = engine.encode("    args = parser.parse_args(argv)\n")
    longer = np.concatenate([head, tail])
    held = first.cached()
    expected = next((i for i in range(min(held.shape[0], longer.shape[0] - 1)) if held[i] != longer[i]),
                    min(held.shape[0], longer.shape[0] - 1))  # fmt: skip
    assert expected >= head.shape[0]
    before = len(read)
    second = engine.add(longer, Sampling(max_tokens=10))
    same = engine.add(head, Sampling(max_tokens=10))  # the whole prompt is in the first one's row
    texts = {}
    while engine.busy():
        for e in engine.step():
            texts[id(e.seq)] = texts.get(id(e.seq), "") + e.text
    assert second.reused == expected and same.reused == head.shape[0] - 1
    # What they read of their prompts: the rest of the longer one (a chunk over its copied history) and the last
    # token of the same one; every other call was a decode step (one token a row).
    assert [shape for shape in read[before:] if shape[1] > 1] == [(1, longer.shape[0] - expected)]
    for seq, ids in ((second, longer), (same, head)):
        fresh = make_engine(parts)
        alone_seq = fresh.add(ids, Sampling(max_tokens=10))
        out = ""
        while fresh.busy():
            out += "".join(e.text for e in fresh.step() if e.seq is alone_seq)
        assert texts[id(seq)] == out  # greedy: the same text as reading the whole prompt
    assert engine.used_tokens == 0 and engine.reused_tokens == expected + head.shape[0] - 1


def test_a_prompt_scored_for_its_log_probabilities_is_read_whole(parts):
    engine, _ = counting_engine(parts, prefill_chunk=256)
    prompt = engine.encode(SHARED)
    plain = engine.add(prompt, Sampling(max_tokens=3))
    scored = engine.add(prompt, Sampling(max_tokens=3, prompt_logprobs=1))
    while engine.busy():
        engine.step()
    assert plain.reused == 0 and scored.reused == 0 and len(scored.prompt_logprobs) == prompt.shape[0] - 1


def test_tenants_do_not_share_prompts(parts):
    """Equal prompts of two scopes (tenants) are each read; a first token that came sooner would tell a tenant that
    another one's prompt begins as its own."""
    engine, read = counting_engine(parts, prefill_chunk=256)
    prompt = engine.encode(SHARED)
    a, b, a2 = (engine.add(prompt, Sampling(max_tokens=3), scope=s) for s in ("acme", "globex", "acme"))
    engine.step()
    assert (a.reused, b.reused, a2.reused) == (0, 0, prompt.shape[0])
    late = engine.add(prompt, Sampling(max_tokens=3), scope="globex")
    other = engine.add(prompt, Sampling(max_tokens=3), scope="initech")
    while engine.busy():
        engine.step()
    assert (late.reused, other.reused) == (prompt.shape[0] - 1, 0)


def finish(engine: Engine, *seqs) -> dict:
    texts = {}
    while engine.busy():
        for e in engine.step():
            texts[id(e.seq)] = texts.get(id(e.seq), "") + e.text
    return texts


def test_a_later_prompt_copies_what_a_finished_sequence_read_and_wrote(parts):
    """The rows of finished sequences are kept aside (keep_prompts): a system prompt sent again, or a chat's next turn
    (the last turn's prompt and answer, then more), copies them instead of reading them."""
    engine, read = counting_engine(parts, keep_prompts=2)
    head = engine.encode(SHARED)
    first = engine.add(head, Sampling(max_tokens=12, ignore_eos=True))
    finish(engine)
    assert not engine.running and len(engine.kept) == 1
    turn = np.concatenate([first.cached(), engine.encode("\n    args = parser.parse_args(argv)\n")])
    before = len(read)
    second = engine.add(turn, Sampling(max_tokens=8))
    texts = finish(engine)
    assert second.reused == first.cached().shape[0]  # its prompt and all it wrote but its last token
    assert [shape for shape in read[before:] if shape[1] > 1] == [(1, turn.shape[0] - second.reused)]
    fresh = make_engine(parts, keep_prompts=0)
    alone_seq = fresh.add(turn, Sampling(max_tokens=8))
    assert texts[id(second)] == finish(fresh)[id(alone_seq)] and alone_seq.reused == 0 and not fresh.kept
    # Two rows kept: the next turn replaced the first's row (it holds all of it and more); two more prompts of
    # other beginnings push it out, least recently used first.
    assert len(engine.kept) == 1
    for text in ("class Config(object):\n    def __init__(self, path):\n        self.path = path\n",
                 "for index, value in enumerate(values):\n    total += value * index\n"):
        engine.add(engine.encode(text), Sampling(max_tokens=4))
        finish(engine)
    assert len(engine.kept) == 2 and all(e.head != first.head for e in engine.kept)
    again = engine.add(head, Sampling(max_tokens=2))
    finish(engine)
    assert again.reused == 0


def test_kept_rows_stay_with_their_tenant(parts):
    engine, _ = counting_engine(parts, keep_prompts=2)
    prompt = engine.encode(SHARED)
    engine.add(prompt, Sampling(max_tokens=3), scope="acme")
    finish(engine)
    other = engine.add(prompt, Sampling(max_tokens=3), scope="globex")
    same = engine.add(prompt, Sampling(max_tokens=3), scope="acme")
    finish(engine)
    assert (other.reused, same.reused) == (0, prompt.shape[0] - 1)


def test_shared_prompts_never_change_a_sequences_text_under_churn(parts):
    """Many sequences whose prompts share beginnings (three stems, tails of their own), joining at random steps,
    some cancelled, through a small cache with rows kept aside: each text is the one it makes alone with
    sharing off, and every row and budget comes back."""
    rng = np.random.default_rng(7)
    probe = make_engine(parts)
    stems = [probe.encode(SHARED)[:30], probe.encode("class Config(object):\n    def __init__(self, path, mode):\n")]
    stems.append(np.concatenate([stems[0][:20], probe.encode(" # a comment that goes on for a while\n")]))
    engine, _ = counting_engine(parts, max_sequences=5, prefill_chunk=48, keep_prompts=2)
    plan = []
    for _ in range(24):
        stem = stems[int(rng.integers(len(stems)))]
        tail = rng.integers(100, 1000, size=int(rng.integers(0, 12)))  # token ids (the tiny vocabulary: 1,024)
        plan.append((int(rng.integers(0, 40)), np.concatenate([stem, tail]).astype(np.int64),
                     int(rng.integers(2, 10)), bool(rng.random() < 0.2)))  # fmt: skip
    plan.sort(key=lambda p: p[0])
    seqs, texts, step = [], {}, 0
    while plan or engine.busy():
        while plan and plan[0][0] <= step:
            _, prompt, max_tokens, cancel = plan.pop(0)
            seq = engine.add(prompt, Sampling(max_tokens=max_tokens, ignore_eos=True))
            seqs.append((seq, prompt, max_tokens, cancel))
        for seq, _, _, cancel in seqs:
            if cancel and len(seq.generated) == 1 and seq.state != "done":
                engine.cancel(seq)
        for e in engine.step():
            texts[id(e.seq)] = texts.get(id(e.seq), "") + e.text
        step += 1
    assert engine.reused_tokens > 0 and engine.used_tokens == 0 and not engine.running
    finished = [(s, p, m) for s, p, m, cancel in seqs if not cancel]
    assert len(finished) >= 15 and sum(s.reused > 0 for s, _, _ in finished) >= 5
    for seq, prompt, max_tokens in finished:
        fresh = make_engine(parts, share_min_tokens=0)
        alone_seq = fresh.add(prompt, Sampling(max_tokens=max_tokens, ignore_eos=True))
        assert texts.get(id(seq), "") == finish(fresh).get(id(alone_seq), ""), (prompt, seq.reused)
