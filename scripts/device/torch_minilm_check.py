"""Device check: MiniLM served by the runtime's pytorch backend on a GPU, through the whole suite.

On the GPU machine, scripts/device/torch_minilm_check.sh sets up the carried
packages and runs this; here, ``--cpu`` runs the same steps on the CPU,
quickly (tests/torch/test_device_check.py does)::

    .venv/bin/python scripts/device/torch_minilm_check.py OUT --carry .carry --cpu --quick

Steps, each recorded in ``OUT/torch_minilm.json``:

1. rebuild MiniLM-L6 from the carried weights (scripts/device/prepare_torch_check.py);
2. in-process PyTorch on the same device and precision: sentences/s at batch
   sizes up to 512, and the best of them (the yardstick);
3. export it as TorchScript into a model repository (``platform:
   "pytorch_libtorch"``, bf16 and CUDA graphs at the request shape on a GPU),
   start scheduler, runtime (``device gpu``) and gateway, and check the
   suite's answers against in-process PyTorch over tritonclient;
4. throughput and p50 at concurrency 1, 16 and 64 through the gateway
   (tritonclient's gRPC protocol), for requests of 1 and of 16 sentences,
   with NVML's GPU utilisation sampled meanwhile; the runtime's GPU metrics
   and the GPUs the replica advertises to the scheduler.

The targets (issue 20) are reported, not asserted: at concurrency 64 the
suite reaches >= 0.8x in-process PyTorch's best, with the GPU >= 85 % busy.
Wrong answers fail the run (exit status 1).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from prepare_torch_check import unpack_weights  # noqa: E402

SENTENCES = (
    "The cat sits on the mat.",
    "A man is playing a guitar on stage.",
    "Stock markets fell sharply on Monday after the announcement.",
    "How do I reset my password?",
    "Quantum computers use qubits instead of bits.",
    "An inference server batches requests from many clients.",
    "She sells sea shells by the sea shore.",
    "I love pizza with extra cheese and mushrooms.",
)
MODEL = "minilm_torch"


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def build_module(carry: Path):
    """MiniLM-L6 with mean pooling and L2 normalisation, from the carried weights (fp32, on the CPU)."""
    from transformers import BertConfig, BertModel

    from aiworks.lifecycle.minilm import sentence_embedder

    config = BertConfig.from_json_file(str(carry / "minilm" / "config.json"))
    config._attn_implementation = "eager"  # traces to plain ops, as the ONNX export does
    bert = BertModel(config)  # the pooler is unused (mean pooling), but its weights are in the file
    missing, unexpected = bert.load_state_dict(unpack_weights(carry / "minilm" / "weights.safetensors"), strict=False)
    if unexpected or [m for m in missing if not m.endswith("position_ids")]:
        raise SystemExit(f"the carried weights do not fit: missing {missing}, unexpected {unexpected}")
    return sentence_embedder(bert.eval())


def tokens(carry: Path, count: int, length: int) -> dict[str, np.ndarray]:
    """``count`` sentences (cycling the set) as token ids padded to ``length``, as clients send them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(carry / "minilm"))
    texts = [SENTENCES[i % len(SENTENCES)] for i in range(count)]
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=length, return_tensors="np")
    return {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}


def in_process(module, feeds: dict[str, np.ndarray], device: str, precision: str, batches: list[int], seconds: float):
    """In-process PyTorch: sentences/s per batch size, host arrays in and out as a server would see them."""
    import torch

    dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    model = copy.deepcopy(module).to(device)  # the export later starts from the untouched fp32 weights
    if dtype is not None:
        model = model.to(dtype)
    results = {}
    for batch in batches:
        ids = torch.from_numpy(np.resize(feeds["input_ids"], (batch, feeds["input_ids"].shape[1])))
        mask = torch.from_numpy(np.resize(feeds["attention_mask"], (batch, feeds["attention_mask"].shape[1])))
        if device != "cpu":
            ids, mask = ids.pin_memory(), mask.pin_memory()

        def step(ids=ids, mask=mask):
            with torch.inference_mode(), torch.autocast(device.split(":")[0], dtype=dtype or torch.float32,
                                                        enabled=dtype is not None):  # fmt: skip
                out = model(ids.to(device, non_blocking=True), mask.to(device, non_blocking=True))
                return out.float().cpu()

        for _ in range(3):
            step()
        count, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            step()
            count += 1
        elapsed = time.perf_counter() - started
        results[batch] = {"sentences_per_s": count * batch / elapsed, "ms_per_batch": elapsed / count * 1e3}
        log(f"in-process batch {batch}: {results[batch]['sentences_per_s']:.0f} sentences/s")
    best = max(results, key=lambda b: results[b]["sentences_per_s"])
    with torch.inference_mode(), torch.autocast(device.split(":")[0], dtype=dtype or torch.float32,
                                                enabled=dtype is not None):  # fmt: skip
        ids = torch.from_numpy(feeds["input_ids"]).to(device)
        reference = model(ids, torch.from_numpy(feeds["attention_mask"]).to(device)).float().cpu().numpy()
    return {
        "by_batch": results,
        "best_batch": best,
        "best_sentences_per_s": results[best]["sentences_per_s"],
    }, reference


