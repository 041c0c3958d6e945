"""Split serving benchmark: a pipeline of stages against the unsplit model, and edge mode's bytes.

One run, on one suite (scheduler, 2 runtime replicas, gateway; no cache):

  (a) throughput and latency over gRPC of digits v2 unsplit against
      ``digits_pipe``, the same model cut after its first layer and served
      as a two-stage pipeline, at concurrency 1, 16 and 64 (1 row a request);
      the two alternate at each level, so drift on a shared machine hits both.
      For the pipeline, "avg batch" is stage 2's (the heavy stage);
  (b) one client sending 64-row requests: unsplit, the pipeline whole, and
      the pipeline in micro-batches of 16 rows (stage 1 of micro-batch k + 1
      overlapping stage 2 of micro-batch k);
  (c) edge mode over HTTP for two cuts: the front stage in this process
      with onnxruntime, the back stage in the suite; bytes sent against the
      raw input, and median latency at batch 1 and 32.

Usage: python bench/split_pipeline.py [--duration-s 5] [--out bench/results/split_pipeline.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np

from aiworks.bench.loadgen import HEADER, format_row, sweep
from aiworks.demo.models import build_demo_repository, digits_split
from aiworks.lifecycle.edge import EdgeClient
from aiworks.lifecycle.pipeline import write_pipeline
from aiworks.lifecycle.split import split_model
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

ROOT = Path(__file__).resolve().parent.parent
PIPELINE_CUT = "next_activations"  # after layer 1 (64 -> 4096); stage 2 holds the 4096x4096 layer
EDGE_CUTS = {"next_activations": "digits_l1", "add_result2": "digits_logits"}  # 64x and 0.16x the input


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return f"{os.cpu_count()} cores ({cpu}), {platform.python_implementation()} {platform.python_version()}"


def build(src: Path, repo: Path) -> dict[str, list[Path]]:
    """digits v2 alone, its pipeline (whole and in micro-batches), and stage folders for each edge cut."""
    (repo / "digits").mkdir(parents=True)
    shutil.copy(src / "digits" / "config.pbtxt", repo / "digits")
    shutil.copytree(src / "digits" / "2", repo / "digits" / "2")
    model = repo / "digits" / "2" / "model.onnx"
    stages = {}
    for cut, name in EDGE_CUTS.items():
        stages[name] = split_model(model, [[cut]], repo, name=name)
    write_pipeline(repo, "digits_pipe", stages[EDGE_CUTS[PIPELINE_CUT]])
    write_pipeline(repo, "digits_pipe_micro", stages[EDGE_CUTS[PIPELINE_CUT]], micro_batch_rows=16)
    return stages


def stage_counts(http_url: str, model: str) -> tuple[int, int]:
    """(rows, batches) the runtimes executed for ``model``, over every replica."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http_url)
    try:
        stats = client.get_inference_statistics(model)["model_stats"]
    finally:
        client.close()
    return sum(int(m["inference_count"]) for m in stats), sum(int(m["execution_count"]) for m in stats)


def measure(grpc_url: str, http_url: str, model: str, level: int, batch_size: int, duration_s: float) -> dict:
    heavy = f"{EDGE_CUTS[PIPELINE_CUT]}_stage2" if model.startswith("digits_pipe") else model
    rows0, batches0 = stage_counts(http_url, heavy)
    [result] = asyncio.run(
        sweep("grpc", grpc_url, model, "", [level], batch_size=batch_size, duration_s=duration_s, report=lambda _: None)
    )
    rows1, batches1 = stage_counts(http_url, heavy)
    avg = (rows1 - rows0) / (batches1 - batches0) if batches1 > batches0 else float("nan")
    result = replace(result, avg_batch=avg)  # warm-up included: a close estimate
    print(f"{model:<18}{format_row(result)}")
    return asdict(result)


