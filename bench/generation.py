"""Generation throughput and latency: in-process baselines against the suite (issue 18's targets).

One random-weight ``codegen`` (the default architecture of ``aiworks llm build``:
6 layers, width 384, 4,096 tokens, 12.3 M parameters; random weights are fine
for timing; ``--precision`` fp32, the default build, or int8) is served three ways,
each with ``--clients`` requests of ``--prompt-tokens`` prompt tokens and
``--new-tokens`` new tokens (``ignore_eos``, greedy):

- (a) one request at a time, in process, through the same ONNX model with its
  KV cache (the engine with one sequence slot);
- (b) static batching, in process: wait for a batch of 8, run it until its
  longest member is done, then the next;
- (c) the suite (scheduler, one runtime replica, gateway): ``--clients``
  concurrent clients on ``/v2/models/codegen/generate_stream`` (SSE); its
  last round also reports each process's CPU, in cores, and the benchmark's
  own clients' (``cpu_cores_last_round``): all of it shares the same cores.

Beside them, not a case of the issue's: the suite's engines alone
(``c_engines_alone``), in process with no serving, the workload split
between them as the replica splits it; (c) against it is what serving costs.

All requests arrive at once; TTFT is measured from then (a, b) or from each
client's send (c). Each case runs its whole workload ``--rounds`` times (2)
on one engine or suite and reports the last round: the first round of each
is cold (its rate is kept as ``first_round_tokens_per_s``). Then TTFT in
steady state through the suite: the same clients, their first requests
spread over one generation's time, each sending its next request when its
last ends; the requests sent in the window after that ramp count (about 32
generations running when each arrives). Also the cost of streaming: a lone
generation through ``/generate`` against ``/generate_stream`` (mean of
``--repeats``).

No prompt is sent twice: each round, the lone requests and the streaming
runs have prompts of their own (slices of argparse.py that begin apart), and
the steady clients go through all of them. The engines share a prompt's
beginning with the sequences running and keep finished rows aside
(docs/generation.md, "Shared prompts"); this workload must not get that for
free, as a repeated prompt would.

Usage: python bench/generation.py [--precision fp32|int8] [--clients 32] [--prompt-tokens 64] [--new-tokens 128]
       [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import aiohttp
import numpy as np
from mtls_overhead import cpu_by_kind
from tokenizers import Tokenizer

from aiworks.lifecycle.llm import LlmSpec, build
from aiworks.runtime.llm_backend import OnnxDecoder
from aiworks.runtime.llm_engine import Engine, Sampling
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor


def pct(values, q) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def prompts(tokenizer: Tokenizer, n: int, length: int) -> list[str]:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    ids = tokenizer.encode(text).ids
    return [tokenizer.decode(ids[i * 97 : i * 97 + length]) for i in range(n)]


def in_process(version: Path, rounds: list[list[str]], new_tokens: int, batch: int) -> dict:
    """(a) with batch 1, (b) with batch 8: each batch runs to its end before the next is admitted. Each of
    ``rounds`` (its prompts) runs on one engine in turn; the figures are the last round's
    (``first_round_tokens_per_s`` keeps the first, cold one's rate)."""
    decoder = OnnxDecoder(version / "model.onnx", threads=int(os.environ.get("BENCH_THREADS", "2")))
    tokenizer = Tokenizer.from_file(str(version / "tokenizer.json"))
    engine = Engine(decoder, tokenizer, layers=decoder.layers, heads=decoder.heads, head_dim=decoder.head_dim,
                    context=256, kv_budget_tokens=1 << 20, max_sequences=batch, prefill_chunk=256)  # fmt: skip
    sampling = Sampling(max_tokens=new_tokens, ignore_eos=True)
    first = None
    for texts in rounds:
        ttft, gaps, tokens = [], [], 0
        started = time.perf_counter()
        for i in range(0, len(texts), batch):
            seqs = [engine.add(engine.encode(t), sampling) for t in texts[i : i + batch]]
            last = {id(s): None for s in seqs}
            while engine.busy():
                engine.step()
                now = time.perf_counter()
                for s in seqs:
                    if s.generated and last[id(s)] is None:
                        ttft.append(now - started)
                        last[id(s)] = (now, len(s.generated))
                    elif last[id(s)] is not None and len(s.generated) > last[id(s)][1]:
                        gaps.append(now - last[id(s)][0])
                        last[id(s)] = (now, len(s.generated))
            tokens += sum(len(s.generated) for s in seqs)
        result = summary(ttft, gaps, tokens, time.perf_counter() - started)
        first = first or result["tokens_per_s"]
    return {**result, "first_round_tokens_per_s": first}


def engines_alone(version: Path, rounds: list[list[str]], new_tokens: int, instances: int, threads: int) -> dict:
    """The suite's engines with no serving: ``instances`` engines of ``threads`` ONNX Runtime threads, each in a
    thread of its own stepping its share of ``texts`` (all at once) to the end, as the replica's would. Its rate
    against (c)'s is what the serving (the runtime's event loop, gRPC, the gateway, the clients) costs on the
    same cores. Only tokens/s: it is a ceiling for (c), not a case of the issue's."""
    tokenizer = Tokenizer.from_file(str(version / "tokenizer.json"))
    engines = []
    for _ in range(instances):
        decoder = OnnxDecoder(version / "model.onnx", threads=threads)
        engines.append(Engine(decoder, tokenizer, layers=decoder.layers, heads=decoder.heads,
                              head_dim=decoder.head_dim, context=256, kv_budget_tokens=1 << 20,
                              max_sequences=-(-len(rounds[0]) // instances), prefill_chunk=256))  # fmt: skip
    sampling = Sampling(max_tokens=new_tokens, ignore_eos=True)

    def run(engine: Engine, share: list[str]) -> None:
        for text in share:
            engine.add(engine.encode(text), sampling)
        while engine.busy():
            engine.step()

    rates = []
    for texts in rounds:
        started = time.perf_counter()
        workers = [threading.Thread(target=run, args=(e, texts[i::instances])) for i, e in enumerate(engines)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        rates.append(round(len(texts) * new_tokens / (time.perf_counter() - started), 1))
    return {"tokens_per_s": rates[-1], "first_round_tokens_per_s": rates[0]}


def summary(ttft, gaps, tokens, elapsed) -> dict:
    return {
        "tokens_per_s": round(tokens / elapsed, 1),
        "ttft_p50_ms": round(pct(ttft, 50) * 1e3, 1), "ttft_p99_ms": round(pct(ttft, 99) * 1e3, 1),
        "itl_p50_ms": round(pct(gaps, 50) * 1e3, 2), "itl_p99_ms": round(pct(gaps, 99) * 1e3, 2),
        "tokens": tokens, "elapsed_s": round(elapsed, 2),
    }  # fmt: skip


async def one_stream(session, url: str, text: str, new_tokens: int, ttft: list, gaps: list) -> int:
    body = {"text_input": text, "max_tokens": new_tokens, "ignore_eos": True}
    sent = time.perf_counter()
    last, pieces = None, 0
    async with session.post(f"{url}/v2/models/codegen/generate_stream", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            if last is None:
                ttft.append(now - sent)
            else:
                gaps.append(now - last)
            last, pieces = now, pieces + 1
    return pieces


async def suite_run(url: str, rounds: list[list[str]], new_tokens: int, lone_texts: list[str],
                    supervisor=None) -> dict:  # fmt: skip
    """Each of ``rounds``' prompts all at once, a round after the other; the figures are the last round's, as
    :func:`in_process`'s. ``lone_texts``: a warm-up and the lone requests' prompts (one each).

    With ``supervisor``, also where the CPU went in the last round: each kind of process's cores (CPU
    seconds over the round's wall time, from /proc), the benchmark's own clients included.
    """
    first, cores = None, {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await one_stream(session, url, lone_texts[0], 4, [], [])  # warm
        lone: list[float] = []
        for text in lone_texts[1:]:  # a lone request's TTFT through the suite, the reference for TTFT under load
            await one_stream(session, url, text, 8, lone, [])
        for texts in rounds:
            ttft, gaps = [], []
            cpu_before = cpu_by_kind(supervisor) if supervisor else {}
            clients_before = time.process_time()
            started = time.perf_counter()
            await asyncio.gather(*(one_stream(session, url, t, new_tokens, ttft, gaps) for t in texts))
            elapsed = time.perf_counter() - started
            result = summary(ttft, gaps, len(texts) * new_tokens, elapsed)
            first = first or result["tokens_per_s"]
            if supervisor:
                cpu_after = cpu_by_kind(supervisor)
                cores = {kind: round((cpu_after[kind] - cpu_before.get(kind, 0.0)) / elapsed, 3) for kind in cpu_after}
                cores["bench_clients"] = round((time.process_time() - clients_before) / elapsed, 3)
    extra = {"cpu_cores_last_round": cores} if cores else {}
    return {**result, "first_round_tokens_per_s": first, "lone_ttft_ms": round(pct(lone, 50) * 1e3, 1), **extra}


async def steady_run(url: str, texts: list[str], clients: int, new_tokens: int, generation_s: float,
                     window_s: float) -> dict:  # fmt: skip
    """TTFT in steady state: the ``clients``' first requests are spread over one generation's time, then each
    sends its next as its last ends; the requests sent during the ``window_s`` after that ramp count. Client i's
    k-th request sends ``texts[(i + k * clients) % len(texts)]``."""
    ttft: list[float] = []
    gap = generation_s / clients
    ramp_end = time.perf_counter() + generation_s
    stop = ramp_end + window_s

    async def client(session, i: int) -> None:
        await asyncio.sleep(i * gap)
        k = 0
        while time.perf_counter() < stop:
            counted = time.perf_counter() >= ramp_end
            seen: list[float] = []
            await one_stream(session, url, texts[(i + k * clients) % len(texts)], new_tokens, seen, [])
            k += 1
            if counted:
                ttft.extend(seen)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session, i) for i in range(clients)))
    return {"requests": len(ttft), "ttft_p50_ms": round(pct(ttft, 50) * 1e3, 1),
            "ttft_p99_ms": round(pct(ttft, 99) * 1e3, 1)}  # fmt: skip


async def streaming_cost(url: str, texts: list[str], new_tokens: int) -> dict:
    """A lone generation through ``/generate`` and then ``/generate_stream``, a pair of ``texts`` each (as many
    repeats as pairs)."""
    times = {"generate": [], "generate_stream": []}
    async with aiohttp.ClientSession() as session:
        for i in range(0, len(texts) - 1, 2):
            for route, text in zip(times, texts[i : i + 2]):
                body = {"text_input": text, "max_tokens": new_tokens, "ignore_eos": True}
                t0 = time.perf_counter()
                async with session.post(f"{url}/v2/models/codegen/{route}", json=body) as r:
                    await r.read()
                times[route].append(time.perf_counter() - t0)
    once, stream = statistics.mean(times["generate"]), statistics.mean(times["generate_stream"])
    lone = {"generate_s": round(once, 3), "generate_stream_s": round(stream, 3)}
    return {**lone, "streaming_overhead_pct": round(100 * (stream / once - 1), 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steady-s", type=float, default=0.0,
                        help="steady-state window for TTFT (default: twice the burst's time)")  # fmt: skip
    parser.add_argument("--precision", choices=["fp32", "int8"], default="fp32",
                        help="the decoder's matrix products, as `aiworks llm build --precision` (default fp32)")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=2,
                        help="each case runs its whole workload this many times, on one engine or suite, and reports "
                        "the last round (default 2: the first, cold round warms ONNX Runtime's buffers up)")
    parser.add_argument("--instances", type=int, default=2,
                        help="the suite's engines in its one replica (instance_group count; default 2, the build's)")
    parser.add_argument("--threads", type=int, default=1,
                        help="ONNX Runtime threads of each of the suite's engines (default 1, the build's)")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build(repo, LlmSpec(random=True), cache_dir=None, progress=False, kv_budget_tokens=1 << 16, max_sequences=64,
              precision=args.precision, instances=args.instances, threads=args.threads)  # fmt: skip
        version = repo / "codegen" / "1"
        c, extra = args.clients, 6 + 2 * args.repeats  # the lone requests (a warm-up, five), the streaming pairs
        tokenizer = Tokenizer.from_file(str(version / "tokenizer.json"))
        texts = prompts(tokenizer, c * args.rounds + extra, args.prompt_tokens)
        assert len({tuple(tokenizer.encode(t).ids[:16]) for t in texts}) == len(texts), "two prompts begin alike"
        rounds, own = [texts[r * c : (r + 1) * c] for r in range(args.rounds)], texts[c * args.rounds :]
        results = {"setup": vars(args) | {"cpus": os.cpu_count()}}
        lone = in_process(version, [own[:1]], args.new_tokens, 1)
        results["lone_request_ttft_ms_in_process"] = lone["ttft_p50_ms"]
        results["a_one_at_a_time"] = in_process(version, rounds, args.new_tokens, 1)
        results["b_static_batch_8"] = in_process(version, rounds, args.new_tokens, 8)
        results["c_engines_alone"] = engines_alone(version, rounds, args.new_tokens, args.instances, args.threads)
        config = SuiteConfig.on_free_ports(model_repository=repo, log_dir=Path(tmp) / "logs", replicas=1, cache=False)
        supervisor = Supervisor(config)
        supervisor.start()
        try:
            url = f"http://127.0.0.1:{config.http_port}"
            results["c_suite"] = asyncio.run(suite_run(url, rounds, args.new_tokens, own[:6], supervisor))
            generation_s = results["c_suite"]["elapsed_s"]
            results["c_steady"] = asyncio.run(
                steady_run(url, texts, c, args.new_tokens, generation_s, args.steady_s or 2 * generation_s)
            )
            results["streaming"] = asyncio.run(streaming_cost(url, own[6:], args.new_tokens))
        finally:
            supervisor.stop()
    a, b, c = (results[k]["tokens_per_s"] for k in ("a_one_at_a_time", "b_static_batch_8", "c_suite"))
    results["ratios"] = {
        "c_over_a": round(c / a, 2), "c_over_b": round(c / b, 2),
        "c_over_its_engines_alone": round(c / results["c_engines_alone"]["tokens_per_s"], 2),
        "c_ttft_p50_over_lone_in_suite": round(
            results["c_suite"]["ttft_p50_ms"] / results["c_suite"]["lone_ttft_ms"], 2
        ),
        "c_steady_ttft_p50_over_lone_in_suite": round(
            results["c_steady"]["ttft_p50_ms"] / results["c_suite"]["lone_ttft_ms"], 2
        ),
    }  # fmt: skip
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
