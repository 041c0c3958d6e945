"""Lifecycle benchmark: the optimize table for digits v2, and MiniLM throughput in-process.

1. ``aiworks optimize`` on the demo's digits version 2 (an MLP with two
   4096-wide layers): original, ONNX Runtime graph-optimized, INT8 dynamic,
   INT8 static (calibrated on 256 training rows) and FP16, measured on the
   digits test split at batch 1 and 32 with one intra-op thread.
2. The ``minilm`` text model (tokenizer in the graph, FP32 and per-channel
   INT8) in-process with onnxruntime: sentences per second at each batch size,
   on sentences of about 32 tokens, with every core.

Everything runs in this process on this machine's CPUs; other work on the
machine shows up in the figures. Usage:

    python bench/optimize_digits.py [--out .aiworks/bench/lifecycle] [--repeats 50] [--skip-minilm] [--skip-digits]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def digits_table(out: Path, repeats: int) -> str:
    from aiworks.demo.models import build_demo_repository
    from aiworks.lifecycle.optimize import digits_data, optimize

    repo = out / "demo-models"
    if build_demo_repository(repo, progress=lambda m: print(m, flush=True)):
        print(f"built the demo models in {repo}")
    report = optimize(repo / "digits" / "2" / "model.onnx", out / "digits-v2", digits_data(), repeats=repeats)
    base, dyn, static = report.row("original"), report.row("int8-dynamic"), report.row("int8-static")
    lines = [report.to_markdown()]
    for row in (dyn, static):
        if row and row.accuracy is not None and base.accuracy is not None:
            delta = 100 * (row.accuracy - base.accuracy)
            verdict = "within" if abs(delta) <= 1 else "NOT within"
            lines.append(f"{row.variant}: {delta:+.2f} points vs FP32, {verdict} 1 point.")
    return "\n".join(lines)


def _sentences(count: int, words_per_sentence: int = 24) -> list[str]:
    from aiworks.lifecycle.minilm import SENTENCES

    words = " ".join(SENTENCES).split()
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(words_per_sentence)) for i in range(count)]


def minilm_throughput(out: Path, batches: list[int], seconds: float) -> tuple[str, dict]:
    from aiworks.lifecycle import minilm
    from aiworks.lifecycle.sessions import open_session

    folder = out / "minilm-repo" / minilm.NAME
    if not (folder / "2" / "model.onnx").is_file():
        print("building minilm (FP32 + INT8)...", flush=True)
        minilm.build(out / "minilm-repo", int8=True)
    texts = _sentences(max(batches))
    tokens = minilm.tokenize(texts)["attention_mask"].sum(axis=1)
    results: dict = {"tokens_per_sentence": float(tokens.mean()), "cores": os.cpu_count(), "versions": {}}
    lines = [
        f"## minilm in-process throughput (onnxruntime, {os.cpu_count()} cores, "
        f"~{tokens.mean():.0f} tokens a sentence, text in -> embedding out)",
        "",
        "| version | " + " | ".join(f"batch {b}" for b in batches) + " | best |",
        "|---|" + "---:|" * (len(batches) + 1),
    ]
    versions = (("1", "FP32"), ("2", "INT8 per-channel"))
    sessions = {label: open_session(folder / version / "model.onnx") for version, label in versions}
    times: dict[str, dict[int, list[float]]] = {label: {b: [] for b in batches} for _, label in versions}
    for b in batches:
        feed = {"text": np.array(texts[:b], dtype=object).reshape(-1, 1)}
        for session in sessions.values():
            session.run(None, feed)
        # Alternate the versions run by run, so both see the same background load.
        started = time.perf_counter()
        while time.perf_counter() - started < seconds * len(sessions) or len(times["FP32"][b]) < 3:
            for label, session in sessions.items():
                t0 = time.perf_counter()
                session.run(None, feed)
                times[label][b].append(time.perf_counter() - t0)
    for version, label in versions:
        per_batch = {b: b / statistics.median(times[label][b]) for b in batches}
        fastest = {b: b / min(times[label][b]) for b in batches}
        best = max(per_batch, key=per_batch.get)
        results["versions"][label] = {
            "sentences_per_s": per_batch,
            "fastest_run_sentences_per_s": fastest,
            "best_batch": best,
        }
        lines.append(
            f"| {version} {label} | "
            + " | ".join(f"{per_batch[b]:.0f} ({fastest[b]:.0f})" for b in batches)
            + f" | {per_batch[best]:.0f}/s at batch {best} |"
        )
    fp32 = results["versions"]["FP32"]
    int8 = results["versions"]["INT8 per-channel"]
    speedup = max(int8["sentences_per_s"].values()) / max(fp32["sentences_per_s"].values())
    lines += [
        "",
        "Cells: median sentences/s (fastest single run). Load average at the start: "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
        + f". INT8 / FP32 at their best batch sizes: {speedup:.2f}×.",
    ]
    return "\n".join(lines), results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / ".aiworks" / "bench" / "lifecycle"), help="work and report folder")
    parser.add_argument("--repeats", type=int, default=50, help="timed runs per batch size for the digits table")
    parser.add_argument("--batches", default="1,8,16,32,64", help="minilm batch sizes")
    parser.add_argument("--seconds", type=float, default=3.0, help="minilm: timed seconds per batch size")
    parser.add_argument("--skip-minilm", action="store_true")
    parser.add_argument("--skip-digits", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    header = f"# lifecycle benchmark ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)\n"
    sections = [header] + ([] if args.skip_digits else [digits_table(out, args.repeats)])
    summary: dict = {}
    if not args.skip_minilm:
        text, summary = minilm_throughput(out, [int(b) for b in args.batches.split(",")], args.seconds)
        sections.append(text)
    report = "\n\n".join(sections) + "\n"
    print(report)
    (out / "lifecycle.md").write_text(report)
    (out / "minilm.json").write_text(json.dumps(summary, indent=2))
    print(f"saved {out / 'lifecycle.md'} and {out / 'digits-v2' / 'report.json'}")


if __name__ == "__main__":
    main()
