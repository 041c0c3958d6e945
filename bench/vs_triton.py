"""The suite against a real tritonserver serving the same model files, side by side in one run.

Both serve iris, digits version 2 and minilm version 2 (INT8) from the same
``model.onnx`` files:

- the suite as ``aiworks up`` starts it by default (2 runtime replicas, no
  monitor, the result cache off because no demo model enables it);
- tritonserver 2.45 from the nvidia-pytriton wheel (the only build that runs
  here), whose Python backend runs ONNX Runtime through
  ``bench/triton_models/batched_onnx.py`` (one session run per dynamic batch,
  as Triton's onnxruntime backend does), with 2 instances of 1 intra-op
  thread, the same as the suite's 2 replicas of 1 thread.

The same client, tritonclient's asyncio API, drives both, closed loop: ``c``
tasks each sending the next request as soon as the last one is answered. Each
round runs every case on both servers, alternating which goes first, so
drift in the machine's load hits both. Reported per case: throughput, p50
and p99 latency, and the CPU time each process spent per request (read from
/proc before and after), so the cost of each hop is visible.

Usage:
  python bench/vs_triton.py [--models iris,digits,minilm] [--concurrency 1,16,64] [--protocols grpc,http]
                            [--duration-s 8] [--warmup-s 2] [--rounds 1] [--out bench/results/vs_triton.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TRITON_MODEL = ROOT / "bench" / "triton_models" / "batched_onnx.py"
CACHE = ROOT / ".aiworks" / "bench-cache" / "vs_triton"
CLK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Model:
    """A served model: its name, the version both servers run, and one request's input."""

    name: str
    version: str  # the suite's version; Triton serves the same file as version 1

    def inputs(self):
        if self.name == "minilm":
            return [("text", "BYTES", np.array([["An inference server batches requests from many clients."]],
                                                 dtype=object))]  # fmt: skip
        width = 4 if self.name == "iris" else 64
        rng = np.random.default_rng(0)
        return [("input", "FP32", rng.random((1, width), dtype=np.float32))]


MODELS = {"iris": Model("iris", "1"), "digits": Model("digits", "2"), "minilm": Model("minilm", "2")}


# ---- the model files ---------------------------------------------------------------------------


def build_suite_repository(models: list[str]) -> Path:
    """The demo models (and minilm with its INT8 version), built once and kept under .aiworks/bench-cache."""
    repo = CACHE / "repo"
    if not (repo / "iris").is_dir() or not (repo / "digits").is_dir():
        from aiworks.demo.models import build_demo_repository

        build_demo_repository(repo, force=True, progress=lambda m: print(m, flush=True))
    if "minilm" in models and not (repo / "minilm" / "2" / "model.onnx").is_file():
        from aiworks.lifecycle import minilm

        print("building minilm (FP32 and INT8; about a minute) ...", flush=True)
        minilm.build(repo, int8=True)
    return repo


