"""GPU utilisation and memory read through NVML, for the runtime's metrics.

A runtime whose backend runs on an NVIDIA GPU (ONNX Runtime's CUDA or
TensorRT providers) has no Triton to ask for ``nv_gpu_*`` metrics, so it
reads the driver directly. NVML (the ``nvidia-ml-py`` package, imported only
here and only when asked) is the library ``nvidia-smi`` uses; on a machine
without an NVIDIA driver :meth:`NvmlGpus.open` returns ``None`` and the
runtime simply exports no GPU series.

Reading is a few microseconds per device and happens at scrape time, never
on the request path.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuReading:
    index: int
    uuid: str
    name: str
    utilization_ratio: float  # 0..1 over the driver's last sample period
    memory_used_bytes: int
    memory_total_bytes: int


class NvmlGpus:
    """The GPUs this process may use (``CUDA_VISIBLE_DEVICES`` as indices when set)."""

    def __init__(self, nvml, handles: list[tuple[int, object]]):
        self._nvml = nvml
        self._handles = handles

    @classmethod
    def open(cls) -> NvmlGpus | None:
        """NVML's view of the GPUs, or None when there is no NVIDIA driver (or no nvidia-ml-py)."""
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            log.debug("no NVIDIA GPU metrics: %s", exc)
            return None
        indices = list(range(count))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            wanted = [int(v) for v in visible.split(",") if v.strip().isdigit()]
            indices = [i for i in wanted if i < count]
        handles = [(i, pynvml.nvmlDeviceGetHandleByIndex(i)) for i in indices]
        if not handles:
            return None
        return cls(pynvml, handles)

    def read(self) -> list[GpuReading]:
        nvml = self._nvml
        readings = []
        for index, handle in self._handles:
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle)
                mem = nvml.nvmlDeviceGetMemoryInfo(handle)
                uuid = nvml.nvmlDeviceGetUUID(handle)
                name = nvml.nvmlDeviceGetName(handle)
            except nvml.NVMLError as exc:  # a GPU fell off the bus: report the others
                log.warning("cannot read GPU %d: %s", index, exc)
                continue
            readings.append(
                GpuReading(
                    index=index,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    name=name.decode() if isinstance(name, bytes) else name,
                    utilization_ratio=util.gpu / 100.0,
                    memory_used_bytes=int(mem.used),
                    memory_total_bytes=int(mem.total),
                )
            )
        return readings

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


def gpu_metric_families(readings: list[GpuReading], replica: str):
    """The catalogue's GPU gauges (:mod:`aiworks.core.metrics`) for ``readings``, labelled ``replica`` and ``gpu``."""
    from prometheus_client.core import GaugeMetricFamily

    from aiworks.core import metrics

    util = GaugeMetricFamily(
        metrics.RUNTIME_GPU_UTILIZATION, "GPU busy fraction over the driver's last sample.", labels=["replica", "gpu"]
    )
    used = GaugeMetricFamily(metrics.RUNTIME_GPU_MEMORY_USED, "GPU memory in use.", labels=["replica", "gpu"])
    total = GaugeMetricFamily(metrics.RUNTIME_GPU_MEMORY_TOTAL, "GPU memory in all.", labels=["replica", "gpu"])
    for r in readings:
        gpu = str(r.index)
        util.add_metric([replica, gpu], r.utilization_ratio)
        used.add_metric([replica, gpu], r.memory_used_bytes)
        total.add_metric([replica, gpu], r.memory_total_bytes)
    return [util, used, total]
