"""Flags of ``aiworks bench`` (kept apart so ``aiworks --help`` stays fast)."""

from __future__ import annotations

import argparse


def add_bench_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench",
        help="closed-loop concurrency sweep against a running suite (like perf_analyzer)",
        description=(
            "Sends requests from N concurrent clients, each waiting for its answer before sending the next, "
            "for each concurrency level; prints throughput, p50/p90/p99 latency, the average batch size the "
            "runtimes saw, and the load generator's own CPU use."
        ),
    )
    p.add_argument("-m", "--model", required=True, help="model name")
    p.add_argument("-x", "--model-version", default="", help="model version (default: latest)")
    p.add_argument("-i", "--protocol", choices=["grpc", "http"], default="grpc")
    p.add_argument("-u", "--gateway-url", dest="url", metavar="HOST:PORT",
                   help="gateway address; default localhost:8001 (grpc) or localhost:8000 (http)")  # fmt: skip
    p.add_argument("--url", dest="url", help=argparse.SUPPRESS)  # its spelling before --gateway-url
    p.add_argument(
        "--concurrency-range", default="1:8:2", help="START:END[:FACTOR] multiplied by FACTOR, or a list 1,4,64"
    )
    p.add_argument("-b", "--batch-size", type=int, default=1, help="rows per request")
    p.add_argument("--warmup-s", type=float, default=1.0, help="seconds of traffic before measuring each level")
    p.add_argument("--duration-s", type=float, default=5.0, help="seconds measured at each level")
    p.add_argument("--json", dest="json_out", help="also write the results to this JSON file")
    return p


def parse_levels(spec: str) -> list[int]:
    if "," in spec or ":" not in spec:
        return [int(x) for x in spec.split(",") if x]
    parts = [int(x) for x in spec.split(":")]
    start, end = parts[0], parts[1]
    factor = parts[2] if len(parts) > 2 else 2
    if start < 1 or end < start or factor < 2:
        raise SystemExit(f"error: bad --concurrency-range {spec!r}")
    levels = []
    level = start
    while level <= end:
        levels.append(level)
        level *= factor
    return levels
