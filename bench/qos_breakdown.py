"""Where a request's time and CPU go in the suite under the QoS benchmark's load.

Starts the suite as bench/qos_vs_single_node.py does (two runtime replicas,
no result cache), drives it with the same closed-loop clients (default
1,000, digits v2, HTTP), and prints:

- each process's CPU use, in cores and in milliseconds per request;
- with ``--trace-ratio`` above 0, the services trace that share of the
  requests into files, and the median and mean of three stretches of a
  traced request: gateway span start → scheduler queue start (the way in),
  the scheduler's queue span (queue wait and its batch), and queue end →
  gateway span end (the way back).

These are the figures docs/benchmarks.md quotes for the QoS benchmark's
"what it took"; run it at an older commit for the before side.

Usage: python bench/qos_breakdown.py [--clients 1000] [--duration-s 10] [--protocol http|grpc] [--trace-ratio 0.01]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from qos_vs_single_node import ROOT, cpu_seconds, suite_config

from aiworks.bench.loadgen import HEADER, format_row, sweep
from aiworks.demo.models import build_demo_repository
from aiworks.supervisor.supervisor import Supervisor

_SERVICES = {"GATEWAY": "gateway", "SCHEDULER": "scheduler", "RUNTIME": "runtime"}


def stretches(trace_dir: Path) -> dict[str, list[float]]:
    """Milliseconds of the three stretches, one value per traced request that has both spans."""
    spans: dict[str, dict[str, dict]] = defaultdict(dict)
    for name in _SERVICES.values():
        path = trace_dir / f"{name}.jsonl"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            span = json.loads(line)
            if span["name"] in ("gateway infer", "scheduler queue"):
                spans[span["trace_id"]][span["name"]] = span
    out: dict[str, list[float]] = {"way in": [], "scheduler queue": [], "way back": []}
    for pair in spans.values():
        gateway, queue = pair.get("gateway infer"), pair.get("scheduler queue")
        if gateway is None or queue is None:
            continue
        out["way in"].append((queue["start_unix_ns"] - gateway["start_unix_ns"]) / 1e6)
        out["scheduler queue"].append((queue["end_unix_ns"] - queue["start_unix_ns"]) / 1e6)
        out["way back"].append((gateway["end_unix_ns"] - queue["end_unix_ns"]) / 1e6)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=8.0)
    parser.add_argument("--protocol", choices=("http", "grpc"), default="http")
    parser.add_argument("--trace-ratio", type=float, default=0.0, help="share of requests traced (0: no tracing)")
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model-repository")
    args = parser.parse_args()

    build_demo_repository(args.model_repository)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.trace_ratio > 0:
            for env, name in _SERVICES.items():
                os.environ[f"AIWORKS_{env}_TRACE_FILE"] = str(tmp / f"{name}.jsonl")
                os.environ[f"AIWORKS_{env}_TRACE_SAMPLE_RATIO"] = str(args.trace_ratio)
        config = suite_config(args.model_repository.resolve(), 2, tmp / "logs")
        supervisor = Supervisor(config)
        supervisor.start()
        try:
            pids = {child.name: child.process.pid for child in supervisor.children}
            port = config.http_port if args.protocol == "http" else config.grpc_port
            url = f"127.0.0.1:{port}"
            # Warm up (batch sizes, connections) before measuring.
            asyncio.run(
                sweep(
                    args.protocol,
                    url,
                    "digits",
                    "2",
                    [args.clients],
                    warmup_s=0,
                    duration_s=args.warmup_s,
                    report=lambda r: None,
                )
            )
            if args.trace_ratio > 0:  # only the measured stretch's spans count
                for name in _SERVICES.values():
                    (tmp / f"{name}.jsonl").write_text("")
            cpu0 = {name: cpu_seconds([pid]) for name, pid in pids.items()}
            wall0 = time.perf_counter()
            [result] = asyncio.run(
                sweep(
                    args.protocol,
                    url,
                    "digits",
                    "2",
                    [args.clients],
                    warmup_s=0,
                    duration_s=args.duration_s,
                    report=lambda r: None,
                )
            )
            wall = time.perf_counter() - wall0
            cpu = {name: cpu_seconds([pid]) - cpu0[name] for name, pid in pids.items()}
        finally:
            supervisor.stop()
        print(f"\n{HEADER}\n{format_row(result)}\n")
        for name, seconds in cpu.items():
            per_request = seconds / wall / result.throughput_rps * 1e3 if result.throughput_rps else float("nan")
            print(f"  {name:12s} {seconds / wall:5.0%} of a core   {per_request:.3f} ms CPU per request")
        if args.trace_ratio > 0:
            print(f"\ntraced requests (share {args.trace_ratio:g}):")
            for name, values in stretches(tmp).items():
                if values:
                    print(
                        f"  {name:16s} median {statistics.median(values):7.1f} ms   mean {statistics.fmean(values):7.1f} ms"
                        f"   ({len(values)} requests)"
                    )


if __name__ == "__main__":
    main()
