"""Result-cache and cold-start benchmark.

One run measures, side by side on the same machine and the same suite:

  (a) hit path vs miss path: digits v2 (about 6 ms a row) over gRPC, one
      repeated input (all hits) vs fresh inputs (all misses), and fresh inputs
      on the same model without a cache (the miss path's overhead);
  (b) a Zipf-distributed workload of repeated inputs: hit rate, and throughput
      with the cache vs without it on the same request sequence;
  (c) where the cache does not pay: iris (microseconds of compute), fresh
      inputs, with and without the cache;
  (d) cold start of the demo models in the runtime (load, warm-up, first request);
  (e) per-tenant cache keys vs shared ones (``cache_scope: shared``, the keys
      the cache had before it knew tenants): the Zipf workload's hit rate for
      one tenant, the same request sequence sent to both models in
      interleaved chunks, in a suite with a tenants file.

Each cached model is a copy of the demo model with ``response_cache { enable:
true }``; the plain copies are what the default policy (cache off unless the
config enables it) serves. The gateway uses its production settings (10 ms
lookup timeout).

The cached copies set ``report_cache_hit: true`` so the client can count hits.

Usage: python bench/cache_bench.py [--store memory|redis|both] [--duration-s 5] [--out FILE]
       python bench/cache_bench.py --tenant-keys-only [--tenant-requests 6000]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from aiworks.demo.models import build_demo_repository
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

ROOT = Path(__file__).resolve().parent.parent


# ---- the benchmark repository --------------------------------------------------------------------


def bench_repository(demo: Path, root: Path) -> Path:
    """Cached and plain copies of digits v2 and iris, and a digits copy that shares its entries across tenants.

    Model files are hard-linked (copied across file systems): the runtime refuses a link that leaves
    the repository (docs/security.md).
    """
    digits = (demo / "digits" / "config.pbtxt").read_text().replace("version_policy: { all { } }\n", "")
    iris = (demo / "iris" / "config.pbtxt").read_text()
    sources = {"digits": (digits, demo / "digits" / "2"), "iris": (iris, demo / "iris" / "1")}
    cached = "response_cache { enable: true }\n" + _param("report_cache_hit", "true")
    variants = {
        "digits": (("plain", ""), ("cached", cached), ("shared", cached + _param("cache_scope", "shared"))),
        "iris": (("plain", ""), ("cached", cached)),
    }
    for base, (config, version_dir) in sources.items():
        for variant, extra in variants[base]:
            name = f"{base}_{variant}"
            (root / name / "1").mkdir(parents=True)
            _link_or_copy(version_dir / "model.onnx", root / name / "1" / "model.onnx")
            text = config.replace(f'name: "{base}"', f'name: "{name}"') + extra
            (root / name / "config.pbtxt").write_text(text)
    return root


def _param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


# ---- load ----------------------------------------------------------------------------------------


def make_inputs(count: int, features: int, seed: int):
    import tritonclient.grpc.aio as grpcclient

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        inp = grpcclient.InferInput("input", [1, features], "FP32")
        inp.set_data_from_numpy(rng.random((1, features), dtype=np.float32))
        out.append(inp)
    return out


async def drive(url: str, model: str, pick, concurrency: int, duration_s: float) -> dict:
    """Closed loop: ``concurrency`` workers send ``pick(i)`` requests for ``duration_s``."""
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    latencies: list[float] = []
    hits = errors = 0
    counter = iter(range(10**12))
    deadline = time.perf_counter() + duration_s

    async def worker():
        nonlocal hits, errors
        while time.perf_counter() < deadline:
            inp = pick(next(counter))
            started = time.perf_counter()
            try:
                result = await client.infer(model, [inp])
            except Exception:  # counted, not fatal
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)
            params = result.get_response().parameters
            hits += "cache_hit" in params and params["cache_hit"].bool_param

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await client.close()
    return {"model": model, "concurrency": concurrency, "latencies": latencies, "hits": hits, "errors": errors,
            "elapsed_s": elapsed}


def summarize(runs: list[dict]) -> dict:
    latencies = sorted(x for r in runs for x in r["latencies"])
    n = len(latencies)
    return {
        "model": runs[0]["model"],
        "concurrency": runs[0]["concurrency"],
        "requests": n,
        "errors": sum(r["errors"] for r in runs),
        "rps": n / sum(r["elapsed_s"] for r in runs),
        "p50_ms": latencies[n // 2] * 1e3 if n else float("nan"),
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1e3 if n else float("nan"),
        "hit_rate": sum(r["hits"] for r in runs) / n if n else 0.0,
    }


async def side_by_side(url: str, cases: list[tuple], concurrency: int, duration_s: float, rounds: int = 3) -> list[dict]:
    """Run each (model, pick) case for duration_s in total, interleaved in ``rounds`` slices.

    The machine is shared and noisy: interleaving exposes every case to the same noise.
    """
    runs: list[list[dict]] = [[] for _ in cases]
    for _ in range(rounds):
        for i, (model, pick) in enumerate(cases):
            runs[i].append(await drive(url, model, pick, concurrency, duration_s / rounds))
    return [summarize(r) for r in runs]


def show(label: str, r: dict) -> None:
    print(
        f"  {label:<34} c={r['concurrency']:<3} {r['rps']:>8.0f} req/s  p50 {r['p50_ms']:>7.2f} ms  "
        f"p99 {r['p99_ms']:>7.2f} ms  hits {r['hit_rate']:>5.1%}  errors {r['errors']}"
    )


def walk(pool: list, start: int = 0):
    """A pick function that walks ``pool`` from ``start``, carrying on across runs."""
    counter = itertools.count(start)
    return lambda _: pool[next(counter) % len(pool)]


def zipf_sequence(population: int, s: float, length: int, seed: int) -> np.ndarray:
    """Indices into ``population`` inputs, rank k drawn with probability proportional to 1/k^s."""
    weights = 1.0 / np.arange(1, population + 1) ** s
    return np.random.default_rng(seed).choice(population, size=length, p=weights / weights.sum())


def repeats_in(sequence) -> float:
    """The best hit rate a cache could reach on ``sequence``: the share of items seen before."""
    seen: set = set()
    repeats = 0
    for item in sequence:
        repeats += item in seen
        seen.add(item)
    return repeats / max(1, len(sequence))


async def cache_workloads(url: str, duration_s: float, zipf_s: float, population: int) -> dict:
    out: dict = {}
    fresh_digits = make_inputs(60000, 64, 1)
    fresh_iris = make_inputs(60000, 4, 2)
    one = make_inputs(1, 64, 3)[0]
    await drive(url, "digits_cached", lambda i: one, 1, 0.5)  # stores the repeated input
    print("\n(a) hit path vs miss path, digits v2 over gRPC (cases interleaved)")
    for c in (1, 8):
        base = (c - 1) * 4000
        hit, miss, plain = await side_by_side(
            url,
            [
                ("digits_cached", lambda i: one),
                ("digits_cached", walk(fresh_digits[:30000], base)),  # never the same input twice
                ("digits_plain", walk(fresh_digits[30000:], base)),
            ],
            c,
            duration_s,
        )
        for label, r in (("hit (one repeated input)", hit), ("miss (fresh inputs, cache on)", miss),
                         ("no cache (fresh inputs)", plain)):
            show(label, r)
        out[f"hit_c{c}"], out[f"miss_c{c}"], out[f"nocache_c{c}"] = hit, miss, plain

    print(f"\n(b) Zipf workload: {population} distinct inputs, s={zipf_s}, concurrency 8, digits v2")
    pool = make_inputs(population, 64, 4)
    seq = zipf_sequence(population, zipf_s, 10**6, 5)
    plain = summarize([await drive(url, "digits_plain", lambda i: pool[seq[i % len(seq)]], 8, duration_s)])
    cached = summarize([await drive(url, "digits_cached", lambda i: pool[seq[i % len(seq)]], 8, duration_s)])
    show("cache off", plain)
    show("cache on, from empty", cached)
    ideal = repeats_in(seq[: cached["requests"]])
    print(f"  best possible hit rate on those {cached['requests']} requests: {ideal:.1%}")
    warm = summarize([await drive(url, "digits_cached", lambda i: pool[seq[i % len(seq)]], 8, duration_s)])
    show("cache on, same sequence again", warm)
    print(f"  throughput gain: {cached['rps'] / plain['rps']:.2f}x from empty, {warm['rps'] / plain['rps']:.2f}x warm")
    out.update(zipf_plain=plain, zipf_cached=cached, zipf_warm=warm, zipf_best_hit_rate=ideal)

    print("\n(c) where the cache does not pay: iris (cheap), fresh inputs, concurrency 8 (interleaved)")
    cached, plain = await side_by_side(
        url,
        [("iris_cached", walk(fresh_iris[:30000])), ("iris_plain", walk(fresh_iris[30000:]))],
        8,
        duration_s,
    )
    show("iris, cache on (every request a miss)", cached)
    show("iris, cache off (the default policy)", plain)
    out.update(cheap_cached=cached, cheap_plain=plain)
    return out


def cache_stats(supervisor) -> dict:
    from google.protobuf import json_format

    from aiworks.cache.client import fetch_stats

    reply = fetch_stats(supervisor.cache_address, supervisor.client_tls_for("admin"), supervisor.client_caller("admin"))
    return json_format.MessageToDict(reply, preserving_proto_field_name=True)


def run_store(
    repo: Path, store: str, duration_s: float, zipf_s: float, population: int, logs: Path, env: dict[str, str]
) -> dict:
    redis, redis_url = _redis(store)
    config = SuiteConfig.on_free_ports(
        model_repository=repo,
        replicas=1,
        log_dir=logs,
        log_level="WARNING",
        redis_url=redis_url,
        extra_env=env,
    )
    supervisor = Supervisor(config)
    try:
        supervisor.start()
        print(f"\n=== cache store: {store} ===")
        out = asyncio.run(cache_workloads(f"127.0.0.1:{config.grpc_port}", duration_s, zipf_s, population))
        out["cache_stats"] = cache_stats(supervisor)
        print(f"\n  the cache service's counters: {out['cache_stats']}")
        return out
    finally:
        supervisor.stop()
        if redis is not None:
            redis.terminate()
            redis.wait()


# ---- per-tenant keys vs shared keys ---------------------------------------------------------------


async def drive_count(url: str, model: str, pick, concurrency: int, count: int, headers: dict) -> dict:
    """Closed loop: ``concurrency`` workers send ``count`` requests in all, ``pick(i)`` for the i-th."""
    import tritonclient.grpc.aio as grpcclient

    client = grpcclient.InferenceServerClient(url)
    latencies: list[float] = []
    hits = errors = 0
    counter = iter(range(count))

    async def worker():
        nonlocal hits, errors
        for i in counter:
            inp = pick(i)
            started = time.perf_counter()
            try:
                result = await client.infer(model, [inp], headers=headers)
            except Exception:  # counted, not fatal
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)
            params = result.get_response().parameters
            hits += "cache_hit" in params and params["cache_hit"].bool_param

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    await client.close()
    return {"model": model, "concurrency": concurrency, "latencies": latencies, "hits": hits, "errors": errors,
            "elapsed_s": elapsed}


async def tenant_keys_workload(url: str, key: str, requests: int, zipf_s: float, population: int,
                               chunks: int = 6) -> dict:
    """The same Zipf sequence, from empty, to a per-tenant model and a shared one, in interleaved chunks."""
    pool = make_inputs(population, 64, 4)
    seq = zipf_sequence(population, zipf_s, requests, 5)
    headers = {"x-api-key": key}
    runs: dict[str, list[dict]] = {"digits_cached": [], "digits_shared": []}
    size = requests // chunks
    for chunk in range(chunks):
        offset = chunk * size
        order = list(runs) if chunk % 2 == 0 else list(reversed(runs))  # neither always goes first
        for model in order:  # each model continues the sequence where its last chunk stopped
            pick = (lambda o: lambda i: pool[seq[o + i]])(offset)
            runs[model].append(await drive_count(url, model, pick, 8, size, headers))
    out = {"requests": size * chunks, "best_hit_rate": repeats_in(seq[: size * chunks])}
    for model, label in (("digits_cached", "per_tenant"), ("digits_shared", "shared")):
        out[label] = summarize(runs[model])
    return out


def run_tenant_keys(repo: Path, store: str, requests: int, zipf_s: float, population: int, logs: Path,
                    env: dict[str, str]) -> dict:
    """(e) in a suite with one tenant (an API key), the cache on ``store``."""
    from aiworks.gateway.auth import generate_api_key

    key, digest = generate_api_key()
    tenants = logs.parent / f"tenants-{store}.yaml"
    tenants.parent.mkdir(parents=True, exist_ok=True)
    tenants.write_text(json.dumps({"tenants": [{"id": "solo", "models": ["*"], "api_keys": [digest]}]}))
    redis, redis_url = _redis(store)
    config = SuiteConfig.on_free_ports(
        model_repository=repo, replicas=1, log_dir=logs, log_level="WARNING", redis_url=redis_url,
        extra_env={**env, "AIWORKS_GATEWAY_TENANTS_FILE": str(tenants)},
    )  # fmt: skip
    supervisor = Supervisor(config)
    try:
        supervisor.start()
        print(f"\n(e) per-tenant keys vs shared keys, store {store}: Zipf s={zipf_s} over {population} inputs, "
              f"{requests} requests each, one tenant, digits v2, concurrency 8, interleaved")  # fmt: skip
        out = asyncio.run(tenant_keys_workload(f"127.0.0.1:{config.grpc_port}", key, requests, zipf_s, population))
    finally:
        supervisor.stop()
        if redis is not None:
            redis.terminate()
            redis.wait()
    tenant, shared = out["per_tenant"], out["shared"]
    show("per-tenant keys (the default)", tenant)
    show("shared keys (cache_scope: shared)", shared)
    print(f"  best possible hit rate: {out['best_hit_rate']:.1%}; per-tenant / shared: hit rate "
          f"{tenant['hit_rate'] / max(shared['hit_rate'], 1e-9):.3f}, req/s {tenant['rps'] / shared['rps']:.2f}")
    return out


def _redis(store: str):
    if store != "redis":
        return None, None
    port = free_port()
    process = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--maxmemory", "256mb", "--maxmemory-policy", "volatile-lru"],
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    time.sleep(0.5)
    return process, f"redis://127.0.0.1:{port}/0"


# ---- cold start ----------------------------------------------------------------------------------


async def cold_start(demo: Path, repeats: int) -> dict:
    """Load each demo model in a fresh runtime data plane: load, warm-up, first and second request."""
    from aiworks.core.datatypes import Tensor
    from aiworks.runtime.dataplane import RuntimeDataPlane
    from aiworks.runtime.repository import ModelRepository

    rows: dict = {}
    cases = [("iris", "1", 4), ("digits", "1", 64), ("digits", "2", 64)]
    for warmup in (True, False):
        samples: dict = {}
        for _ in range(repeats):
            dp = RuntimeDataPlane(ModelRepository(demo), warmup=warmup)
            for name in ("iris", "digits"):
                await dp.load(name, preloaded=True)
            for name, version, features in cases:
                x = Tensor.from_numpy("input", np.random.default_rng(0).random((1, features), dtype=np.float32))
                await dp.execute(name, version, [x], [])
                t = time.perf_counter()
                await dp.execute(name, version, [x], [])
                second_ms = (time.perf_counter() - t) * 1e3
                [s] = dp.statistics(name, version)
                row = samples.setdefault(f"{name} v{version}", [])
                row.append((s.load_ns / 1e6, s.warmup_ns / 1e6, s.first_request_ns / 1e6, second_ms))
            dp.close()
        for label, values in samples.items():
            med = [statistics.median(v[i] for v in values) for i in range(4)]
            rows[f"{label} warmup={'on' if warmup else 'off'}"] = dict(
                zip(("load_ms", "warmup_ms", "first_request_ms", "second_request_ms"), med)
            )
    print(f"\n(d) cold start in the runtime (median of {repeats})")
    print(f"  {'model':<24} {'load':>9} {'warm-up':>9} {'load+warm':>10} {'1st req':>9} {'2nd req':>9}")
    for label, r in rows.items():
        print(
            f"  {label:<24} {r['load_ms']:>7.1f}ms {r['warmup_ms']:>7.1f}ms {r['load_ms'] + r['warmup_ms']:>8.1f}ms "
            f"{r['first_request_ms']:>7.2f}ms {r['second_request_ms']:>7.2f}ms"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", choices=["memory", "redis", "both"], default="both")
    parser.add_argument("--duration-s", type=float, default=5.0, help="seconds measured per point")
    parser.add_argument("--zipf-s", type=float, default=1.1, help="Zipf exponent of the repeated-input workload")
    parser.add_argument("--population", type=int, default=5000, help="distinct inputs of the Zipf workload")
    parser.add_argument("--cold-start-repeats", type=int, default=3)
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model-repository")
    parser.add_argument("--lookup-timeout-s", type=float, help="the gateway's cache lookup timeout (default 10 ms)")
    parser.add_argument("--store-timeout-s", type=float, help="the cache's Redis timeout (default 5 ms)")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--tenant-keys-only", action="store_true", help="run only (e): per-tenant vs shared keys")
    parser.add_argument("--tenant-requests", type=int, default=6000, help="requests per model in (e)")
    args = parser.parse_args()
    env = {}
    if args.lookup_timeout_s is not None:
        env["AIWORKS_GATEWAY_CACHE_LOOKUP_TIMEOUT_S"] = str(args.lookup_timeout_s)
    if args.store_timeout_s is not None:
        env["AIWORKS_CACHE_STORE_TIMEOUT_S"] = str(args.store_timeout_s)

    if build_demo_repository(args.model_repository):
        print(f"built the demo repository in {args.model_repository}")
    demo = args.model_repository.resolve()
    results: dict = {"settings": env}
    if not args.tenant_keys_only:
        results["cold_start"] = asyncio.run(cold_start(demo, args.cold_start_repeats))
    stores = ["memory", "redis"] if args.store == "both" else [args.store]
    with tempfile.TemporaryDirectory() as tmp:
        repo = bench_repository(demo, Path(tmp) / "repo")
        for store in stores:
            if not args.tenant_keys_only:
                results[store] = run_store(
                    repo, store, args.duration_s, args.zipf_s, args.population, Path(tmp) / f"logs-{store}", env
                )
            results[f"tenant_keys_{store}"] = run_tenant_keys(
                repo, store, args.tenant_requests, args.zipf_s, args.population, Path(tmp) / f"logs-tk-{store}", env
            )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
