"""Wires the runtime together and runs it: ``aiworks runtime``."""

from __future__ import annotations

import asyncio
import logging
import time

from aiworks.runtime import triton_backend
from aiworks.runtime.collector import RuntimeCollector
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.registrar import Registrar
from aiworks.runtime.repository import ModelRepository
from aiworks.runtime.residency import startup_models
from aiworks.runtime.servicer import RuntimeServicer
from aiworks.runtime.settings import RuntimeSettings

from aiworks.core.lifecycle import stop_event
from aiworks.core.metrics import on_loop, serve_metrics_or_warn, stop_metrics
from aiworks.core.rpc import create_server, insecure_channel, set_serving
from aiworks.core.tracing import setup_tracing, shutdown_tracing
from aiworks.pb.runtime.v1 import runtime_pb2_grpc

log = logging.getLogger("aiworks.runtime")


def _nvml(device: str):
    """NVML's GPUs for a replica that advertises a GPU (its own metrics); None elsewhere."""
    if device != "gpu":
        return None
    try:
        from aiworks.core.gpu import NvmlGpus
    except ImportError:
        return None
    return NvmlGpus.open()


async def serve(settings: RuntimeSettings) -> None:
    stop = stop_event()
    repository = ModelRepository(settings.model_repository)
    if not repository.root.is_dir():
        raise SystemExit(f"model repository {repository.root} does not exist")
    replica_id = settings.resolved_replica_id()
    setup_tracing("runtime", settings, instance=replica_id)
    dataplane = RuntimeDataPlane(
        repository,
        intra_op_threads=settings.intra_op_threads,
        inline_below_us=settings.inline_below_us,
        memory_budget_bytes=settings.memory_budget_bytes,
        warmup=settings.warmup,
        debug_delay_ms=settings.debug_delay_ms,
        replica_id=replica_id,
    )
    triton_backend.use_settings(settings)  # tritonserver starts only if a model uses it
    nvml = _nvml(settings.device)
    collector = RuntimeCollector(
        replica_id,
        on_loop(asyncio.get_running_loop(), lambda: len(dataplane.ready_specs())),
        triton_backend.device_metrics,
        nvml,
    ).register()
    metrics, metrics_port = serve_metrics_or_warn(settings.metrics_port, settings.host)

    server, health = create_server(settings.max_message_bytes)
    runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(RuntimeServicer(dataplane, replica_id), server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    await server.start()
    log.info("runtime %s serving gRPC on %s:%d (metrics %s)", replica_id, settings.host, port, metrics_port or "off")

    configs = {}
    for name in repository.names():
        try:
            configs[name] = repository.entry(name).config
        except Exception:
            configs[name] = None
    started = time.perf_counter()
    for name in startup_models(configs, settings.models):  # preload and warm-up: aiworks.runtime.residency
        try:
            await dataplane.load(name, preloaded=True)
        except Exception as exc:
            log.error("could not load model %s: %s", name, exc)
    log.info("start-up loads took %.0f ms", (time.perf_counter() - started) * 1e3)

    channel = insecure_channel(settings.scheduler_address, settings.max_message_bytes)
    registrar = Registrar(
        channel,
        dataplane,
        replica_id=replica_id,
        address=settings.resolved_advertise_address(port),
        device=settings.device,
        labels=settings.labels,
        interval_s=settings.heartbeat_interval_s,
    )
    beats = asyncio.create_task(registrar.run())
    await set_serving(health, True)
    log.info("runtime %s ready with %d model version(s)", replica_id, len(dataplane.ready_specs()))

    await stop.wait()
    log.info("runtime %s stopping", replica_id)
    await set_serving(health, False)
    beats.cancel()
    await server.stop(grace=5)
    await channel.close()
    dataplane.close()
    triton_backend.shutdown()
    await stop_metrics(metrics)
    collector.unregister()
    if nvml is not None:
        nvml.close()
    shutdown_tracing()


def main(settings: RuntimeSettings) -> None:
    asyncio.run(serve(settings))
