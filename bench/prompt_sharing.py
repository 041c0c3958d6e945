"""Shared prompts: the ``n`` choices of an OpenAI completion, and a system prompt every request begins with, with
sharing on and off, side by side in one suite.

One random-weight ``codegen`` (the default architecture of ``aiworks llm build``; random
weights are fine for timing) is served twice by one replica of the suite: as ``codegen``
(the built config: prompts shared within the replica, docs/generation.md "Shared
prompts") and as ``codegen_unshared``, the same files with ``share_prompt_min_tokens: 0``
(every choice reads its prompt, each on the engine with the most room; no rows kept). Through
``/v1/completions`` with ``stream: true``, ``n`` choices of one ``--prompt-tokens`` prompt,
``--new-tokens`` each (``ignore_eos``, temperature 1 with a seed):

- lone: one request at a time; each choice's time to its first token, and the request's
  whole time (``--repeats`` requests a model, the two models in turn);
- load: ``--clients`` clients each sending such requests one after another for
  ``--load-s`` seconds (a model at a time, twice each, in turn A B A B): requests/s and
  each choice's time to first token;
- system: the same load of one-choice requests whose prompts all begin with the same
  ``--system-tokens`` tokens (a chat's system prompt) and end with ``--prompt-tokens``
  minus those of their own;
- system_one_client: those requests from one client, one after another: nothing else
  runs when each arrives, so what it copies comes from the rows kept aside
  (``keep_prompts``) after the one before ended.

Both read the same suite on the same cores; ratios are shared / unshared.

Usage: python bench/prompt_sharing.py [--n 4] [--prompt-tokens 192] [--system-tokens 128] [--new-tokens 16]
       [--clients 8] [--load-s 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sysconfig
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson
from tokenizers import Tokenizer

from aiworks.lifecycle.llm import LlmSpec, build
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

SHARED, UNSHARED = "codegen", "codegen_unshared"


def pct(values, q) -> float:
    return round(float(np.percentile(values, q)) * 1e3, 1) if values else float("nan")


def prompt_of(tokenizer: Tokenizer, tokens: int, offset: int) -> str:
    ids = tokenizer.encode((Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()).ids
    return tokenizer.decode(ids[offset : offset + tokens])


async def one_request(session, url: str, model: str, prompt: str, args, seed: int,
                      n: int) -> tuple[list[float], float]:  # fmt: skip
    """One streamed completion of ``n`` choices: each choice's TTFT (s) and the whole request's time."""
    body = {"model": model, "prompt": prompt, "n": n, "max_tokens": args.new_tokens, "temperature": 1.0,
            "seed": seed, "ignore_eos": True, "stream": True}  # fmt: skip
    sent = time.perf_counter()
    firsts: dict[int, float] = {}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            for choice in orjson.loads(line[6:]).get("choices", []):
                firsts.setdefault(choice["index"], time.perf_counter() - sent)
    assert len(firsts) == n, firsts
    return list(firsts.values()), time.perf_counter() - sent


async def lone(url: str, prompts: list[str], args) -> dict:
    out = {m: {"ttft": [], "total": []} for m in (SHARED, UNSHARED)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for i in range(args.repeats):
            for model in (SHARED, UNSHARED) if i % 2 == 0 else (UNSHARED, SHARED):
                ttft, total = await one_request(session, url, model, prompts[i % len(prompts)], args, i, args.n)
                out[model]["ttft"] += ttft
                out[model]["total"].append(total)
    return {m: {"requests": len(v["total"]), "choice_ttft_p50_ms": pct(v["ttft"], 50),
                "choice_ttft_p99_ms": pct(v["ttft"], 99), "request_p50_ms": pct(v["total"], 50)}
            for m, v in out.items()}  # fmt: skip


async def load(url: str, model: str, prompts: list[str], args, n: int, clients: int) -> dict:
    ttft: list[float] = []
    done = 0
    stop = time.perf_counter() + args.load_s

    async def client(session, c: int) -> None:
        nonlocal done
        k = 0
        while time.perf_counter() < stop:
            firsts, _ = await one_request(session, url, model, prompts[(c * 7 + k) % len(prompts)], args, c * 1000 + k,
                                          n)  # fmt: skip
            ttft.extend(firsts)
            done += 1
            k += 1

    started = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(client(session, c) for c in range(clients)))
    elapsed = time.perf_counter() - started
    return {"requests": done, "requests_per_s": round(done / elapsed, 2),
            "tokens_per_s": round(done * n * args.new_tokens / elapsed, 1),
            "choice_ttft_p50_ms": pct(ttft, 50), "choice_ttft_p99_ms": pct(ttft, 99)}  # fmt: skip


def reused_tokens(supervisor: Supervisor) -> float:
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for target in supervisor.metrics_targets()["runtime"]:
        for family in text_string_to_metric_families(requests.get(f"http://{target}/metrics", timeout=5).text):
            total += sum(s.value for s in family.samples if s.name == "aiworks_runtime_llm_prompt_tokens_reused_total")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=192)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--system-tokens", type=int, default=128, help="the system workload's shared beginning")
    parser.add_argument("--repeats", type=int, default=20, help="lone requests a model")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--load-s", type=float, default=15.0, help="seconds of each of a model's two load rounds")
    parser.add_argument("--out", help="write the results as JSON here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build(repo, LlmSpec(random=True), cache_dir=None, progress=False)
        twin = repo / UNSHARED
        shutil.copytree(repo / SHARED, twin)
        config = (twin / "config.pbtxt").read_text().replace(f'name: "{SHARED}"', f'name: "{UNSHARED}"')
        config += 'parameters { key: "share_prompt_min_tokens" value: { string_value: "0" } }\n'
        (twin / "config.pbtxt").write_text(config)
        tokenizer = Tokenizer.from_file(str(repo / SHARED / "1" / "tokenizer.json"))
        prompts = [prompt_of(tokenizer, args.prompt_tokens, 131 * i) for i in range(16)]
        system = prompt_of(tokenizer, args.system_tokens, 5_000)
        assert len(tokenizer.encode(system).ids) >= args.system_tokens - 2, "argparse.py is shorter than expected"
        chats = [system + prompt_of(tokenizer, args.prompt_tokens - args.system_tokens, 131 * i) for i in range(64)]
        suite = SuiteConfig.on_free_ports(model_repository=repo, log_dir=Path(tmp) / "logs", replicas=1, cache=False)
        supervisor = Supervisor(suite)
        supervisor.start()
        try:
            url = f"http://127.0.0.1:{suite.http_port}"
            warm = argparse.Namespace(**{**vars(args), "repeats": 4})
            asyncio.run(lone(url, prompts, warm))
            results = {"setup": vars(args) | {"cpus": os.cpu_count()}}
            before = reused_tokens(supervisor)
            results["lone"] = asyncio.run(lone(url, prompts, args))
            results["lone_reused_tokens"] = reused_tokens(supervisor) - before
            phases = (("load", prompts, args.n, args.clients), ("system", chats, 1, args.clients),
                      ("system_one_client", chats, 1, 1))  # fmt: skip
            for phase, texts, n, clients in phases:
                rounds = {SHARED: [], UNSHARED: []}
                before = reused_tokens(supervisor)
                for model in (SHARED, UNSHARED, SHARED, UNSHARED):
                    rounds[model].append(asyncio.run(load(url, model, texts, args, n, clients)))
                results[phase] = {
                    m: {"rounds": r, "requests_per_s": round(statistics.mean(x["requests_per_s"] for x in r), 2),
                        "choice_ttft_p50_ms": round(statistics.mean(x["choice_ttft_p50_ms"] for x in r), 1)}
                    for m, r in rounds.items()
                }  # fmt: skip
                results[f"{phase}_reused_tokens"] = reused_tokens(supervisor) - before
        finally:
            supervisor.stop()
    lone_s, lone_u = results["lone"][SHARED], results["lone"][UNSHARED]
    load_s, load_u = results["load"][SHARED], results["load"][UNSHARED]
    sys_s, sys_u = results["system"][SHARED], results["system"][UNSHARED]
    one_s, one_u = results["system_one_client"][SHARED], results["system_one_client"][UNSHARED]
    results["ratios_shared_over_unshared"] = {
        "lone_choice_ttft_p50": round(lone_s["choice_ttft_p50_ms"] / lone_u["choice_ttft_p50_ms"], 2),
        "lone_request_p50": round(lone_s["request_p50_ms"] / lone_u["request_p50_ms"], 2),
        "load_requests_per_s": round(load_s["requests_per_s"] / load_u["requests_per_s"], 2),
        "load_choice_ttft_p50": round(load_s["choice_ttft_p50_ms"] / load_u["choice_ttft_p50_ms"], 2),
        "system_requests_per_s": round(sys_s["requests_per_s"] / sys_u["requests_per_s"], 2),
        "system_ttft_p50": round(sys_s["choice_ttft_p50_ms"] / sys_u["choice_ttft_p50_ms"], 2),
        "system_one_client_requests_per_s": round(one_s["requests_per_s"] / one_u["requests_per_s"], 2),
        "system_one_client_ttft_p50": round(one_s["choice_ttft_p50_ms"] / one_u["choice_ttft_p50_ms"], 2),
    }
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