def triton_config(suite_config: Path, name: str) -> str:
    """The suite's config for Triton's Python backend: same tensors, batching and threads; 2 instances."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    msg = model_config_pb2.ModelConfig()
    text_format.Parse(suite_config.read_text(), msg)
    msg.name = name
    msg.platform = ""
    msg.backend = "python"
    msg.ClearField("version_policy")
    msg.ClearField("optimization")
    msg.ClearField("instance_group")
    msg.instance_group.add(count=2, kind=model_config_pb2.ModelInstanceGroup.KIND_CPU)
    for tensor in list(msg.input) + list(msg.output):
        if tensor.HasField("reshape"):
            tensor.ClearField("reshape")  # batched_onnx.py shapes outputs to the declared dims itself
    msg.parameters["intra_op_thread_count"].string_value = "1"
    return text_format.MessageToString(msg)


def build_triton_repository(suite_repo: Path, target: Path, models: list[str]) -> None:
    for name in models:
        model = MODELS[name]
        folder = target / name
        (folder / "1").mkdir(parents=True)
        (folder / "config.pbtxt").write_text(triton_config(suite_repo / name / "config.pbtxt", name))
        (folder / "1" / "model.onnx").symlink_to(suite_repo / name / model.version / "model.onnx")
        shutil.copy(TRITON_MODEL, folder / "1" / "model.py")


# ---- CPU per process ---------------------------------------------------------------------------


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return int(fields[11]) + int(fields[12])  # utime + stime


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


class CpuMeter:
    """CPU seconds of named groups of processes (a group: a pid and all its descendants)."""

    def __init__(self, groups: dict[str, int]):
        self.groups = groups

    def read(self) -> dict[str, float]:
        out = {}
        for label, pid in self.groups.items():
            pids = [pid, *_descendants(pid)]
            out[label] = sum(_cpu_ticks(p) for p in pids) / CLK
        out["client"] = time.process_time()
        return out


# ---- the load ----------------------------------------------------------------------------------


@dataclass
class CaseResult:
    server: str
    model: str
    protocol: str
    concurrency: int
    round: int
    requests: int = 0
    errors: int = 0
    throughput_rps: float = 0.0
    p50_ms: float = 0.0
    p99_ms: float = 0.0
    cpu_ms_per_request: dict[str, float] = field(default_factory=dict)
    first_error: str = ""


def _client(protocol: str, url: str, concurrency: int):
    if protocol == "grpc":
        import tritonclient.grpc.aio as client

        return client, client.InferenceServerClient(url)
    import tritonclient.http.aio as client

    return client, client.InferenceServerClient(url, conn_limit=max(concurrency, 1))


async def run_case(server: str, url: str, model: Model, served_version: str, protocol: str, concurrency: int,
                   warmup_s: float, duration_s: float, meter: CpuMeter, round_no: int) -> CaseResult:  # fmt: skip
    module, client = _client(protocol, url, concurrency)
    inputs = []
    for name, datatype, array in model.inputs():
        tensor = module.InferInput(name, list(array.shape), datatype)
        if protocol == "http":
            tensor.set_data_from_numpy(array, binary_data=True)
        else:
            tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    result = CaseResult(server, model.name, protocol, concurrency, round_no)
    latencies: list[float] = []
    state = {"measuring": False, "stop": False}

    async def worker() -> None:
        while not state["stop"]:
            started = time.perf_counter()
            try:
                await client.infer(model.name, inputs, model_version=served_version)
            except Exception as exc:  # noqa: BLE001 - counted and reported
                if state["measuring"]:
                    result.errors += 1
                    result.first_error = result.first_error or f"{type(exc).__name__}: {exc}"[:300]
                await asyncio.sleep(0.01)
                continue
            if state["measuring"]:
                latencies.append(time.perf_counter() - started)

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    try:
        await asyncio.sleep(warmup_s)
        before = meter.read()
        state["measuring"] = True
        t0 = time.perf_counter()
        await asyncio.sleep(duration_s)
        state["measuring"] = False
        elapsed = time.perf_counter() - t0
        after = meter.read()
    finally:
        state["stop"] = True
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.close()
    latencies.sort()
    result.requests = len(latencies)
    result.throughput_rps = len(latencies) / elapsed
    if latencies:
        result.p50_ms = latencies[len(latencies) // 2] * 1e3
        result.p99_ms = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] * 1e3
    if latencies:
        result.cpu_ms_per_request = {k: (after[k] - before[k]) * 1e3 / len(latencies) for k in after}
    return result


# ---- the servers -------------------------------------------------------------------------------


class Servers:
    """The suite and tritonserver, started on free ports, stopped together."""

    def __init__(self, work: Path, models: list[str], replicas: int):
        self.work = work
        self.models = models
        self.replicas = replicas
        self.suite = None
        self.triton = None

    def start(self) -> None:
        from aiworks.runtime.tritonserver import TritonDistribution, TritonServer
        from aiworks.supervisor.supervisor import SuiteConfig, Supervisor, free_port

        suite_repo = build_suite_repository(self.models)
        triton_repo = self.work / "triton-repo"
        build_triton_repository(suite_repo, triton_repo, self.models)
        self.triton_http_port = free_port()
        self.triton = TritonServer(
            TritonDistribution.find(), triton_repo, self.work / "triton",
            extra_args=("--allow-http=true", "--http-address=127.0.0.1", f"--http-port={self.triton_http_port}",
                        *(f"--load-model={m}" for m in self.models)),
        )  # fmt: skip
        print("starting tritonserver ...", flush=True)
        self.triton.start(timeout_s=300)
        config = SuiteConfig.on_free_ports(
            model_repository=suite_repo, replicas=self.replicas, log_dir=self.work / "logs", log_level="WARNING",
            cache=False,
        )  # fmt: skip
        self.suite = Supervisor(config)
        print("starting the suite ...", flush=True)
        self.suite.start()

    def urls(self, server: str, protocol: str) -> str:
        if server == "triton":
            return self.triton.grpc_url if protocol == "grpc" else f"127.0.0.1:{self.triton_http_port}"
        port = self.suite.config.grpc_port if protocol == "grpc" else self.suite.config.http_port
        return f"127.0.0.1:{port}"

    def meters(self) -> dict[str, CpuMeter]:
        suite = {c.name: c.process.pid for c in self.suite.children if c.process is not None}
        return {"suite": CpuMeter(suite), "triton": CpuMeter({"tritonserver": self.triton.pid})}

    def stop(self) -> None:
        if self.suite is not None:
            self.suite.stop()
        if self.triton is not None:
            self.triton.stop()


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return f"{os.cpu_count()} cores ({cpu}), {platform.python_implementation()} {platform.python_version()}"


def _median(results: list[CaseResult], attr: str) -> float:
    return statistics.median(getattr(r, attr) for r in results)


def summarize(results: list[CaseResult]) -> str:
    keys = sorted({(r.model, r.protocol, r.concurrency) for r in results},
                  key=lambda k: (list(MODELS).index(k[0]), k[1], k[2]))  # fmt: skip
    lines = [
        "| case | suite req/s | Triton req/s | ratio | suite p50 ms | Triton p50 ms | suite p99 ms | Triton p99 ms "
        "| suite CPU ms/req (by process) | Triton CPU ms/req | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for model, protocol, c in keys:
        suite = [r for r in results if (r.server, r.model, r.protocol, r.concurrency) == ("suite", model, protocol, c)]
        triton = [r for r in results if (r.server, r.model, r.protocol, r.concurrency) == ("triton", model, protocol, c)]
        if not suite or not triton:
            continue
        s_rps, t_rps = _median(suite, "throughput_rps"), _median(triton, "throughput_rps")
        cpu = suite[len(suite) // 2].cpu_ms_per_request
        groups: dict[str, float] = {}
        for name, value in cpu.items():
            kind = name.split("-")[0]
            groups[kind] = groups.get(kind, 0.0) + value
        cpu_text = ", ".join(f"{k} {v:.2f}" for k, v in groups.items())
        t_cpu = triton[len(triton) // 2].cpu_ms_per_request
        t_text = f"server {t_cpu.get('tritonserver', 0):.2f}, client {t_cpu.get('client', 0):.2f}"
        errors = sum(r.errors for r in suite + triton)
        lines.append(
            f"| {model}, {protocol}, c={c} | {s_rps:,.0f} | {t_rps:,.0f} | {s_rps / t_rps if t_rps else 0:.2f} "
            f"| {_median(suite, 'p50_ms'):.2f} | {_median(triton, 'p50_ms'):.2f} | {_median(suite, 'p99_ms'):.2f} "
            f"| {_median(triton, 'p99_ms'):.2f} | {cpu_text} | {t_text} | {errors} |"
        )
    return "\n".join(lines)


async def run(args, servers: Servers) -> list[CaseResult]:
    results: list[CaseResult] = []
    meters = servers.meters()
    order = ["suite", "triton"]
    for round_no in range(1, args.rounds + 1):
        for name in args.models:
            model = MODELS[name]
            for protocol in args.protocols:
                for c in args.concurrency:
                    for server in order:
                        version = model.version if server == "suite" else "1"
                        r = await run_case(server, servers.urls(server, protocol), model, version, protocol, c,
                                           args.warmup_s, args.duration_s, meters[server], round_no)  # fmt: skip
                        results.append(r)
                        print(f"round {round_no} {server:6} {name:6} {protocol:4} c={c:<3} {r.throughput_rps:8.0f} "
                              f"req/s  p50 {r.p50_ms:7.2f} ms  p99 {r.p99_ms:7.2f} ms  errors {r.errors}"
                              + (f"  ({r.first_error})" if r.errors else ""), flush=True)  # fmt: skip
                    order.reverse()
    return results


def in_process_minilm(repo: Path, version: str, batches=(16, 32, 64), seconds: float = 4.0,
                      threads: int = 2) -> dict[int, float]:
    """Sentences/s of onnxruntime alone on ``minilm`` ``version`` (``threads`` intra-op threads), per batch size:
    the issue's yardstick for the suite's minilm at concurrency 64."""
    import onnxruntime as ort
    from onnxruntime_extensions import get_library_path

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(get_library_path())
    session = ort.InferenceSession(str(repo / "minilm" / version / "model.onnx"), options,
                                   providers=["CPUExecutionProvider"])  # fmt: skip
    name = session.get_inputs()[0].name
    text = MODELS["minilm"].inputs()[0][2][0, 0]
    rates = {}
    for batch in batches:
        feed = {name: np.array([[text]] * batch, dtype=object)}
        session.run(None, feed)
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            session.run(None, feed)
            done += batch
        rates[batch] = done / (time.perf_counter() - started)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="iris,digits,minilm", help="comma-separated: iris, digits, minilm")
    parser.add_argument("--concurrency", default="1,16,64", help="closed-loop clients, comma-separated")
    parser.add_argument("--protocols", default="grpc,http", help="grpc, http or both")
    parser.add_argument("--duration-s", type=float, default=8.0, help="seconds measured per case and server")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="seconds of load before measuring")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over every case; medians are reported")
    parser.add_argument("--replicas", type=int, default=2, help="the suite's runtime replicas (Triton: instances)")
    parser.add_argument("--out", type=Path, help="write every result as JSON here")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    args.protocols = [p for p in args.protocols.split(",") if p]
    unknown = set(args.models) - set(MODELS)
    if unknown:
        sys.exit(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
    with tempfile.TemporaryDirectory(prefix="vs-triton-") as tmp:
        servers = Servers(Path(tmp), args.models, args.replicas)
        try:
            servers.start()
            results = asyncio.run(run(args, servers))
        finally:
            servers.stop()
    header = (f"{time.strftime('%Y-%m-%d')}, {machine()}; {args.duration_s:g} s per case after {args.warmup_s:g} s "
              f"warm-up, {args.rounds} round(s), medians")  # fmt: skip
    table = summarize(results)
    print(f"\n{header}\n\n{table}")
    in_process = {}
    if "minilm" in args.models:  # the suite's servers are stopped: onnxruntime has the machine to itself
        in_process = in_process_minilm(build_suite_repository(args.models), MODELS["minilm"].version)
        best = max(in_process.values())
        suite = [r.throughput_rps for r in results if (r.server, r.model, r.concurrency) == ("suite", "minilm", 64)
                 and r.protocol == "grpc"]  # fmt: skip
        rates = ", ".join(f"batch {b}: {v:,.0f}/s" for b, v in in_process.items())
        print(f"\nminilm in-process onnxruntime (2 threads): {rates}")
        if suite:
            print(f"suite minilm grpc c=64: {statistics.median(suite):,.0f} req/s = "
                  f"{statistics.median(suite) / best:.2f}x in-process at its best batch size")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": header, "args": sys.argv[1:],
                                        "results": [asdict(r) for r in results],
                                        "minilm_in_process_sentences_per_s": in_process}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