class GpuSampler:
    """NVML utilisation and memory of GPU 0, sampled every 0.2 s while running."""

    def __init__(self):
        from aiworks.core.gpu import NvmlGpus

        self.gpus = NvmlGpus.open()
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = None

    def __enter__(self):
        self.samples, self._stop = [], threading.Event()
        if self.gpus is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.2):
            reading = self.gpus.read()[0]
            self.samples.append((reading.utilization_ratio, reading.memory_used_bytes))

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def summary(self) -> dict:
        if not self.samples:
            return {}
        utils = [u for u, _ in self.samples]
        return {"utilization_mean": statistics.fmean(utils), "utilization_max": max(utils),
                "memory_used_max_bytes": max(m for _, m in self.samples), "samples": len(utils)}  # fmt: skip


def write_repository(module, feeds, repo: Path, *, gpu: bool, precision: str, max_batch: int, instances: int) -> str:
    import torch

    from aiworks.lifecycle.torch_export import export_model

    length = int(feeds["input_ids"].shape[1])
    example = (torch.from_numpy(feeds["input_ids"][:4]), torch.from_numpy(feeds["attention_mask"][:4]))
    sizes, size = [], 1
    while size <= max_batch:
        sizes.append(size)
        size *= 2
    exported = export_model(
        module,
        example,
        repo,
        MODEL,
        output_names=["embedding"],
        max_batch_size=max_batch,
        dynamic={"input_ids": {1}, "attention_mask": {1}},
        queue_delay_us=1000,
        precision=precision,
        cuda_graph_dims={"input_ids": [length], "attention_mask": [length]} if gpu else None,
        preferred_batch_sizes=sizes,
        instances=instances,
        device="cuda:0" if gpu else "cpu",  # a CPU trace keeps transformers' mask constant on the CPU
    )
    log(exported.summary())
    return exported.config


