"""Batch jobs beside online traffic (issue #19), first part: job throughput and the online p99 it costs.

One suite (scheduler, runtime replicas, gateway with a tenants file, the
Batch API and a private redis-server) and one ``aiworks batch runner``.
Three phases, one after the other, on the same model (digits v1, one row per
request):

  online      a closed loop of ``--online-concurrency`` clients for ``--duration-s``: p50 / p99 latency;
  job         a ``--rows`` line batch job with nothing else running: rows/s from its submission
              to its end as the client sees it (polling every 0.1 s), against the online loop's
              rows/s at the runner's concurrency (``--job-concurrency`` clients, same duration);
  both        the online loop again while a job of the same size runs: online p99 against ``online``,
              and the job's rows/s against ``job``.

Printed as ratios too: ``online_p99_beside_vs_alone`` (the issue's target:
at most 1.15), ``job_vs_online_throughput`` (target: at least 0.8) and
``job_beside_vs_alone``. The runner's AIMD limit of requests in flight is
read from its /metrics at the end of each job phase. ``--unguarded`` runs
the same with the protection off (``AIWORKS_RUNTIME_BATCH_SHARE_WHEN_ONLINE=1``,
``AIWORKS_BATCH_ADAPTIVE=false``), for the before/after comparison.

The issue's targets (a 200,000-row job, online p99 within 15 % at half the
suite's capacity, job ≥ 80 % of online throughput) need a quiet machine and
an open-loop online load; this script is the measurement they will grow
from. Prints one JSON object.

Usage: python bench/tiers.py [--rows 5000] [--duration-s 10] [--online-concurrency 2] [--job-concurrency 16]
       [--replicas 1] [--repository DIR] [--unguarded]
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


def _runner_limit(port: int) -> float | None:
    """The runner's AIMD limit of requests in flight now, from its /metrics."""
    try:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except requests.RequestException:
        return None
    for line in text.splitlines():
        if line.startswith("aiworks_batch_in_flight_limit "):
            return float(line.split()[-1])
    return None


def _completed(base: str, key: str, batch_id: str) -> int:
    headers = {"authorization": f"Bearer {key}"}
    return requests.get(f"{base}/v1/batches/{batch_id}", headers=headers, timeout=10).json()["request_counts"][
        "completed"
    ]


def _wait_limit(base: str, key: str, batch_id: str, port: int) -> tuple[dict, list[float], float | None]:
    """Wait for the job's end as :func:`_wait`, reading the runner's limit about once a second meanwhile.

    Also the job's steady rows/s: from the first progress seen to the last
    line, so pick-up and the output files are not in it.
    """
    limits: list[float] = []
    last = 0.0
    first: tuple[float, int] | None = None
    while True:
        headers = {"authorization": f"Bearer {key}"}
        doc = requests.get(f"{base}/v1/batches/{batch_id}", headers=headers, timeout=10).json()
        completed = doc["request_counts"]["completed"]
        if first is None and completed:
            first = (time.monotonic(), completed)
        if doc["status"] in ("completed", "failed", "cancelled", "expired", "finalizing"):
            steady = None
            if first is not None and time.monotonic() > first[0]:
                steady = round((completed - first[1]) / (time.monotonic() - first[0]), 1)
            if doc["status"] == "finalizing":
                doc = _wait(base, key, batch_id)
            return doc, limits, steady
        if time.monotonic() - last >= 1.0:
            last = time.monotonic()
            limit = _runner_limit(port)
            if limit is not None:
                limits.append(limit)
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--online-concurrency", type=int, default=2)
    parser.add_argument("--job-concurrency", type=int, default=16)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--repository", help="a prebuilt demo repository (default: built in a temporary folder)")
    parser.add_argument("--unguarded", action="store_true", help="no runtime share rule and no runner pacing")
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
    if args.unguarded:
        env["AIWORKS_RUNTIME_BATCH_SHARE_WHEN_ONLINE"] = "1"
    config = SuiteConfig.on_free_ports(model_repository=repository, log_dir=work / "logs", replicas=args.replicas,
                                       cache=False, extra_env=env)  # fmt: skip
    supervisor = Supervisor(config)
    runner = None
    try:
        supervisor.start()
        base = f"http://127.0.0.1:{config.http_port}"
        metrics_port = free_port()
        runner_env = {**os.environ, "AIWORKS_BATCH_POLL_INTERVAL_S": "0.1"}
        if args.unguarded:
            runner_env["AIWORKS_BATCH_ADAPTIVE"] = "false"
        runner = subprocess.Popen(
            [sys.executable, "-m", "aiworks", "batch", "runner", "--redis-url", redis_url, "--gateway-url", base,
             "--concurrency", str(args.job_concurrency), "--metrics-port", str(metrics_port)],
            env=runner_env, stdout=subprocess.DEVNULL,
            stderr=open(work / "runner.log", "ab"),  # noqa: SIM115 - closed with the process
        )  # fmt: skip
        _, x, _, _ = digits_split()
        rows = np.concatenate([x.astype(np.float32)] * (args.rows // len(x) + 1))[: args.rows]
        data = b"\n".join(_body(r) for r in rows) + b"\n"
        asyncio.run(_loop(base, key, rows, args.online_concurrency, 2.0))  # warm-up
        online = asyncio.run(_loop(base, key, rows, args.online_concurrency, args.duration_s))
        online_best = asyncio.run(_loop(base, key, rows, args.job_concurrency, args.duration_s))
        first_id, first_at = _job(base, key, data)
        job, limits_alone, steady_alone = _wait_limit(base, key, first_id, metrics_port)
        job_rate = _job_rate(job, first_at)
        beside_id, beside_at = _job(base, key, data)
        while not _completed(base, key, beside_id):  # the job runs: now the online loop beside it
            time.sleep(0.05)
        began, done_before = time.monotonic(), _completed(base, key, beside_id)
        both = asyncio.run(_loop(base, key, rows, args.online_concurrency, args.duration_s))
        steady_beside = round((_completed(base, key, beside_id) - done_before) / (time.monotonic() - began), 1)
        headers = {"authorization": f"Bearer {key}"}
        status = requests.get(f"{base}/v1/batches/{beside_id}", headers=headers, timeout=10).json()["status"]
        overlapped = status == "in_progress"  # False: the job ended inside the loop, use more --rows
        job_beside, limits_beside, _ = _wait_limit(base, key, beside_id, metrics_port)
        beside_rate = _job_rate(job_beside, beside_at)
        result = {
            "rows": args.rows, "guarded": not args.unguarded, "load_average": [round(v, 2) for v in os.getloadavg()],
            "online_alone": online, "online_at_job_concurrency": online_best,
            "job_alone_rows_per_s": job_rate,
            "job_vs_online_throughput": round(job_rate / online_best["rows_per_s"], 3),
            "online_beside_job": both, "job_beside_online_rows_per_s": beside_rate,
            "online_p99_beside_vs_alone": round(both["p99_ms"] / online["p99_ms"], 3),
            "online_p99_change": round(both["p99_ms"] / online["p99_ms"] - 1, 3),
            "job_ran_through_online_loop": overlapped, "job_steady_alone_rows_per_s": steady_alone, "job_during_online_rows_per_s": steady_beside,
            "job_beside_vs_alone": round(steady_beside / steady_alone, 3) if steady_alone else None,
            "runner_in_flight_limit_alone": limits_alone, "runner_in_flight_limit_beside": limits_beside,
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
