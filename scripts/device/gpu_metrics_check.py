"""Device check: the runtime's NVML GPU metrics follow a real GPU's load.

Run on a machine with an NVIDIA GPU and PyTorch (the device lent to some
tasks): ``PYTHONPATH=src python3 scripts/device/gpu_metrics_check.py OUT_DIR``.
It reads the GPUs idle, then while a bf16 matrix-product loop keeps the
first one busy and 8 GiB more is allocated on it, and exports both through
the same Prometheus families the runtime serves (core.gpu). It fails unless
utilisation rises above 50% and memory in use grows by at least 8 GiB.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aiworks.core.gpu import NvmlGpus, gpu_metric_families


class _Collector:
    def __init__(self, gpus: NvmlGpus):
        self.gpus = gpus

    def collect(self):
        yield from gpu_metric_families(self.gpus.read(), "runtime-0")


def scrape(registry: CollectorRegistry) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            if s.labels.get("gpu") == "0":
                out[s.name] = s.value
    return out


def main(out_dir: Path) -> None:
    gpus = NvmlGpus.open()
    assert gpus is not None, "NVML found no GPU"
    registry = CollectorRegistry()
    registry.register(_Collector(gpus))
    idle = scrape(registry)
    x = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
    ballast = torch.empty(8 << 30, dtype=torch.uint8, device="cuda:0")
    stop = threading.Event()

    def work():
        while not stop.is_set():
            for _ in range(20):
                x @ x
            torch.cuda.synchronize()

    t = threading.Thread(target=work)
    t.start()
    time.sleep(2.0)
    samples = []
    for _ in range(10):
        samples.append(scrape(registry))
        time.sleep(0.2)
    stop.set()
    t.join()
    del ballast
    busy_util = max(s["aiworks_runtime_gpu_utilization_ratio"] for s in samples)
    grew = max(s["aiworks_runtime_gpu_memory_used_bytes"] for s in samples) - idle["aiworks_runtime_gpu_memory_used_bytes"]
    result = {
        "gpu": gpus.read()[0].name,
        "idle": idle,
        "busy_samples": samples,
        "busy_utilization_max": busy_util,
        "memory_growth_bytes": grew,
        "exposition": generate_latest(registry).decode(),
    }
    (out_dir / "gpu_metrics.json").write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k not in ("busy_samples", "exposition")}, indent=2))
    assert busy_util > 0.5, f"utilisation under load only {busy_util:.2f}"
    assert grew >= 8 << 30, f"memory in use grew by only {grew / 2**30:.2f} GiB"
    print("OK: NVML GPU metrics follow the load")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
