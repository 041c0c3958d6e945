"""Asynchronous requests of two tenants: does one tenant's flood hold up the other's requests?

One suite (gateway with a tenants file of two tenants, ``bench`` and
``quiet``; asynchronous requests on a private redis-server) and one
``aiworks nearline worker``. Phases, one after the other:

  quiet alone   ``quiet`` submits at ``--quiet-rate`` (20/s, Poisson) for ``--seconds`` (10): submit-to-result p50/p99
                with nothing else queued;
  capacity      ``bench`` submits a burst of ``--burst`` (3,000) and the worker drains it: its rows/s, first
                result to last (as bench/tiers.py's nearline phase);
  beside        ``bench`` floods at ``--factor`` (2) x that capacity for ``--seconds`` while ``quiet`` goes on
                at its rate: both tenants' p50/p99 from submission (the client's clock before its POST) to the
                stored result, and from the moment the gateway queued it (the record's ``created_at``): the
                second leaves out the wait for a gateway busy taking the flood's submissions, which the
                tenants' rate limits, not the queue, bound. With the share of each answered within the nearline
                class's default deadline (500 ms) of being queued.

The flood's backlog grows for the whole phase, so the flooding tenant's own
p99 is what every request would wait in one queue in arrival order; the
quiet tenant's p99 beside it, against its p99 alone, is what the flood costs
it with the queue split by tenant (docs/tiers.md, "Fair across tenants").
The worker's deadline is ``--deadline-s`` (120 s), so every request is run
and its wait measured rather than expired. Prints one JSON object and writes
it to ``bench/results/nearline-fairness-<time>.json``.

Usage: python bench/nearline_fairness.py   (about 1.5 min on a quiet 2-core machine; docs/benchmarks.md)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import redis
from tenant_suite import TenantSuite, quiet_collector, tenant_suite
from tiers import _body, _pcts, _process, results, submit_async

from aiworks.demo.models import digits_split

QUIET = "quiet"
DEFAULT_DEADLINE_S = 0.5  # the nearline class's default deadline (AIWORKS_GATEWAY_ASYNC_DEADLINE_S)


async def quiet_tenant(suite: TenantSuite, bodies: list[bytes], rate: float, seconds: float, seed: int) -> list:
    refused: dict[int, int] = {}
    sent = await submit_async(suite, bodies, int(rate * seconds), rate, refused, key=suite.others[QUIET], seed=seed)
    assert not refused, f"the quiet tenant's submissions were refused: {refused}"
    return sent


def _summary(store: redis.Redis, sent: list, timeout_s: float) -> dict:
    """Submit-to-result percentiles; and queued-to-result (the record's ``created_at``, when the gateway queued it,
    to its ``completed_at``): the part the queue and the worker decide, without the wait for the gateway's 202."""
    waits, statuses = results(store, sent, timeout_s)
    with store.pipeline(transaction=False) as pipe:
        for request_id, _ in sent:
            pipe.hmget(f"aiworks:async:req:{request_id}", "created_at", "completed_at")
        queued = [float(done) - float(at) for at, done in pipe.execute() if at and done]
    within = sum(w <= DEFAULT_DEADLINE_S for w in queued) / len(queued) if queued else 0.0
    return {**_pcts(waits), "statuses": statuses, "queued_to_result": _pcts(queued),
            "queued_within_500_ms": round(within, 4)}  # fmt: skip


async def run(suite: TenantSuite, args) -> dict:
    _, x, _, _ = digits_split()
    bodies = [_body(r) for r in x[:512].astype(np.float32)]
    quiet_collector()
    store = redis.Redis.from_url(suite.redis_url)
    worker = _process(["nearline", "worker", "--redis-url", suite.redis_url, "--gateway-url", suite.base,
                       "--concurrency", str(args.concurrency), "--deadline-s", str(args.deadline_s),
                       "--credential-key-file", str(suite.credential_key)],
                      {}, suite.work / "worker.log")  # fmt: skip
    try:
        warm = await quiet_tenant(suite, bodies, args.quiet_rate, 2.0, seed=1)  # the worker up, connections made
        await asyncio.to_thread(results, store, warm, 60)
        alone = await asyncio.to_thread(_summary, store, await quiet_tenant(suite, bodies, args.quiet_rate,
                                                                            args.seconds, seed=2), 60)  # fmt: skip
        refused: dict[int, int] = {}
        burst = await submit_async(suite, bodies, args.burst, None, refused)
        await asyncio.to_thread(results, store, burst, 120)
        with store.pipeline(transaction=False) as pipe:
            for request_id, _ in burst:
                pipe.hget(f"aiworks:async:req:{request_id}", "completed_at")
            done = sorted(float(v) for v in pipe.execute() if v)
        capacity = (len(done) - 1) / (done[-1] - done[0])
        rate = args.factor * capacity
        flood, quiet = await asyncio.gather(
            submit_async(suite, bodies, int(rate * args.seconds), rate, refused, seed=3),
            quiet_tenant(suite, bodies, args.quiet_rate, args.seconds, seed=4),
        )
        quiet_beside = await asyncio.to_thread(_summary, store, quiet, args.deadline_s + 30)
        flood_beside = await asyncio.to_thread(_summary, store, flood, args.deadline_s + 30)
    finally:
        worker.terminate()
        worker.wait(10)
        store.close()
    return {
        "capacity_per_s": round(capacity, 1), "flood_rate": round(rate, 1), "quiet_rate": args.quiet_rate,
        "seconds": args.seconds, "refused": refused,
        "quiet_alone": alone, "quiet_beside_flood": quiet_beside, "flood": flood_beside,
        "ratios": {
            "quiet_p99_beside_vs_alone": round(quiet_beside["p99_ms"] / alone["p99_ms"], 2),
            "flood_p99_vs_quiet_p99_beside": round(flood_beside["p99_ms"] / quiet_beside["p99_ms"], 1),
            "queued_to_result_flood_p99_vs_quiet_p99": round(
                flood_beside["queued_to_result"]["p99_ms"] / quiet_beside["queued_to_result"]["p99_ms"], 1),
        },
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quiet-rate", type=float, default=20.0, help="the quiet tenant's requests per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="length of the quiet-alone and beside phases")
    parser.add_argument("--burst", type=int, default=3000, help="the burst that measures the worker's capacity")
    parser.add_argument("--factor", type=float, default=2.0, help="the flood's rate, a multiple of that capacity")
    parser.add_argument("--concurrency", type=int, default=32, help="the worker's requests in flight")
    parser.add_argument("--deadline-s", type=float, default=120.0, help="the nearline deadline (every request runs)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the JSON")
    args = parser.parse_args()

    def env(work: Path) -> dict[str, str]:
        return {"AIWORKS_GATEWAY_ASYNC_REQUESTS": "true", "AIWORKS_GATEWAY_ASYNC_DEADLINE_S": str(args.deadline_s)}

    began = time.time()
    with tenant_suite("aiworks-fairness-", env, others=(QUIET,)) as suite:
        result = asyncio.run(run(suite, args))
    result = {"cpus": os.cpu_count(), "wall_s": round(time.time() - began, 1), "command": " ".join(sys.argv),
              **result}  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"nearline-fairness-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
