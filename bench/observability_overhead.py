"""What tracing costs on the request path, measured side by side.

Two suites run at once on this machine, identical except that suite B
exports a span for every request of every service to a trace file (the
OpenTelemetry SDK's batch processor, as an OTLP exporter would run), while
suite A exports nothing (the default: no span objects are made; metrics are
always on in both). Each round measures A then B then A, so drift on a
shared machine shows up as a difference between A's two runs:

- iris over gRPC at concurrency 1 (latency: what the layers add),
- digits v2 over gRPC at concurrency 16 (throughput with batching).

Usage: python bench/observability_overhead.py [--duration-s 5] [--rounds 2] [--sample-ratio 1.0] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path

from aiworks.bench.loadgen import sweep
from aiworks.demo.models import build_demo_repository
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ("GATEWAY", "SCHEDULER", "RUNTIME", "CACHE")


def start(repo: Path, logs: Path, trace_dir: Path | None, sample_ratio: float = 1.0) -> Supervisor:
    env = {}
    if trace_dir is not None:
        trace_dir.mkdir(parents=True, exist_ok=True)
        env = {f"AIWORKS_{s}_TRACE_FILE": str(trace_dir / f"{s.lower()}.jsonl") for s in SERVICES}
        env |= {f"AIWORKS_{s}_TRACE_SAMPLE_RATIO": str(sample_ratio) for s in SERVICES}
    config = SuiteConfig.on_free_ports(model_repository=repo, log_dir=logs, replicas=2, extra_env=env)
    supervisor = Supervisor(config)
    supervisor.start()
    return supervisor


async def measure(url: str, model: str, version: str, concurrency: int, duration_s: float):
    [result] = await sweep(
        "grpc", url, model, version, [concurrency], warmup_s=1.0, duration_s=duration_s, report=lambda _: None
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--sample-ratio", type=float, default=1.0, help="share of traces the traced suite records")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="aiworks-obs-bench-"))
    repo = ROOT / "model-repository"
    build_demo_repository(repo, progress=print)
    suites = {
        "off": start(repo, work / "logs-off", None),
        "traced": start(repo, work / "logs-traced", work / "traces", args.sample_ratio),
    }
    cases = [("iris", "1", 1), ("digits", "2", 16)]
    results: dict[str, dict[str, list]] = {f"{m}@{c}": {"off": [], "traced": []} for m, _, c in cases}
    try:
        for r in range(args.rounds):
            for model, version, concurrency in cases:
                key = f"{model}@{concurrency}"
                for name in ("off", "traced", "off"):
                    url = f"127.0.0.1:{suites[name].config.grpc_port}"
                    res = asyncio.run(measure(url, model, version, concurrency, args.duration_s))
                    results[key][name].append(res)
                    print(
                        f"round {r + 1} {key:<10} {name:<7} {res.throughput_rps:8.1f} infer/s  "
                        f"p50 {res.p50_ms:6.2f} ms  mean {res.mean_ms:6.2f} ms  p99 {res.p99_ms:6.2f} ms  "
                        f"errors {res.errors}",
                        flush=True,
                    )
    finally:
        for s in suites.values():
            s.stop()
    spans = sum(1 for f in (work / "traces").glob("*.jsonl") for _ in f.open())
    summary = {}
    print("\nmedian over rounds (off = both runs around each traced run)")
    for key, by in results.items():
        off_p50 = statistics.median(r.p50_ms for r in by["off"])
        on_p50 = statistics.median(r.p50_ms for r in by["traced"])
        off_rps = statistics.median(r.throughput_rps for r in by["off"])
        on_rps = statistics.median(r.throughput_rps for r in by["traced"])
        summary[key] = {
            "p50_ms_off": off_p50,
            "p50_ms_traced": on_p50,
            "p50_added_pct": (on_p50 / off_p50 - 1) * 100,
            "rps_off": off_rps,
            "rps_traced": on_rps,
            "throughput_ratio": on_rps / off_rps,
        }
        print(
            f"{key:<10} p50 {off_p50:.2f} -> {on_p50:.2f} ms ({summary[key]['p50_added_pct']:+.1f} %), "
            f"throughput {off_rps:.0f} -> {on_rps:.0f} infer/s (x{summary[key]['throughput_ratio']:.2f})"
        )
    print(f"spans exported by the traced suite: {spans}")
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "spans": spans}, indent=2))


if __name__ == "__main__":
    main()
