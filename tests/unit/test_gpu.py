"""The NVML GPU reader: absent without a driver, and the catalogue's families for readings."""

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aiworks.core.gpu import GpuReading, NvmlGpus, gpu_metric_families


def test_no_driver_means_no_gpus():
    # These CI machines have no NVIDIA driver; the runtime then exports no GPU series.
    assert NvmlGpus.open() is None


def test_families_carry_each_gpu_reading():
    readings = [
        GpuReading(0, "GPU-a", "H200", 0.75, 3 << 30, 141 << 30),
        GpuReading(1, "GPU-b", "H200", 0.0, 1 << 30, 141 << 30),
    ]

    class Collector:
        def collect(self):
            yield from gpu_metric_families(readings, "runtime-7")

    registry = CollectorRegistry()
    registry.register(Collector())
    samples = {
        (s.name, s.labels["gpu"]): (s.value, s.labels["replica"])
        for f in text_string_to_metric_families(generate_latest(registry).decode())
        for s in f.samples
    }
    assert samples[("aiworks_runtime_gpu_utilization_ratio", "0")] == (0.75, "runtime-7")
    assert samples[("aiworks_runtime_gpu_memory_used_bytes", "1")] == (float(1 << 30), "runtime-7")
    assert samples[("aiworks_runtime_gpu_memory_total_bytes", "0")] == (float(141 << 30), "runtime-7")
    assert len(samples) == 6
