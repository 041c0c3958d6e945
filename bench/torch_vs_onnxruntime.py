"""The pytorch backend against the onnxruntime backend on MiniLM-L6, side by side in one run, on the CPU.

Both serve the same weights with the same interface (token ids in,
``embedding`` out), from one runtime replica with one intra-op thread each:

- ``minilm_torch``: TorchScript (``aiworks minilm build --format torchscript``),
  frozen and optimized for inference by the backend;
- ``minilm_tokens``: the ONNX export (``aiworks minilm build --tokens``).

It measures, in one run so the machine's noise hits both sides:

1. in-process, the backends' own ``run`` on batches of 1 and 8 sentences;
2. through the suite (tritonclient's gRPC protocol against the gateway), one
   sentence a request, at each concurrency level; the two models alternate,
   ``--rounds`` times each, and the medians of the rounds are compared.

Usage: python bench/torch_vs_onnxruntime.py [--levels 1,8,32] [--duration-s 3] [--rounds 3] [--tokens 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from aiworks.bench.loadgen import sweep
from aiworks.core.datatypes import encode
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

MODELS = {"pytorch": "minilm_torch", "onnxruntime": "minilm_tokens"}
SENTENCE = "How do I reset my password if I forgot the answer to the security question?"


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return f"{os.cpu_count()} cores ({cpu}), {platform.python_implementation()} {platform.python_version()}"


def feeds(tokens: int, rows: int) -> dict[str, np.ndarray]:
    from aiworks.lifecycle import minilm

    tokenizer = minilm.load_tokenizer()
    enc = tokenizer([SENTENCE] * rows, padding="max_length", truncation=True, max_length=tokens, return_tensors="np")
    return {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}


def in_process(repo: Path, tokens: int, seconds: float) -> list[tuple[int, float, float]]:
    """Median ms per batch of each backend's own run(), batch sizes 1 and 8, alternating."""
    from aiworks.core.model_config import read_config
    from aiworks.runtime.backends import BACKENDS
    from aiworks.runtime.repository import ModelRepository

    repository = ModelRepository(repo)
    models = {}
    for label, name in MODELS.items():
        config = read_config(repo / name)
        models[label] = BACKENDS[config.backend](repository.model_file(config, 1), config, 1)
    rows = []
    for batch in (1, 8):
        batch_feeds = feeds(tokens, batch)
        times: dict[str, list[float]] = {label: [] for label in models}
        deadline = time.perf_counter() + seconds
        while time.perf_counter() < deadline:
            for label, model in models.items():
                started = time.perf_counter()
                model.run(batch_feeds, ["embedding"])
                times[label].append(time.perf_counter() - started)
        torch_ms, ort_ms = (statistics.median(times[label][3:]) * 1e3 for label in ("pytorch", "onnxruntime"))
        rows.append((batch, torch_ms, ort_ms))
        print(f"in-process batch {batch}: pytorch {torch_ms:.2f} ms, onnxruntime {ort_ms:.2f} ms", flush=True)
    return rows


def through_suite(repo: Path, tokens: int, levels: list[int], duration_s: float, rounds: int, log_dir: Path):
    config = SuiteConfig.on_free_ports(
        model_repository=repo, replicas=1, cache=False, log_dir=log_dir, log_level="WARNING",
        extra_env={"AIWORKS_RUNTIME_INTRA_OP_THREADS": "1"},
    )  # fmt: skip
    supervisor = Supervisor(config)
    url = f"127.0.0.1:{config.grpc_port}"
    one = feeds(tokens, 1)
    inputs = [(n, "INT64", list(one[n].shape), encode(one[n], "INT64")) for n in ("input_ids", "attention_mask")]
    results: dict[tuple[str, int], list] = {}
    try:
        supervisor.start()
        for level in levels:
            for round_ in range(rounds):
                order = list(MODELS) if round_ % 2 == 0 else list(reversed(MODELS))
                for label in order:
                    (r,) = asyncio.run(sweep("grpc", url, MODELS[label], "", [level], warmup_s=1.0,
                                             duration_s=duration_s, report=lambda _: None, inputs=inputs))  # fmt: skip
                    results.setdefault((label, level), []).append(r)
                    print(f"{label:12} c={level:<3} {r.throughput_rps:7.1f} infer/s  p50 {r.p50_ms:7.2f} ms  "
                          f"avg batch {r.avg_batch:.1f}  errors {r.errors}", flush=True)  # fmt: skip
    finally:
        supervisor.stop()
    return results


def report(in_rows, suite, levels, args) -> str:
    lines = [
        f"Machine: {machine()}; shared with other work. {args.tokens} tokens a sentence, one intra-op thread, "
        f"{args.duration_s:.0f} s a level and model, {args.rounds} rounds each, alternating.",
        "",
        "In-process, each backend's own run() (median ms per batch):",
        "",
        "| batch | pytorch ms | onnxruntime ms | pytorch / onnxruntime |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {b} | {t:.2f} | {o:.2f} | {t / o:.2f} |" for b, t, o in in_rows]
    lines += [
        "",
        "Through the suite, one sentence a request (median of the rounds):",
        "",
        "| concurrency | pytorch infer/s | onnxruntime infer/s | throughput ratio | pytorch p50 ms | onnxruntime p50 ms |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for level in levels:
        t, o = suite[("pytorch", level)], suite[("onnxruntime", level)]
        t_rps, o_rps = statistics.median(r.throughput_rps for r in t), statistics.median(r.throughput_rps for r in o)
        t_p50, o_p50 = statistics.median(r.p50_ms for r in t), statistics.median(r.p50_ms for r in o)
        lines.append(f"| {level} | {t_rps:.1f} | {o_rps:.1f} | {t_rps / o_rps:.2f} | {t_p50:.2f} | {o_p50:.2f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", default="1,8,32", help="concurrency levels (default 1,8,32)")
    parser.add_argument("--duration-s", type=float, default=3.0, help="seconds measured per level, model and round")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per level (default 3)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens a sentence, padded (default 16)")
    parser.add_argument("--out", type=Path, help="also write the markdown tables to this file")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    levels = [int(x) for x in args.levels.split(",")]
    from aiworks.lifecycle import minilm

    with tempfile.TemporaryDirectory(prefix="torch-vs-ort-") as tmp:
        repo = Path(tmp) / "models"
        minilm.build_torch(repo)
        minilm.build_token_onnx(repo)
        in_rows = in_process(repo, args.tokens, max(3.0, args.duration_s))
        suite = through_suite(repo, args.tokens, levels, args.duration_s, args.rounds, Path(tmp) / "logs")
    text = report(in_rows, suite, levels, args)
    print("\n" + text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
