"""The runtime replica's state as Prometheus gauges, read when Prometheus scrapes.

- ``aiworks_runtime_models_loaded``: model versions this replica reports ready,
  read on the event loop's thread (:func:`aiworks.core.metrics.on_loop`);
- ``aiworks_runtime_inflight_requests``: requests and generations being served
  (an int the servicer keeps; read as it is);
- ``aiworks_scheduler_queue_depth`` and ``_queue_bytes``: this replica's
  queues (the scheduling stage's gauges keep their names; the queues moved
  from the scheduler into the runtimes), read the same way;
- ``aiworks_runtime_sequences`` and ``aiworks_runtime_sequence_outcomes_total``: the
  stateful models' sequences held here (active in a slot, waiting for one)
  and how they started and ended, read the same way.
- GPU utilisation and memory, where something reports them: the Triton
  backend's ``nv_gpu_*`` metrics while this replica has a Triton connection
  open (:meth:`TritonConnection.gpu_metrics`), else NVML for a replica that
  advertises ``device=gpu`` (:mod:`aiworks.core.gpu`). A CPU replica exports
  no GPU series. These reads happen in the scrape thread, never on the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from aiworks.core import metrics

log = logging.getLogger(__name__)

# Triton's names for the catalogue's GPU gauges (the label is Triton's gpu_uuid).
_TRITON_GPU = {
    "nv_gpu_utilization": metrics.RUNTIME_GPU_UTILIZATION,
    "nv_gpu_memory_used_bytes": metrics.RUNTIME_GPU_MEMORY_USED,
    "nv_gpu_memory_total_bytes": metrics.RUNTIME_GPU_MEMORY_TOTAL,
}
_HELP = {
    metrics.RUNTIME_GPU_UTILIZATION: "GPU busy fraction (0..1).",
    metrics.RUNTIME_GPU_MEMORY_USED: "GPU memory in use.",
    metrics.RUNTIME_GPU_MEMORY_TOTAL: "GPU memory in all.",
}


def _read(reader: Callable, what: str):
    """``reader()``, or None when it fails (logged): the scrape answers without those series."""
    try:
        return reader()
    except Exception as exc:
        log.warning("%s not exported this scrape: %s", what, exc or type(exc).__name__)
        return None


class RuntimeCollector(metrics.ScrapeCollector):
    """Models loaded and, where reported, GPU utilisation and memory of one replica."""

    def __init__(
        self,
        replica_id: str,
        count_models: Callable[[], int],
        triton_gpus: Callable[[], dict[str, dict[str, float]] | None] = lambda: None,
        nvml=None,
        read_queues: Callable[[], list] = list,
        inflight: Callable[[], int] = lambda: 0,
        read_sequences: Callable[[], list] = list,
    ):
        self.replica_id = replica_id
        self._inflight = inflight
        self._read_sequences = read_sequences
        self._count_models = count_models
        self._read_queues = read_queues
        self._triton_gpus = triton_gpus
        self._nvml = nvml

    def collect(self):
        loaded = _read(self._count_models, "models loaded")
        if loaded is not None:
            family = GaugeMetricFamily(
                metrics.RUNTIME_MODELS_LOADED, "Model versions this replica has ready.", labels=["replica"]
            )
            family.add_metric([self.replica_id], loaded)
            yield family
        family = GaugeMetricFamily(
            metrics.RUNTIME_INFLIGHT_REQUESTS,
            "Requests and generations this replica is serving now; a stopping replica drains them to 0.",
            labels=["replica"],
        )
        family.add_metric([self.replica_id], self._inflight())
        yield family
        yield from self._queue_families()
        yield from self._sequence_families()
        yield from self._gpu_families()

    def _sequence_families(self):
        """Stateful models' sequences: held now (a replica's drain waits for them), and how they went."""
        tables = _read(self._read_sequences, "sequences")
        if tables is None:
            return
        held = GaugeMetricFamily(
            metrics.RUNTIME_SEQUENCES,
            "Sequences of stateful models held by this replica: active (in a slot, its state here) or waiting "
            "for a slot.",
            labels=["replica", "model", "version", "state"],
        )
        outcomes = CounterMetricFamily(
            metrics.RUNTIME_SEQUENCE_OUTCOMES,
            "Sequences of stateful models by what happened to them: started, ended (by a request), idled "
            "(released after max_sequence_idle_microseconds), refused (a start with every slot and the backlog full).",
            labels=["replica", "model", "version", "outcome"],
        )
        for t in tables:
            for state, value in (("active", t.active), ("waiting", t.waiting)):
                held.add_metric([self.replica_id, t.model, t.version, state], value)
            for outcome in ("started", "ended", "idled", "refused"):
                outcomes.add_metric([self.replica_id, t.model, t.version, outcome], getattr(t, outcome))
        yield held
        yield outcomes

    def _queue_families(self):
        """The queues' depth per class and bytes (the scheduling stage's gauges; the queues live here)."""
        queues = _read(self._read_queues, "queue depths")
        if queues is None:
            return
        depth = GaugeMetricFamily(
            metrics.SCHEDULER_QUEUE_DEPTH, "Requests queued now.", labels=["model", "version", "priority"]
        )
        queued_bytes = GaugeMetricFamily(
            metrics.SCHEDULER_QUEUE_BYTES, "Input bytes queued now.", labels=["model", "version"]
        )
        for q in queues:
            for priority, count in (
                ("realtime", q.queued_realtime), ("standard", q.queued_standard), ("batch", q.queued_batch)
            ):  # fmt: skip
                depth.add_metric([q.model, q.version, priority], count)
            queued_bytes.add_metric([q.model, q.version], q.queued_bytes)
        yield depth
        yield queued_bytes

    def _gpu_families(self):
        try:
            reported = self._triton_gpus()
        except Exception as exc:  # Triton down or slow: no GPU series this scrape
            log.warning("Triton's GPU metrics not exported this scrape: %s", exc or type(exc).__name__)
            reported = None
        if reported:
            yield from triton_gpu_families(reported, self.replica_id)
        elif self._nvml is not None:
            from aiworks.core.gpu import gpu_metric_families

            yield from gpu_metric_families(self._nvml.read(), self.replica_id)


def triton_gpu_families(reported: dict[str, dict[str, float]], replica_id: str) -> list[GaugeMetricFamily]:
    """The catalogue's GPU gauges from Triton's device metrics (``parse_device_metrics``' shape)."""
    families = []
    for triton_name, name in _TRITON_GPU.items():
        per_gpu = reported.get(triton_name)
        if not per_gpu:
            continue
        family = GaugeMetricFamily(name, _HELP[name], labels=["replica", "gpu"])
        for gpu, value in sorted(per_gpu.items()):
            family.add_metric([replica_id, gpu], value)
        families.append(family)
    return families