def unsplit_over_http(http_url: str, x: np.ndarray, repeats: int) -> float:
    """Median latency of the whole model in the suite, the raw input sent (the baseline of edge mode)."""
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(http_url)
    try:
        times = []
        for i in range(repeats + 1):
            inp = httpclient.InferInput("input", list(x.shape), "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            outputs = [httpclient.InferRequestedOutput(n, binary_data=True) for n in ("label", "probabilities")]
            started = time.perf_counter()
            client.infer("digits", [inp], outputs=outputs)
            if i:  # the first one warms up
                times.append((time.perf_counter() - started) * 1e3)
        return statistics.median(times)
    finally:
        client.close()


def edge(stages: dict[str, list[Path]], http_url: str, repeats: int) -> list[dict]:
    x_all = digits_split()[1].astype(np.float32)
    rows = []
    for batch in (1, 32):
        ms = unsplit_over_http(http_url, x_all[:batch], repeats)
        rows.append({"cut": "none (unsplit digits)", "batch": batch, "input_bytes": batch * 64 * 4, "total_ms_p50": ms})
        print(
            f"  no cut (unsplit in the suite) batch {batch:>2}: raw input {batch * 256:>7,} B sent, total p50 {ms:.2f} ms"
        )
    for cut, name in EDGE_CUTS.items():
        with EdgeClient(stages[name][0], http_url, f"{name}_stage2") as client:
            for batch in (1, 32):
                x = x_all[:batch]
                client.infer({"input": x})  # warm
                totals, fronts = [], []
                for _ in range(repeats):
                    started = time.perf_counter()
                    result = client.infer({"input": x})
                    totals.append((time.perf_counter() - started) * 1e3)
                    fronts.append(result.front_ms)
                rows.append(
                    {
                        "cut": cut,
                        "batch": batch,
                        "input_bytes": result.input_bytes,
                        "sent_bytes": result.sent_bytes,
                        "body_bytes": result.body_bytes,
                        "ratio": result.sent_bytes / result.input_bytes,
                        "front_ms_p50": statistics.median(fronts),
                        "total_ms_p50": statistics.median(totals),
                    }
                )
                r = rows[-1]
                print(
                    f"  cut {cut:<18} batch {batch:>2}: raw input {r['input_bytes']:>7,} B, sent {r['sent_bytes']:>8,} B "
                    f"({r['ratio']:.2f}x; HTTP body {r['body_bytes']:,} B), front {r['front_ms_p50']:.2f} ms, "
                    f"total p50 {r['total_ms_p50']:.2f} ms"
                )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=5.0, help="seconds measured per level")
    parser.add_argument("--model-repository", type=Path, default=ROOT / "model-repository")
    parser.add_argument("--edge-repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "split_pipeline.json")
    args = parser.parse_args()

    if build_demo_repository(args.model_repository):
        print(f"built the demo repository in {args.model_repository}")
    print(f"machine: {machine()}")
    results: dict = {"machine": machine()}
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        stages = build(args.model_repository, repo)
        config = SuiteConfig.on_free_ports(
            model_repository=repo, log_dir=Path(tmp) / "logs", log_level="WARNING", cache=False
        )
        supervisor = Supervisor(config)
        grpc_url, http_url = f"127.0.0.1:{config.grpc_port}", f"127.0.0.1:{config.http_port}"
        try:
            supervisor.start()
            results["concurrency"] = {"digits": [], "digits_pipe": []}
            print("\n(a) over gRPC, 1 row a request; the pipeline's avg batch is its stage 2's")
            print(f"{'model':<18}{HEADER}")
            for level in (1, 16, 64):
                for model in results["concurrency"]:
                    row = measure(grpc_url, http_url, model, level, 1, args.duration_s)
                    results["concurrency"][model].append(row)
            results["large_requests"] = {}
            print(f"\n(b) over gRPC, 64 rows a request, one client\n{'model':<18}{HEADER}")
            for model in ("digits", "digits_pipe", "digits_pipe_micro"):
                results["large_requests"][model] = measure(grpc_url, http_url, model, 1, 64, args.duration_s)
            print("\n(c) edge mode over HTTP: front stage here, back stage in the suite")
            results["edge"] = edge(stages, http_url, args.edge_repeats)
        finally:
            supervisor.stop()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
