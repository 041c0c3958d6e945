"""The gateway's logic, shared by the HTTP and gRPC front ends.

Both transports translate their requests into the domain types of
:mod:`aiworks.core.inference` and call this class; it answers with plain
Python structures shaped like the Open Inference Protocol's responses.
Later layers (tenancy, the result cache) hook in here, once, for both.
"""

from __future__ import annotations

import logging

from aiworks import __version__
from aiworks.core.inference import InferRequest, InferResponse
from aiworks.core.model_config import ModelSpec
from aiworks.gateway.cache_client import CacheClient
from aiworks.gateway.scheduler_client import SchedulerClient
from aiworks.gateway.telemetry import GatewayTelemetry

log = logging.getLogger(__name__)

EXTENSIONS = ["binary_tensor_data", "model_repository", "statistics", "schedule_policy"]


class GatewayDataPlane:
    """Open Inference Protocol operations, transport-agnostic."""

    def __init__(self, scheduler: SchedulerClient, server_name: str = "aiworks", cache: CacheClient | None = None):
        self.scheduler = scheduler
        self.server_name = server_name
        self.cache = cache
        # Per-request metrics and the server span; the front ends wrap each inference in it.
        self.telemetry = GatewayTelemetry()

    async def live(self) -> bool:
        return True

    async def ready(self) -> bool:
        try:
            return await self.scheduler.ready()
        except Exception as exc:
            log.warning("not ready: %s", exc)
            return False

    def server_metadata(self) -> dict:
        return {"name": self.server_name, "version": __version__, "extensions": EXTENSIONS}

    async def model_metadata(self, name: str, version: str) -> dict:
        spec, versions = await self.scheduler.metadata(name, version)
        return {
            "name": spec.name,
            "versions": versions,
            "platform": spec.platform,
            "inputs": [{"name": t.name, "datatype": t.datatype, "shape": spec.full_shape(t)} for t in spec.inputs],
            "outputs": [{"name": t.name, "datatype": t.datatype, "shape": spec.full_shape(t)} for t in spec.outputs],
        }

    async def model_config(self, name: str, version: str) -> dict:
        """The model's config in Triton's JSON form (the fields the suite uses)."""
        spec, _ = await self.scheduler.metadata(name, version)
        return spec_to_triton_config(spec)

    async def model_ready(self, name: str, version: str) -> bool:
        return await self.scheduler.model_ready(name, version)

    async def infer(self, request: InferRequest) -> InferResponse:
        # ---- result cache hook (docs/cache.md): lookup, schedule on a miss, store in the background.
        if self.cache is not None:
            return await self.cache.infer(request, self.scheduler.infer)
        return await self.scheduler.infer(request)

    async def repository_index(self, ready_only: bool = False) -> list[dict]:
        specs = await self.scheduler.index(ready_only)
        return [{"name": s.name, "version": s.version, "state": s.state.value, "reason": s.reason} for s in specs]

    async def load(self, name: str) -> None:
        try:
            await self.scheduler.load(name)
        finally:
            # ---- result cache hook: a (re)loaded model's old results must not be served.
            if self.cache is not None:
                await self.cache.invalidate(name)

    async def unload(self, name: str) -> None:
        try:
            await self.scheduler.unload(name)
        finally:
            # ---- result cache hook: an unloaded model's results go with it.
            if self.cache is not None:
                await self.cache.invalidate(name)

    async def statistics(self, name: str, version: str) -> list[dict]:
        """Triton's statistics extension, summed over replicas, with a per-replica breakdown."""
        merged: dict[tuple[str, str], dict] = {}
        for replica_id, models in await self.scheduler.statistics(name, version):
            for s in models:
                entry = merged.setdefault(
                    (s.name, s.version),
                    {
                        "name": s.name,
                        "version": s.version,
                        "last_inference": 0,
                        "inference_count": 0,
                        "execution_count": 0,
                        "inference_stats": {
                            "success": {"count": 0, "ns": 0},
                            "fail": {"count": 0, "ns": 0},
                            "compute_infer": {"count": 0, "ns": 0},
                        },
                        "replicas": [],
                    },
                )
                entry["last_inference"] = max(entry["last_inference"], s.last_inference_ms)
                entry["inference_count"] += s.inference_count
                entry["execution_count"] += s.execution_count
                stats = entry["inference_stats"]
                stats["success"]["count"] += s.success_count
                stats["fail"]["count"] += s.failure_count
                stats["compute_infer"]["count"] += s.execution_count
                stats["compute_infer"]["ns"] += s.compute_ns
                entry["replicas"].append(
                    {
                        "replica_id": replica_id,
                        "inference_count": s.inference_count,
                        "execution_count": s.execution_count,
                    }
                )
        return [merged[k] for k in sorted(merged)]


_TRITON_TYPES = {"BYTES": "TYPE_STRING"}


def spec_to_triton_config(spec: ModelSpec) -> dict:
    def tensors(specs):
        return [
            {"name": t.name, "data_type": _TRITON_TYPES.get(t.datatype, f"TYPE_{t.datatype}"), "dims": list(t.dims)}
            for t in specs
        ]

    config = {
        "name": spec.name,
        "platform": spec.platform,
        "max_batch_size": spec.max_batch_size,
        "input": tensors(spec.inputs),
        "output": tensors(spec.outputs),
        "instance_group": [{"count": spec.instance_count, "kind": "KIND_CPU"}],
        "parameters": {k: {"string_value": v} for k, v in spec.parameters.items()},
    }
    if spec.batching.enabled:
        config["dynamic_batching"] = {
            "preferred_batch_size": list(spec.batching.preferred_batch_sizes),
            "max_queue_delay_microseconds": spec.batching.max_queue_delay_us,
        }
    return config
