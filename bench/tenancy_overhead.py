"""Tenancy overhead: gateway latency with authentication, limits and input filters on vs off.

One suite (scheduler, one runtime replica, no result cache) and, on the same
scheduler, gateways that differ only in their tenancy settings:

  off         demo mode: no tenants file (the gateway as it was before tenancy);
  on          a tenants file: API-key authentication, model permission, input
              filters (size caps, deny-list, the model's metadata), Redis-shared
              limits (rate and concurrency: one admission and one release Lua
              call per request), usage metering flushed to Redis, an audit log;
  on-local    the same without Redis: limits and usage in the process
              (the embedded, single-gateway default), to show what the
              Redis round trips cost;
  *-noaudit   (optional) the same without the audit log;
  auth-filters  only what the issue's <10 % target names: API-key
              authentication, model permission and the input filters; no
              limits, no Redis, no audit log.

The same closed-loop client (tritonclient's asyncio clients) sends the same
requests, API key header included, to each gateway; cases are interleaved in rounds so that every case
sees the machine's noise alike. Reported: p50, mean and p99 latency per case,
the overhead of each tenancy case against ``off``, and the gateway process's
own CPU time per request (read from /proc, so it does not depend on what
else the machine runs).

Usage: python bench/tenancy_overhead.py [--model iris|digits] [--duration-s 6] [--rounds 3]
       [--concurrency 1,8] [--protocol grpc,http] [--cases off,auth-filters,on-local,on] [--repository DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import requests
import yaml

from aiworks.gateway.auth import generate_api_key, hash_api_key
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

ROOT = Path(__file__).resolve().parent.parent
FEATURES = {"iris": 4, "digits": 64}


# ---- processes -----------------------------------------------------------------------------------------


def start_redis(workdir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    import redis

    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            if redis.Redis.from_url(url, socket_timeout=0.5).ping():
                return process, url
        except redis.RedisError:
            time.sleep(0.05)
    process.kill()
    raise SystemExit("redis-server did not start")


def start_gateway(name: str, scheduler: str, env: dict[str, str], log_dir: Path) -> tuple[subprocess.Popen, str, str]:
    http, grpc = free_port(), free_port()
    with open(log_dir / f"{name}.log", "ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "aiworks", "gateway", "--scheduler-address", scheduler, "--host", "127.0.0.1",
             "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", "0"],
            env={**os.environ, **env}, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    for _ in range(600):
        if process.poll() is not None:
            raise SystemExit(f"gateway {name} exited; see {log_dir / f'{name}.log'}")
        try:
            if requests.get(f"http://127.0.0.1:{http}/v2/health/ready", timeout=1).ok:
                return process, f"127.0.0.1:{http}", f"127.0.0.1:{grpc}"
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise SystemExit(f"gateway {name} did not become ready")


def tenancy_env(work: Path, model: str, redis_url: str | None, name: str, key: str) -> dict[str, str]:
    """A tenants file with one limited tenant (limits far above the load: every request is admitted).

    Case names: ``on`` shares limits and usage through Redis, ``...local...``
    keeps them in the process, ``...noaudit...`` writes no audit log.
    """
    digest = hash_api_key(key)
    tenant = {
        "id": "bench",
        "models": [model],
        "api_keys": [digest],
        "requests_per_second": 1_000_000,
        "max_concurrent_requests": 10_000,
        "default_priority": "standard",
    }
    if name == "auth-filters":
        del tenant["requests_per_second"], tenant["max_concurrent_requests"]
    tenants = {
        "tenants": [tenant],
        "filters": {"deny_patterns": {"id_card": None, "email": None}},
    }
    path = work / f"tenants-{name}.yaml"
    path.write_text(yaml.safe_dump(tenants, sort_keys=False))
    env = {
        "AIWORKS_GATEWAY_TENANTS_FILE": str(path),
        "AIWORKS_GATEWAY_MAX_TENSOR_ELEMENTS": "1048576",
        "AIWORKS_GATEWAY_MAX_STRING_BYTES": "4096",
    }
    if "noaudit" not in name and name != "auth-filters":
        env["AIWORKS_GATEWAY_AUDIT_LOG"] = str(work / f"audit-{name}.jsonl")
    if redis_url and "local" not in name and name != "auth-filters":
        env["AIWORKS_GATEWAY_REDIS_URL"] = redis_url
    return env


# ---- load ----------------------------------------------------------------------------------------------


async def drive(protocol: str, url: str, model: str, key: str | None, concurrency: int, duration_s: float) -> dict:
    """Closed loop: ``concurrency`` workers send one-row requests for ``duration_s``."""
    if protocol == "grpc":
        import tritonclient.grpc.aio as client_lib
    else:
        import tritonclient.http.aio as client_lib
    client = client_lib.InferenceServerClient(url)
    headers = {"x-api-key": key} if key else None
    rng = np.random.default_rng(concurrency)
    inputs = []
    for _ in range(64):
        inp = client_lib.InferInput("input", [1, FEATURES[model]], "FP32")
        data = rng.random((1, FEATURES[model]), dtype=np.float32)
        if protocol == "grpc":
            inp.set_data_from_numpy(data)
        else:
            inp.set_data_from_numpy(data, binary_data=True)
        inputs.append(inp)
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + duration_s

    async def worker(offset: int) -> None:
        nonlocal errors
        i = offset
        while time.perf_counter() < deadline:
            i += 1
            started = time.perf_counter()
            try:
                await client.infer(model, [inputs[i % len(inputs)]], headers=headers)
            except Exception:  # counted, not fatal
                errors += 1
                continue
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker(w * 7) for w in range(concurrency)))
    elapsed = time.perf_counter() - started
    await client.close()
    return {"latencies": latencies, "errors": errors, "elapsed_s": elapsed}


def cpu_s(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (the gateway's own cost, whatever else runs)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarize(runs: list[dict]) -> dict:
    latencies = sorted(x for r in runs for x in r["latencies"])
    n = len(latencies)
    return {
        "requests": n,
        "gateway_cpu_us": sum(r["cpu_s"] for r in runs) / n * 1e6 if n else float("nan"),
        "errors": sum(r["errors"] for r in runs),
        "rps": n / sum(r["elapsed_s"] for r in runs),
        "p50_ms": latencies[n // 2] * 1e3 if n else float("nan"),
        "mean_ms": statistics.fmean(latencies) * 1e3 if n else float("nan"),
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1e3 if n else float("nan"),
    }


async def measure(gateways: dict, args) -> list[dict]:
    results = []
    for protocol in args.protocol:
        for concurrency in args.concurrency:
            # Warm every gateway (connections, the spec cache, Redis scripts) before timing anything.
            for gw in gateways.values():
                await drive(protocol, gw[protocol], args.model, gw["key"], concurrency, 0.5)
            runs: dict[str, list] = {name: [] for name in gateways}
            for _ in range(args.rounds):
                for name, gw in gateways.items():
                    slice_s = args.duration_s / args.rounds
                    before = cpu_s(gw["pid"])
                    run = await drive(protocol, gw[protocol], args.model, gw["key"], concurrency, slice_s)
                    run["cpu_s"] = cpu_s(gw["pid"]) - before
                    runs[name].append(run)
            summary = {name: summarize(r) for name, r in runs.items()}
            base = summary["off"]
            for name, s in summary.items():
                s.update(protocol=protocol, concurrency=concurrency, case=name)
                s["p50_overhead"] = s["p50_ms"] / base["p50_ms"] - 1
                s["mean_overhead"] = s["mean_ms"] / base["mean_ms"] - 1
                results.append(s)
                print(
                    f"  {protocol:<4} c={concurrency:<3} {name:<9} {s['rps']:>7.0f} req/s  p50 {s['p50_ms']:6.3f} ms  "
                    f"mean {s['mean_ms']:6.3f} ms  p99 {s['p99_ms']:7.3f} ms  gateway CPU {s['gateway_cpu_us']:5.0f} us/req  "
                    f"overhead p50 {s['p50_overhead']:+6.1%} mean {s['mean_overhead']:+6.1%}  errors {s['errors']}",
                    flush=True,
                )
    return results


# ---- main ----------------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(FEATURES), default="iris")
    parser.add_argument("--duration-s", type=float, default=6.0, help="seconds per case (split over the rounds)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", default="1,8")
    parser.add_argument("--protocol", default="grpc,http")
    parser.add_argument("--cases", default="off,auth-filters,on-local,on", help="which gateways to compare (off is the base)")
    parser.add_argument("--repository", type=Path, help="a demo model repository (default: build one)")
    parser.add_argument("--out", type=Path, help="JSON results (default bench/results/tenancy_overhead_<model>.json)")
    args = parser.parse_args()
    args.out = args.out or ROOT / "bench" / "results" / f"tenancy_overhead_{args.model}.json"
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.protocol = args.protocol.split(",")
    cases = args.cases.split(",")
    if cases[0] != "off":
        raise SystemExit("--cases must start with off, the base of the comparison")

    work = Path(tempfile.mkdtemp(prefix="aiworks-tenancy-bench-"))
    repository = args.repository
    if repository is None:
        from aiworks.demo.models import build_demo_repository

        repository = work / "model-repository"
        build_demo_repository(repository, progress=lambda m: None)
    redis_process, redis_url = start_redis(work)
    log_dir = work / "logs"
    config = SuiteConfig.on_free_ports(model_repository=repository, log_dir=log_dir, replicas=1, cache=False)
    supervisor = Supervisor(config)
    started: list[subprocess.Popen] = []
    try:
        supervisor.start()
        # Every gateway gets the same requests, the API key header included (the demo-mode one ignores it).
        key, _ = generate_api_key()
        gateways = {"off": {"http": f"127.0.0.1:{config.http_port}", "grpc": f"127.0.0.1:{config.grpc_port}",
                            "key": key, "pid": supervisor.child("gateway").process.pid}}  # fmt: skip
        for name in cases[1:]:
            env = tenancy_env(work, args.model, redis_url, name, key)
            env = {**supervisor.caller_env("gateway"), **env}  # the scheduler checks who calls it
            process, http, grpc = start_gateway(f"gateway-{name}", supervisor.scheduler_address, env, log_dir)
            started.append(process)
            gateways[name] = {"http": http, "grpc": grpc, "key": key, "pid": process.pid}
        print(
            f"tenancy overhead: model {args.model}, {args.duration_s:g} s per case in {args.rounds} rounds, "
            f"cases {', '.join(gateways)}",
            flush=True,
        )
        results = asyncio.run(measure(gateways, args))
    finally:
        for process in started:
            process.terminate()
            process.wait(20)
        supervisor.stop()
        redis_process.terminate()
        redis_process.wait(10)
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": f"{os.cpu_count()} CPUs, {platform.processor() or platform.machine()}, Python {platform.python_version()}",
        "date": time.strftime("%Y-%m-%d"),
        "model": args.model,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"results in {args.out}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
