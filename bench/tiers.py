"""Batch jobs beside online traffic (issue #19), first part: job throughput and the online p99 it costs.

One suite (scheduler, runtime replicas, gateway with a tenants file, the
Batch API and a private redis-server) and one ``aiworks batch runner``.
Three phases, one after the other, on the same model (digits v1, one row per
request):

  online      a closed loop of ``--online-concurrency`` clients for ``--duration-s``: p50 / p99 latency;
  job         a ``--rows`` line batch job with nothing else running: rows/s from its submission
              to its end as the client sees it (polling every 0.1 s), against the online loop's
              rows/s at the runner's concurrency (``--job-concurrency`` clients, same duration);
  both        the online loop again while a job of the same size runs: online p99 against ``online``.

The issue's targets (a 200,000-row job, online p99 within 15 % at half the
suite's capacity, job ≥ 80 % of online throughput) need a quiet machine and
an open-loop online load; this script is the measurement they will grow
from. Prints one JSON object.

Usage: python bench/tiers.py [--rows 5000] [--duration-s 10] [--online-concurrency 2] [--job-concurrency 16]
       [--replicas 1] [--repository DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np
import orjson
import requests
import yaml

from aiworks.demo.models import build_demo_repository, digits_split
from aiworks.gateway.auth import generate_api_key
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

ENDPOINT = "/v2/models/digits/versions/1/infer"


def _body(row: np.ndarray) -> bytes:
    return orjson.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 64], "data": row.tolist()}]})


async def _loop(base: str, key: str, rows: np.ndarray, concurrency: int, duration_s: float) -> dict:
    latencies: list[float] = []
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    bodies = [_body(r) for r in rows[:512]]
    stop_at = time.monotonic() + duration_s

    async def client(session: aiohttp.ClientSession, offset: int) -> None:
        i = offset
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            async with session.post(base + ENDPOINT, data=bodies[i % len(bodies)], headers=headers) as reply:
                await reply.read()
                assert reply.status == 200, reply.status
            latencies.append(time.perf_counter() - start)
            i += concurrency

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        began = time.monotonic()
        await asyncio.gather(*(client(session, k) for k in range(concurrency)))
        elapsed = time.monotonic() - began
    ms = np.array(latencies) * 1e3
    p50, p99 = (round(float(np.percentile(ms, q)), 2) for q in (50, 99))
    return {"requests": len(ms), "rows_per_s": round(len(ms) / elapsed, 1), "p50_ms": p50, "p99_ms": p99}


def _submit(base: str, key: str, data: bytes) -> str:
    headers = {"authorization": f"Bearer {key}"}
    uploaded = requests.post(f"{base}/v1/files", headers=headers, data={"purpose": "batch"},
                             files={"file": ("rows.jsonl", data)}, timeout=120).json()  # fmt: skip
    body = {"input_file_id": uploaded["id"], "endpoint": ENDPOINT, "completion_window": "24h"}
    reply = requests.post(f"{base}/v1/batches", headers=headers, json=body, timeout=30)
    reply.raise_for_status()
    return reply.json()["id"]


def _wait(base: str, key: str, batch_id: str) -> dict:
    while True:
        headers = {"authorization": f"Bearer {key}"}
        doc = requests.get(f"{base}/v1/batches/{batch_id}", headers=headers, timeout=10).json()
        if doc["status"] in ("completed", "failed", "cancelled", "expired"):
            return doc
        time.sleep(0.1)


def _job(base: str, key: str, data: bytes) -> tuple[str, float]:
    """Submit a job; (its id, the time it was submitted)."""
    return _submit(base, key, data), time.monotonic()


def _job_rate(doc: dict, submitted: float) -> float:
    """Rows/s from submission to the job's end as this client saw it (upload excluded; pick-up and polling in)."""
    return round(doc["request_counts"]["completed"] / (time.monotonic() - submitted), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--online-concurrency", type=int, default=2)
    parser.add_argument("--job-concurrency", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--repository", help="a prebuilt demo repository (default: built in a temporary folder)")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="aiworks-tiers-"))
    repository = Path(args.repository) if args.repository else work / "repository"
    if not args.repository:
        build_demo_repository(repository, progress=lambda m: None)
    redis_port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no", "--dir", str(work)], stdout=subprocess.DEVNULL)  # fmt: skip
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    key, digest = generate_api_key()
    tenants = work / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"tenants": [{"id": "bench", "models": ["digits"], "api_keys": [digest]}]}))
    env = {"AIWORKS_GATEWAY_TENANTS_FILE": str(tenants), "AIWORKS_GATEWAY_REDIS_URL": redis_url,
           "AIWORKS_GATEWAY_BATCH_FILES_URL": str(work / "files"),
           "AIWORKS_GATEWAY_LIMITS_TIMEOUT_S": "0.5"}  # fmt: skip
    config = SuiteConfig.on_free_ports(model_repository=repository, log_dir=work / "logs", replicas=args.replicas,
                                       cache=False, extra_env=env)  # fmt: skip
    supervisor = Supervisor(config)
    runner = None
    try:
        supervisor.start()
        base = f"http://127.0.0.1:{config.http_port}"
        runner = subprocess.Popen(
            [sys.executable, "-m", "aiworks", "batch", "runner", "--redis-url", redis_url, "--gateway-url", base,
             "--concurrency", str(args.job_concurrency)],
            env={**os.environ, "AIWORKS_BATCH_POLL_INTERVAL_S": "0.1"}, stdout=subprocess.DEVNULL,
            stderr=open(work / "runner.log", "ab"),  # noqa: SIM115 - closed with the process
        )  # fmt: skip
        _, x, _, _ = digits_split()
        rows = np.concatenate([x.astype(np.float32)] * (args.rows // len(x) + 1))[: args.rows]
        data = b"\n".join(_body(r) for r in rows) + b"\n"
        asyncio.run(_loop(base, key, rows, args.online_concurrency, 2.0))  # warm-up
        online = asyncio.run(_loop(base, key, rows, args.online_concurrency, args.duration_s))
        online_best = asyncio.run(_loop(base, key, rows, args.job_concurrency, args.duration_s))
        first_id, first_at = _job(base, key, data)
        job = _wait(base, key, first_id)
        job_rate = _job_rate(job, first_at)
        beside_id, beside_at = _job(base, key, data)
        both = asyncio.run(_loop(base, key, rows, args.online_concurrency, args.duration_s))
        job_beside = _wait(base, key, beside_id)
        beside_rate = _job_rate(job_beside, beside_at)
        result = {
            "rows": args.rows, "online_alone": online, "online_at_job_concurrency": online_best,
            "job_alone_rows_per_s": job_rate,
            "job_vs_online_throughput": round(job_rate / online_best["rows_per_s"], 3),
            "online_beside_job": both, "job_beside_online_rows_per_s": beside_rate,
            "online_p99_change": round(both["p99_ms"] / online["p99_ms"] - 1, 3),
            "job_failed_lines": job["request_counts"]["failed"] + job_beside["request_counts"]["failed"],
        }  # fmt: skip
        print(json.dumps(result, indent=2))
    finally:
        if runner is not None:
            runner.terminate()
            runner.wait(10)
        supervisor.stop()
        redis.terminate()
        redis.wait(10)


if __name__ == "__main__":
    main()
