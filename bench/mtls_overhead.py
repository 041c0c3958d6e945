"""What mutual TLS on every internal hop costs: the suite in token mode vs with ``--tls``, side by side.

Two suites run at once on this machine, each as ``aiworks up`` starts it
(scheduler, runtime replicas, gateway; no cache, no monitor, so nothing but
the transport differs):

  plain   the default: plaintext on loopback, callers proved by the installation's
          token (metadata once per call or stream);
  mtls    ``aiworks up --tls``: mutual TLS between gateway, scheduler and runtimes,
          callers named by their certificates, and TLS on the gateway's gRPC port
          (the gateway serves TLS whenever it has a certificate, so the client's
          hop is encrypted too, as a deployment with mTLS on would have it).

The same closed-loop gRPC client (``aiworks.bench.loadgen``) drives digits
version 2 at the given concurrency, alternating plain and mtls in rounds so the
machine's noise hits both. Reported per case: throughput, p50 and p99 latency
(median over rounds), and the CPU time each process spent per request (read
from /proc around each measurement, so it does not depend on what else runs),
which shows where a cost goes. The cost is the ratio mtls / plain.

Usage: python bench/mtls_overhead.py [--rounds 4] [--duration-s 8] [--concurrency 64]
       [--replicas 2] [--repository DIR] [--out bench/results/mtls_overhead.json]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import tempfile
from dataclasses import asdict
from pathlib import Path

from aiworks.bench.loadgen import sweep
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
CASES = ("plain", "mtls")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def processes(supervisor: Supervisor) -> dict[str, int]:
    """Kind (runtimes summed under "runtime") -> pids."""
    found: dict[str, list[int]] = {}
    for child in supervisor.children:
        found.setdefault(child.kind, []).append(child.process.pid)
    return found


def cpu_by_kind(supervisor: Supervisor) -> dict[str, float]:
    return {kind: sum(cpu_seconds(p) for p in pids) for kind, pids in processes(supervisor).items()}


async def one_round(supervisor: Supervisor, args, ca: bytes | None) -> dict:
    before = cpu_by_kind(supervisor)
    [result] = await sweep(
        "grpc", f"127.0.0.1:{supervisor.config.grpc_port}", args.model, args.version, [args.concurrency],
        warmup_s=args.warmup_s, duration_s=args.duration_s, report=lambda line: None, root_certificates=ca,
    )  # fmt: skip
    after = cpu_by_kind(supervisor)
    # Warm-up requests count too: CPU is read around warm-up and measurement alike.
    served = result.requests * (args.warmup_s + args.duration_s) / args.duration_s
    cpu_ms = {kind: 1e3 * (after[kind] - before[kind]) / max(served, 1) for kind in after}
    return {**asdict(result), "cpu_ms_per_request": cpu_ms}


def summary(rounds: list[dict]) -> dict:
    kinds = rounds[0]["cpu_ms_per_request"]
    return {
        "throughput_rps": statistics.median(r["throughput_rps"] for r in rounds),
        "p50_ms": statistics.median(r["p50_ms"] for r in rounds),
        "p99_ms": statistics.median(r["p99_ms"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds),
        "cpu_ms_per_request": {k: statistics.median(r["cpu_ms_per_request"][k] for r in rounds) for k in kinds},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4, help="rounds per case, alternating (default 4)")
    parser.add_argument("--duration-s", type=float, default=8.0, help="measured seconds per round (default 8)")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="warm-up seconds per round (default 2)")
    parser.add_argument("--concurrency", type=int, default=64, help="closed-loop clients (default 64)")
    parser.add_argument("--replicas", type=int, default=2, help="runtime replicas per suite (default 2)")
    parser.add_argument("--model", default="digits")
    parser.add_argument("--version", default="2")
    parser.add_argument("--repository", type=Path, help="demo model repository (built in a temporary folder if unset)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "mtls_overhead.json")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="aiworks-mtls-bench-") as tmp:
        repo = args.repository
        if repo is None:
            from aiworks.demo.models import build_demo_repository

            repo = Path(tmp) / "model-repository"
            build_demo_repository(repo, progress=lambda m: print(m, flush=True))
        suites: dict[str, Supervisor] = {}
        try:
            for case in CASES:
                config = SuiteConfig.on_free_ports(
                    model_repository=repo, log_dir=Path(tmp) / case / "logs", replicas=args.replicas,
                    cache=False, log_level="WARNING", tls=case == "mtls",
                )  # fmt: skip
                suites[case] = Supervisor(config)
                suites[case].start()
                print(f"{case}: callers checked by {suites[case].caller_auth}", flush=True)
            ca = (suites["mtls"].tls_dir / "ca.crt").read_bytes()
            rounds: dict[str, list[dict]] = {case: [] for case in CASES}
            for i in range(args.rounds):
                order = CASES if i % 2 == 0 else CASES[::-1]  # ABBA: neither case always goes first
                for case in order:
                    r = asyncio.run(one_round(suites[case], args, ca if case == "mtls" else None))
                    rounds[case].append(r)
                    print(
                        f"round {i + 1} {case:>5}: {r['throughput_rps']:8.1f} infer/s  p50 {r['p50_ms']:6.2f} ms  "
                        f"p99 {r['p99_ms']:6.2f} ms  errors {r['errors']}  CPU ms/request "
                        + " ".join(f"{k} {v:.3f}" for k, v in sorted(r["cpu_ms_per_request"].items())),
                        flush=True,
                    )
        finally:
            for supervisor in suites.values():
                supervisor.stop()

    summaries = {case: summary(rounds[case]) for case in CASES}
    plain, mtls = summaries["plain"], summaries["mtls"]
    ratios = {
        "throughput": mtls["throughput_rps"] / plain["throughput_rps"],
        "p50": mtls["p50_ms"] / plain["p50_ms"],
        "p99": mtls["p99_ms"] / plain["p99_ms"],
    }
    cost = 1 - ratios["throughput"]
    print(f"\n{'case':>6} {'infer/s':>9} {'p50 ms':>8} {'p99 ms':>8}  CPU ms per request")
    for case in CASES:
        s = summaries[case]
        cpu = " ".join(f"{k} {v:.3f}" for k, v in sorted(s["cpu_ms_per_request"].items()))
        print(f"{case:>6} {s['throughput_rps']:>9.1f} {s['p50_ms']:>8.2f} {s['p99_ms']:>8.2f}  {cpu}")
    print(
        f"mtls / plain: throughput {ratios['throughput']:.3f} (cost {100 * cost:.1f} %), "
        f"p50 {ratios['p50']:.3f}, p99 {ratios['p99']:.3f}"
    )
    doc = {
        "benchmark": "mtls_overhead",
        "date": dt.date.today().isoformat(),
        "command": "python bench/mtls_overhead.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("out", "repository")
        ),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared with other work",
        "model": f"{args.model} v{args.version}",
        "concurrency": args.concurrency,
        "replicas": args.replicas,
        "summary": summaries,
        "ratios_mtls_over_plain": ratios,
        "throughput_cost_percent": 100 * cost,
        "rounds": rounds,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
