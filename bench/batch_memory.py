"""What a batch job costs the runner's memory and Redis, by the job's size: a job of N digits lines alone.

The suite of bench/tiers.py (gateway, scheduler, one runtime, a private
redis-server, one tenant), one batch runner, and one JSONL job of ``--rows``
lines through the Batch API, nothing else running. Printed as JSON: the
runner's peak anonymous memory (RssAnon sampled every 0.1 s: its heap, not
the pages of the mapped input file, which the kernel can drop), its peak RSS
(``VmHWM``, with those pages), Redis' peak memory (``used_memory_peak``),
and the job's rows/s. Run it at two sizes: what does not grow with the job
is bounded.

Usage: python bench/batch_memory.py [--rows 400000] [--chunk-size 1000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import numpy as np
import redis
from tenant_suite import quiet_collector, tenant_suite
from tiers import _body, _process, job_alone

from aiworks.demo.models import digits_split
from aiworks.supervisor.supervisor import free_port


def _status(pid: int, field: str) -> int:
    """A ``/proc/<pid>/status`` memory field, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) // 1024
    return 0


async def run(suite, rows: int, chunk_size: int) -> dict:
    _, x, _, _ = digits_split()
    x = x.astype(np.float32)
    data = b"".join(_body(x[i % len(x)]) + b"\n" for i in range(rows))
    quiet_collector()
    metrics_port = free_port()
    runner = _process(["batch", "runner", "--redis-url", suite.redis_url, "--gateway-url", suite.base,
                       "--concurrency", "32", "--metrics-port", str(metrics_port)],
                      {"AIWORKS_BATCH_POLL_INTERVAL_S": "0.1", "AIWORKS_BATCH_CREDENTIAL_KEY_FILE": str(suite.credential_key)},
                      suite.work / "runner.log")  # fmt: skip
    store = redis.Redis.from_url(suite.redis_url)
    try:
        await asyncio.sleep(2.0)
        idle = _status(runner.pid, "RssAnon")
        peak = idle

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, _status(runner.pid, "RssAnon"))
                await asyncio.sleep(0.1)

        sampler = asyncio.create_task(sample())
        started = time.monotonic()
        job = await job_alone(suite, data, metrics_port, chunk_size)
        sampler.cancel()
        return {"rows": rows, "chunk_size": chunk_size, "input_mb": round(len(data) / 2**20, 1),
                "status": job["status"], "rows_per_s": job["steady_rows_per_s"],
                "wall_s": round(time.monotonic() - started, 1), "runner_anon_mb_idle": idle,
                "runner_anon_mb_peak": peak, "runner_rss_mb_peak": _status(runner.pid, "VmHWM"),
                "redis_mb_peak": round(store.info("memory")["used_memory_peak"] / 2**20, 1)}  # fmt: skip
    finally:
        runner.terminate()
        runner.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--chunk-size", type=int, default=1000)
    args = parser.parse_args()
    with tenant_suite("aiworks-batch-memory-", lambda work: {"AIWORKS_GATEWAY_BATCH_FILES_URL": str(work / "files")}) as suite:
        result = asyncio.run(run(suite, args.rows, args.chunk_size))
    print(json.dumps({"command": " ".join(sys.argv), **result}, indent=2))


if __name__ == "__main__":
    main()
