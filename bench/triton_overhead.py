"""Triton-backend benchmark: what the suite's layers add in front of Triton, and Triton vs the ORT backend.

One run starts the suite with one runtime replica that supervises its own
tritonserver (the nvidia-pytriton build), and measures, on the same models:

  (a) Triton called directly over gRPC;
  (b) the suite (gateway -> scheduler -> runtime -> Triton) over gRPC: (b) - (a)
      is the overhead of the suite's layers;
  (c) the suite's own ONNX Runtime backend on the same ONNX file.

That wheel has no onnxruntime backend for Triton, so Triton runs the ONNX file
with ONNX Runtime inside a Python-backend model (tests/tritonserver/testdata/
onnx_python_model.py), the CPU stand-in for a GPU model. Everything shares the
machine's cores with the load generator: read the figures as relative.

``--breakdown`` explains the overhead at concurrency 1 instead: every service
writes its spans to a trace file while one client sends requests one at a
time, and the medians of the spans give each layer's share (the batch window,
the hops, the runtime's own call to Triton). It also measures the runtime's
Triton call in-process both ways, alternating: awaited on the event loop
(``grpc.aio``, the backend's ``run_async``) and in a worker thread with the
blocking client (how the backend called Triton before).

Usage: python bench/triton_overhead.py [--duration-s 5] [--levels 1,8,32] [--out FILE] [--breakdown]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import tempfile
from pathlib import Path

import numpy as np

from aiworks.bench.loadgen import HEADER, sweep
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

ROOT = Path(__file__).resolve().parent.parent
STAND_IN = ROOT / "tests" / "tritonserver" / "testdata" / "onnx_python_model.py"

CONFIG = """\
max_batch_size: 64
input [ {{ name: "input" data_type: TYPE_FP32 dims: [ {features} ] }} ]
output [ {{ name: "output" data_type: TYPE_FP32 dims: [ {classes} ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 500 }}
instance_group [ {{ count: 1 kind: {kind} }} ]
{extra}"""

MODELS = {
    # name: (features, hidden layers, classes); weights are random, the cost is what matters
    "small": (4, (16,), 3),  # about 1 us of compute a row: the layers' overhead dominates
    "mlp": (256, (1024, 1024), 16),  # about 0.2 ms a row on one core
}


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return f"{os.cpu_count()} cores ({cpu}), {platform.python_implementation()} {platform.python_version()}"


def mlp_onnx(features: int, hidden: tuple[int, ...], classes: int) -> bytes:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes, weights, prev, width = [], [], "input", features
    for i, size in enumerate((*hidden, classes)):
        w = numpy_helper.from_array((rng.standard_normal((width, size)) / np.sqrt(width)).astype(np.float32), f"w{i}")
        b = numpy_helper.from_array(np.zeros(size, np.float32), f"b{i}")
        weights += [w, b]
        last = i == len(hidden)
        nodes.append(helper.make_node("MatMul", [prev, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Add", [f"m{i}", f"b{i}"], ["output" if last else f"a{i}"]))
        if not last:
            nodes.append(helper.make_node("Relu", [f"a{i}"], [f"r{i}"]))
            prev = f"r{i}"
        width = size
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", classes])],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model.SerializeToString()


def write_repository(root: Path) -> None:
    """``<name>`` on the ONNX Runtime backend and ``<name>_triton`` behind Triton, same ONNX file."""
    for name, (features, hidden, classes) in MODELS.items():
        onnx_bytes = mlp_onnx(features, hidden, classes)
        for served, kind, extra in (
            (name, "KIND_CPU", ""),
            (f"{name}_triton", "KIND_GPU",
             'backend: "triton"\nparameters { key: "triton_backend" value: { string_value: "python" } }\n'),
        ):  # fmt: skip
            folder = root / served
            (folder / "1").mkdir(parents=True)
            text = CONFIG.format(features=features, classes=classes, kind=kind, extra=extra)
            (folder / "config.pbtxt").write_text(text)
            (folder / "1" / "model.onnx").write_bytes(onnx_bytes)
            if served.endswith("_triton"):
                shutil.copy(STAND_IN, folder / "1" / "model.py")


def measure(levels: list[int], duration_s: float, log_dir: Path, repo: Path) -> list[tuple[str, str, object]]:
    triton_port = free_port()
    config = SuiteConfig.on_free_ports(
        model_repository=repo,
        replicas=1,
        log_dir=log_dir,
        log_level="WARNING",
        extra_env={
            "AIWORKS_RUNTIME_DEVICE": "gpu",
            "AIWORKS_RUNTIME_TRITON_GRPC_PORT": str(triton_port),
            "AIWORKS_RUNTIME_TRITON_INSTANCE_KIND": "KIND_CPU",
        },
    )
    supervisor = Supervisor(config)
    suite, triton = f"127.0.0.1:{config.grpc_port}", f"127.0.0.1:{triton_port}"
    rows = []
    try:
        supervisor.start()
        for name in MODELS:
            for label, url, model in (
                ("Triton, called directly", triton, f"{name}_triton"),
                ("suite -> Triton backend", suite, f"{name}_triton"),
                ("suite -> ONNX Runtime backend", suite, name),
            ):
                print(f"\n{name}: {label} ({model} at {url})\n{HEADER}", flush=True)
                for result in asyncio.run(sweep("grpc", url, model, "", levels, duration_s=duration_s)):
                    rows.append((name, label, result))
    finally:
        supervisor.stop()
    return rows


def table(rows) -> str:
    lines = [
        "| model | served by | concurrency | infer/s | p50 ms | p99 ms | avg batch | errors |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, label, r in rows:
        lines.append(
            f"| {name} | {label} | {r.concurrency} | {r.throughput_rps:.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} "
            f"| {r.avg_batch:.1f} | {r.errors} |"
        )
    lines += ["", "Overhead of the suite's layers in front of Triton (p50, same concurrency):", ""]
    lines += [
        "| model | concurrency | Triton p50 ms | suite -> Triton p50 ms | added ms |",
        "|---|---:|---:|---:|---:|",
    ]
    by_key = {(n, lbl, r.concurrency): r for n, lbl, r in rows}
    for name, label, r in rows:
        if label.startswith("Triton"):
            via = by_key[(name, "suite -> Triton backend", r.concurrency)]
            lines.append(
                f"| {name} | {r.concurrency} | {r.p50_ms:.2f} | {via.p50_ms:.2f} | {via.p50_ms - r.p50_ms:+.2f} |"
            )
    return "\n".join(lines)


def _spans(folder: Path) -> dict[tuple[str, str], list[float]]:
    import json

    spans: dict[tuple[str, str], list[float]] = {}
    for path in folder.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            span = json.loads(line)
            attributes = span.get("attributes") or {}
            key = (span["name"], attributes.get("aiworks.model", ""))
            spans.setdefault(key, []).append((span["end_unix_ns"] - span["start_unix_ns"]) / 1e6)
            if "aiworks.compute_ms" in attributes:
                spans.setdefault(("backend call", key[1]), []).append(attributes["aiworks.compute_ms"])
    return spans


def breakdown(repo: Path, work: Path, requests: int = 400) -> str:
    """Concurrency 1, tracing on: where the time between the client and Triton goes (median ms)."""
    import statistics
    import time

    import tritonclient.grpc as grpcclient

    triton_port = free_port()
    env = {"AIWORKS_RUNTIME_DEVICE": "gpu", "AIWORKS_RUNTIME_TRITON_GRPC_PORT": str(triton_port),
           "AIWORKS_RUNTIME_TRITON_INSTANCE_KIND": "KIND_CPU"}  # fmt: skip
    for service in ("GATEWAY", "SCHEDULER", "RUNTIME"):
        env[f"AIWORKS_{service}_TRACE_FILE"] = str(work / f"{service.lower()}.jsonl")
    config = SuiteConfig.on_free_ports(model_repository=repo, replicas=1, cache=False, log_dir=work / "logs",
                                       log_level="WARNING", extra_env=env)  # fmt: skip
    supervisor = Supervisor(config)
    suite, triton = f"127.0.0.1:{config.grpc_port}", f"127.0.0.1:{triton_port}"
    x = np.random.default_rng(0).random((1, MODELS["small"][0])).astype(np.float32)
    client_ms: dict[tuple[str, str], float] = {}
    try:
        supervisor.start()
        for url, model in ((suite, "small_triton"), (suite, "small"), (triton, "small_triton")):
            client = grpcclient.InferenceServerClient(url)
            tensor = grpcclient.InferInput("input", list(x.shape), "FP32")
            tensor.set_data_from_numpy(x)
            for _ in range(50):
                client.infer(model, [tensor])
            latencies = []
            for _ in range(requests):
                started = time.perf_counter()
                client.infer(model, [tensor])
                latencies.append(time.perf_counter() - started)
            client.close()
            client_ms[(url, model)] = statistics.median(latencies) * 1e3
    finally:
        supervisor.stop()
    spans = {k: statistics.median(v[50:] or v) for k, v in _spans(work).items()}

    def part(model: str) -> dict[str, float]:
        total = client_ms[(suite, model)]
        gateway, queue = spans[("gateway infer", model)], spans[("scheduler queue", model)]
        batch, execute = spans[("scheduler batch", model)], spans[("runtime execute", model)]
        call = spans[("backend call", model)]
        return {
            "client → gateway and back (front end, outside the gateway's span)": total - gateway,
            "gateway: checks, and its hop to the scheduler": gateway - queue - batch,
            "scheduler: the batch window (max_queue_delay 500 µs, asyncio's ms timers)": queue,
            "scheduler → runtime hop and the scheduler's batch work": batch - execute,
            "runtime: decode, slots, encode (its span less the backend call)": execute - call,
            "the backend call (Triton, or ONNX Runtime in-process)": call,
            "total at the client": total,
        }

    triton_alone = client_ms[(triton, "small_triton")]
    via, ort = part("small_triton"), part("small")
    lines = [
        "| where (median ms, concurrency 1) | suite → Triton backend | suite → ONNX Runtime backend |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {via[name]:.2f} | {ort[name]:.2f} |" for name in via]
    lines += ["", f"Triton called directly by the same client: {triton_alone:.2f} ms; the suite adds "
              f"{via['total at the client'] - triton_alone:+.2f} ms in front of it."]  # fmt: skip
    return "\n".join(lines)


def call_styles(repo: Path, rounds: int = 3, requests: int = 300) -> str:
    """The runtime's Triton call in-process: run_async on the loop against a worker thread, alternating."""
    import statistics
    import time

    from aiworks.core.datatypes import Tensor
    from aiworks.runtime import triton_backend
    from aiworks.runtime.dataplane import RuntimeDataPlane
    from aiworks.runtime.repository import ModelRepository
    from aiworks.runtime.settings import RuntimeSettings
    from aiworks.runtime.triton_backend import TritonModel

    x = np.random.default_rng(0).random((1, MODELS["small"][0])).astype(np.float32)
    inputs = [Tensor("input", "FP32", x.shape, x.tobytes())]
    triton_backend.configure(RuntimeSettings(scheduler_address="", triton_instance_kind="KIND_CPU"))

    class ThreadedTritonModel(TritonModel):
        run_async = None  # the data plane then runs run() in its worker pool, as before

    async def measure() -> tuple[list[float], list[float]]:
        dataplane = RuntimeDataPlane(ModelRepository(repo), warmup=False)
        await dataplane.load("small_triton")
        loaded = dataplane._version("small_triton", "1")
        aio_model = loaded.model
        threaded = object.__new__(ThreadedTritonModel)
        threaded.__dict__.update(aio_model.__dict__)
        results: dict[str, list[float]] = {"aio": [], "thread": []}
        for _ in range(rounds):
            for label, model in (("aio", aio_model), ("thread", threaded)):
                loaded.model = model
                latencies = []
                for i in range(requests + 30):
                    started = time.perf_counter()
                    await dataplane.execute("small_triton", "1", inputs, [])
                    if i >= 30:
                        latencies.append(time.perf_counter() - started)
                results[label].append(statistics.median(latencies) * 1e3)
        loaded.model = aio_model
        dataplane.close()
        return results["aio"], results["thread"]

    try:
        aio, thread = asyncio.run(measure())
    finally:
        triton_backend.shutdown()
    return (
        f"The runtime's data plane executing one row on Triton, median ms of {rounds} alternating rounds: "
        f"awaited on the event loop (grpc.aio) {statistics.fmean(aio):.3f} ms "
        f"({', '.join(f'{v:.3f}' for v in aio)}); in a worker thread with the blocking client "
        f"{statistics.fmean(thread):.3f} ms ({', '.join(f'{v:.3f}' for v in thread)})."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=5.0, help="seconds measured at each level")
    parser.add_argument("--levels", default="1,8,32", help="concurrency levels, comma-separated")
    parser.add_argument("--out", type=Path, help="also write the markdown table to this file")
    parser.add_argument("--breakdown", action="store_true", help="where the time goes at concurrency 1, instead")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    if args.breakdown:
        with tempfile.TemporaryDirectory(prefix="triton-breakdown-") as tmp:
            repo = Path(tmp) / "models"
            write_repository(repo)
            text = f"Machine: {machine()}.\n\n{breakdown(repo, Path(tmp))}\n\n{call_styles(repo)}"
        print("\n" + text)
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(text + "\n")
        return
    with tempfile.TemporaryDirectory(prefix="triton-bench-") as tmp:
        repo = Path(tmp) / "models"
        write_repository(repo)
        rows = measure(levels, args.duration_s, Path(tmp) / "logs", repo)
    report = (
        f"Machine: {machine()}. Triton: the nvidia-pytriton tritonserver, Python backend running ONNX Runtime "
        f"(the wheel has no onnxruntime backend). gRPC, 1 row a request, {args.duration_s:.0f} s a level.\n\n"
        + table(rows)
    )
    print("\n" + report)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report + "\n")


if __name__ == "__main__":
    main()
