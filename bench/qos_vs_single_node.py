"""The suite against a traditional single-node deployment, with 1,000 concurrent clients.

Side by side on the same machine, with the same closed-loop load generator
(aiworks.bench.loadgen: every client sends its next request when the last is
answered), the same protocol (HTTP, binary tensor data) and the same model
(digits v2, where compute matters: ~6 ms a row alone, ~0.6 ms a row in a
batch of 64):

  (a) bench/baseline_server.py: one FastAPI process running onnxruntime on
      every request by itself (no queue, no cross-client batching);
  (b) the suite: gateway → scheduler → two runtime replicas, as `aiworks up`
      starts it (result cache off, so every request is computed).

Both run at once (the idle one costs next to nothing) and the measurements
alternate for ``--rounds`` rounds, so drifting load from other work on a
shared machine hits both alike; ratios are taken within each round and the
median round counts. The
suite is also measured over gRPC, for reference.

It prints, and writes as JSON, the throughput ratio (b)/(a), the mean and
p99 latency ratios, the load generator's own CPU use and each side's server
CPU use. Under a closed loop, mean latency = clients / throughput (Little's
law), so the two targets are linked: 5x the throughput is 80% lower mean
latency.

Usage: python bench/qos_vs_single_node.py [--clients 1000] [--duration-s 20] [--warmup-s 5] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

from aiworks.bench.loadgen import HEADER, LevelResult, format_row, sweep
from aiworks.demo.models import build_demo_repository
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

ROOT = Path(__file__).resolve().parent.parent
_TICKS = os.sysconf("SC_CLK_TCK")


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return f"{os.cpu_count()} cores ({cpu}), {platform.python_implementation()} {platform.python_version()}"


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICKS


def measure(protocol: str, url: str, pids: list[int], args) -> tuple[LevelResult, float]:
    """One level; returns the result and the server processes' cores used meanwhile."""
    cpu0, wall0 = cpu_seconds(pids), time.perf_counter()
    [result] = asyncio.run(
        sweep(
            protocol,
            url,
            "digits",
            "2",
            [args.clients],
            warmup_s=args.warmup_s,
            duration_s=args.duration_s,
            report=lambda r: None,
        )  # fmt: skip
    )
    server_cores = (cpu_seconds(pids) - cpu0) / (time.perf_counter() - wall0)
    print(format_row(result) + f"   server CPU {server_cores * 100:.0f}%", flush=True)
    return result, server_cores


def wait_http(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"{url} did not become ready")


class Baseline:
    """bench/baseline_server.py as a child process."""

    def __init__(self, model: Path):
        self.port = free_port()
        self.argv = [
            sys.executable,
            str(ROOT / "bench" / "baseline_server.py"),
            "--model",
            str(model),
            "--port",
            str(self.port),
        ]
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(self.argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_http(f"http://127.0.0.1:{self.port}/v2/health/ready")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)


def suite_config(repo: Path, replicas: int, log_dir: Path) -> SuiteConfig:
    return SuiteConfig.on_free_ports(
        model_repository=repo,
        replicas=replicas,
        log_dir=log_dir,
        log_level="WARNING",
        cache=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=1000, help="concurrent closed-loop clients")
    parser.add_argument("--duration-s", type=float, default=20.0, help="seconds measured on each side")
    parser.add_argument("--warmup-s", type=float, default=5.0, help="seconds of load before measuring")
    parser.add_argument("--replicas", type=int, default=2, help="runtime replicas of the suite")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; the median of each side counts")
    parser.add_argument("--no-grpc", dest="grpc", action="store_false", help="skip the suite-over-gRPC reference run")
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model-repository")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "qos_vs_single_node.json")
    args = parser.parse_args()

    if build_demo_repository(args.model_repository):
        print(f"built the demo repository in {args.model_repository}")
    print(f"machine: {machine()}; load average before: {os.getloadavg()[0]:.2f}")
    baseline = Baseline(args.model_repository / "digits" / "2" / "model.onnx")
    with tempfile.TemporaryDirectory() as logs:
        config = suite_config(args.model_repository.resolve(), args.replicas, Path(logs))
        supervisor = Supervisor(config)
        runs: dict[str, list[tuple[LevelResult, float]]] = {"baseline": [], "suite": [], "suite_grpc": []}
        try:
            baseline.start()
            supervisor.start()
            suite_pids = [c.process.pid for c in supervisor.children]
            # Both stay up (idle costs little); rounds alternate so drifting load from other
            # work on the machine hits both sides alike.
            for i in range(args.rounds):
                print(f"\nround {i + 1}: (a) one FastAPI process, onnxruntime per request\n{HEADER}", flush=True)
                runs["baseline"].append(measure("http", f"127.0.0.1:{baseline.port}", [baseline.process.pid], args))
                print(f"round {i + 1}: (b) the suite, {args.replicas} runtime replicas, over HTTP", flush=True)
                runs["suite"].append(measure("http", f"127.0.0.1:{config.http_port}", suite_pids, args))
                if args.grpc:
                    print(f"round {i + 1}: (b') the suite over gRPC (for reference)", flush=True)
                    runs["suite_grpc"].append(measure("grpc", f"127.0.0.1:{config.grpc_port}", suite_pids, args))
        finally:
            supervisor.stop()
            baseline.stop()
    # Ratios are taken round by round (each pair measured back to back), then the median round.
    pairs = sorted(zip(runs["baseline"], runs["suite"]), key=lambda p: p[1][0].throughput_rps / p[0][0].throughput_rps)
    (a, a_cpu), (b, b_cpu) = pairs[(len(pairs) - 1) // 2]
    summary = {
        "machine": machine(),
        "clients": args.clients,
        "throughput_ratio": b.throughput_rps / a.throughput_rps,
        "mean_latency_ratio": b.mean_ms / a.mean_ms,
        "mean_latency_reduction": 1 - b.mean_ms / a.mean_ms,
        "p99_latency_ratio": b.p99_ms / a.p99_ms,
        "throughput_ratio_per_round": [
            sb.throughput_rps / sa.throughput_rps for (sa, _), (sb, _) in zip(runs["baseline"], runs["suite"])
        ],
        "baseline_rps": a.throughput_rps,
        "suite_rps": b.throughput_rps,
        "suite_avg_batch": b.avg_batch,
        "client_cpu_baseline": a.client_cpu,
        "client_cpu_suite": b.client_cpu,
        "server_cpu_baseline": a_cpu,
        "server_cpu_suite": b_cpu,
        "errors": sum(r.errors for side in runs.values() for r, _ in side),
        "load_average_after": os.getloadavg()[0],
    }
    if runs["suite_grpc"]:
        ratios = sorted(
            g.throughput_rps / sa.throughput_rps for (sa, _), (g, _) in zip(runs["baseline"], runs["suite_grpc"])
        )
        summary["suite_grpc_throughput_ratio"] = ratios[(len(ratios) - 1) // 2]
    print("\nsummary")
    for k, v in summary.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    print(
        f"\nthroughput {summary['throughput_ratio']:.2f}x (target >= 5x); mean latency "
        f"{summary['mean_latency_reduction']:.0%} lower (target >= 68%); p99 {summary['p99_latency_ratio']:.2f}x"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {side: [{**asdict(r), "server_cpu": cpu} for r, cpu in rs] for side, rs in runs.items()}
    args.out.write_text(json.dumps({**doc, "summary": summary}, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
