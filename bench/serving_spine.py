"""Serving-spine benchmark: onnxruntime in-process vs the suite, with and without batching.

One run measures, side by side on the same machine:

  (a) onnxruntime in-process on digits v2 at each batch size (the ceiling);
  (b) the suite over gRPC: iris at concurrency 1, digits v2 at 1, 16 and 64;
  (c) the suite with batching disabled: digits v2 at 1, 16 and 64.

Usage: python bench/serving_spine.py [--duration-s 8] [--out bench/results/serving_spine.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from aiworks.bench.loadgen import HEADER, sweep
from aiworks.demo.models import build_demo_repository
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

ROOT = Path(__file__).resolve().parent.parent


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return f"{os.cpu_count()} cores ({cpu}), {platform.python_implementation()} {platform.python_version()}"


def in_process(model_path: Path, duration_s: float) -> list[dict]:
    """Rows/s of onnxruntime in this process, with every core, at each batch size."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = os.cpu_count() or 1
    session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    rows = []
    for batch in (1, 8, 16, 32, 64):
        x = rng.random((batch, 64), dtype=np.float32)
        for _ in range(3):
            session.run(None, {"input": x})
        n, started = 0, time.perf_counter()
        while time.perf_counter() - started < duration_s / 4:
            session.run(None, {"input": x})
            n += 1
        elapsed = time.perf_counter() - started
        rows.append({"batch": batch, "rows_per_s": n * batch / elapsed, "ms_per_batch": elapsed / n * 1e3})
    return rows


def run_suite(repo: Path, batching: bool, duration_s: float, log_dir: Path) -> dict:
    config = SuiteConfig.on_free_ports(
        model_repository=repo,
        batching=batching,
        log_dir=log_dir,
        log_level="WARNING",
    )
    supervisor = Supervisor(config)
    url = f"127.0.0.1:{config.grpc_port}"
    try:
        supervisor.start()
        results = {}
        label = "batching" if batching else "no batching"
        if batching:
            print(f"\n(b) iris over gRPC, {label}\n{HEADER}")
            results["iris"] = asyncio.run(sweep("grpc", url, "iris", "", [1], duration_s=duration_s))
        print(f"\n({'b' if batching else 'c'}) digits v2 over gRPC, {label}\n{HEADER}")
        results["digits"] = asyncio.run(sweep("grpc", url, "digits", "2", [1, 16, 64], duration_s=duration_s))
        return {k: [asdict(r) for r in v] for k, v in results.items()}
    finally:
        supervisor.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=8.0, help="seconds measured per level")
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model-repository")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "serving_spine.json")
    args = parser.parse_args()

    if build_demo_repository(args.model_repository):
        print(f"built the demo repository in {args.model_repository}")
    print(f"machine: {machine()}")
    a = in_process(args.model_repository / "digits" / "2" / "model.onnx", args.duration_s)
    print("\n(a) onnxruntime in-process, digits v2, all cores")
    for row in a:
        print(f"  batch {row['batch']:>3}: {row['rows_per_s']:>8.0f} rows/s  {row['ms_per_batch']:.2f} ms/batch")
    with tempfile.TemporaryDirectory() as logs:
        b = run_suite(args.model_repository, True, args.duration_s, Path(logs) / "b")
        c = run_suite(args.model_repository, False, args.duration_s, Path(logs) / "c")

    best = max(a, key=lambda r: r["rows_per_s"])
    b64 = next(r for r in b["digits"] if r["concurrency"] == 64)
    c64 = next(r for r in c["digits"] if r["concurrency"] == 64)
    summary = {
        "machine": machine(),
        "iris_grpc_c1_p50_ms": b["iris"][0]["p50_ms"],
        "digits_c64_batching_rps": b64["throughput_rps"],
        "digits_c64_no_batching_rps": c64["throughput_rps"],
        "batching_speedup": b64["throughput_rps"] / c64["throughput_rps"],
        "in_process_best_rows_per_s": best["rows_per_s"],
        "in_process_best_batch": best["batch"],
        "suite_fraction_of_in_process": b64["throughput_rps"] / best["rows_per_s"],
    }
    print("\nsummary")
    for k, v in summary.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"in_process": a, "batching": b, "no_batching": c, "summary": summary}, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