def suite_answers(url: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(url)
    try:
        inputs = []
        for name in ("input_ids", "attention_mask"):
            tensor = grpcclient.InferInput(name, list(feeds[name].shape), "INT64")
            tensor.set_data_from_numpy(feeds[name])
            inputs.append(tensor)
        return client.infer(MODEL, inputs, outputs=[grpcclient.InferRequestedOutput("embedding")]).as_numpy("embedding")
    finally:
        client.close()


def scheduler_view(supervisor) -> dict:
    from google.protobuf import json_format

    from aiworks.scheduler.client import BlockingSchedulerClient

    tls, caller = supervisor.client_tls_for("admin"), supervisor.client_caller("admin")
    with BlockingSchedulerClient(supervisor.scheduler_address, tls, caller) as scheduler:  # as admin
        reply = scheduler.status()
    doc = json_format.MessageToDict(reply, preserving_proto_field_name=True)
    return {
        "replicas": [{k: r.get(k) for k in ("replica_id", "device", "models", "gpus")} for r in doc.get("replicas", [])]
    }


def runtime_gpu_metrics(targets: list[str]) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for target in targets:
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name.startswith("aiworks_runtime_gpu"):
                out.update({s.name: s.value for s in family.samples})
    return out


def load(url: str, feeds: dict[str, np.ndarray], rows: int, levels: list[int], warmup_s: float, duration_s: float):
    from aiworks.bench.loadgen import sweep
    from aiworks.core.datatypes import encode

    inputs = [(n, "INT64", [rows, feeds[n].shape[1]], encode(np.ascontiguousarray(feeds[n][:rows]), "INT64"))
              for n in ("input_ids", "attention_mask")]  # fmt: skip
    results = []
    sampler = GpuSampler()
    for level in levels:
        with sampler:
            (result,) = asyncio.run(sweep("grpc", url, MODEL, "", [level], warmup_s=warmup_s, duration_s=duration_s,
                                          report=lambda _: None, inputs=inputs))  # fmt: skip
        row = {**vars(result), "rows_per_request": rows, "sentences_per_s": result.throughput_rps * rows,
               "gpu": sampler.summary()}  # fmt: skip
        log(f"suite, {rows} sentence(s) a request, concurrency {level}: {row['sentences_per_s']:.0f} sentences/s, "
            f"p50 {result.p50_ms:.2f} ms, avg batch {result.avg_batch:.1f}, errors {result.errors}, "
            f"GPU busy {row['gpu'].get('utilization_mean', float('nan')):.0%}")  # fmt: skip
        results.append(row)
    return results


def environment(device: str) -> dict:
    import torch

    env = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(), "device": device}
    if device != "cpu":
        env.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda)
    return env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder for torch_minilm.json and the services' logs")
    parser.add_argument("--carry", type=Path, default=Path(".carry"), help="what prepare_torch_check.py wrote")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (the check of this script, not of a GPU)")
    parser.add_argument("--quick", action="store_true", help="short levels and few batch sizes (CPU tests)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sentence, padded (default 128)")
    parser.add_argument("--levels", default="1,16,64", help="concurrency levels (default 1,16,64)")
    parser.add_argument("--rows", default="1,16", help="sentences per request, one sweep each (default 1,16)")
    parser.add_argument("--duration-s", type=float, default=8.0, help="seconds measured per level (default 8)")
    parser.add_argument("--max-batch", type=int, default=256, help="the model's max_batch_size (default 256)")
    parser.add_argument("--instances", type=int, default=2, help="instance_group count: CUDA streams (default 2)")
    args = parser.parse_args()

    import torch

    gpu = not args.cpu
    if gpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --cpu for the CPU path")
    device = "cuda:0" if gpu else "cpu"
    precision = "bf16" if gpu else "fp32"
    levels = [int(x) for x in args.levels.split(",")]
    rows_list = [int(x) for x in args.rows.split(",")]
    batches = [1, 8, 32, 64, 128, 256, 512] if gpu else [1, 8, 32]
    warmup_s, duration_s, baseline_s = 2.0, args.duration_s, 3.0
    if args.quick:  # a check of the script's steps, not a measurement
        levels, rows_list, batches = [1, 4], [1, 4], [1, 4]
        args.tokens, args.max_batch, args.instances = min(args.tokens, 16), 8, 1
        warmup_s, duration_s, baseline_s = 0.3, min(duration_s, 1.5), 0.3
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "environment": environment(device),
                    "settings": {"tokens": args.tokens, "precision": precision, "levels": levels, "rows": rows_list,
                                 "max_batch": args.max_batch, "instances": args.instances}}  # fmt: skip
    ok = False
    work = Path(tempfile.mkdtemp(prefix="torch-check-"))
    supervisor = None
    try:
        module = build_module(args.carry)
        feeds = tokens(args.carry, max(args.max_batch, max(batches)), args.tokens)
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        log(f"in-process PyTorch on {device}, {precision}, {args.tokens} tokens")
        result["in_process"], reference = in_process(module, feeds, device, precision, batches, baseline_s)

        from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

        repo = work / "models"
        result["config"] = write_repository(module, feeds, repo, gpu=gpu, precision=precision,
                                            max_batch=args.max_batch, instances=args.instances)  # fmt: skip
        config = SuiteConfig.on_free_ports(
            model_repository=repo, replicas=1, cache=False, log_dir=work / "logs", log_level="INFO",
            extra_env={"AIWORKS_RUNTIME_DEVICE": "gpu" if gpu else "cpu", "AIWORKS_RUNTIME_INTRA_OP_THREADS": "1"},
        )  # fmt: skip
        supervisor = Supervisor(config)
        started = time.perf_counter()
        supervisor.start()
        result["suite_start_s"] = time.perf_counter() - started
        url = f"127.0.0.1:{config.grpc_port}"
        log(f"suite up in {result['suite_start_s']:.1f} s; gateway gRPC at {url}")

        sample = {k: v[: len(SENTENCES)] for k, v in feeds.items()}
        got = suite_answers(url, sample)
        want = reference[: len(SENTENCES)]
        cosines = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
        result["answers"] = {"max_abs_diff": float(np.abs(got - want).max()), "min_cosine": float(cosines.min())}
        log(f"the suite's answers against in-process PyTorch: {result['answers']}")
        result["scheduler"] = scheduler_view(supervisor)
        result["suite"] = []
        for rows in rows_list:
            result["suite"] += load(url, feeds, rows, levels, warmup_s, duration_s)
        result["runtime_gpu_metrics"] = runtime_gpu_metrics(supervisor.metrics_targets().get("runtime", []))
        best = result["in_process"]["best_sentences_per_s"]
        top = [r for r in result["suite"] if r["concurrency"] == max(levels)]
        result["targets"] = {
            "suite_over_in_process_at_top_concurrency": {
                str(r["rows_per_request"]): r["sentences_per_s"] / best for r in top
            },
            "gpu_busy_at_top_concurrency": {str(r["rows_per_request"]): r["gpu"].get("utilization_mean") for r in top},
            "wanted": {"ratio": 0.8, "gpu_busy": 0.85},
        }
        ok = result["answers"]["min_cosine"] > (0.99 if precision != "fp32" else 0.9999)
        result["ok"] = ok
    except BaseException as exc:
        result["error"] = "".join(traceback.format_exception(exc))
        log(f"failed: {exc}")
    finally:
        if supervisor is not None:
            supervisor.stop()
        logs = args.out / "logs"
        if (work / "logs").is_dir():
            shutil.copytree(work / "logs", logs, dirs_exist_ok=True)
        shutil.rmtree(work, ignore_errors=True)
        (args.out / "torch_minilm.json").write_text(json.dumps(result, indent=2, default=str))
        log(f"wrote {args.out / 'torch_minilm.json'}")
    print(json.dumps({k: result.get(k) for k in ("environment", "answers", "targets", "ok")}, indent=2, default=str))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
