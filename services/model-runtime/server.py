"""Wires the runtime together and runs it: ``aiworks runtime``."""

from __future__ import annotations

import asyncio
import logging
import time

from aiworks.runtime import triton_backend
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.registrar import Registrar
from aiworks.runtime.repository import ModelRepository
from aiworks.runtime.residency import startup_models
from aiworks.runtime.servicer import RuntimeServicer
from aiworks.runtime.settings import RuntimeSettings

from aiworks.core.lifecycle import stop_event
from aiworks.core.rpc import create_server, insecure_channel, set_serving
from aiworks.pb.runtime.v1 import runtime_pb2_grpc

log = logging.getLogger("aiworks.runtime")


async def serve(settings: RuntimeSettings) -> None:
    stop = stop_event()
    repository = ModelRepository(settings.model_repository)
    if not repository.root.is_dir():
        raise SystemExit(f"model repository {repository.root} does not exist")
    dataplane = RuntimeDataPlane(
        repository,
        intra_op_threads=settings.intra_op_threads,
        inline_below_us=settings.inline_below_us,
        memory_budget_bytes=settings.memory_budget_bytes,
        warmup=settings.warmup,
        debug_delay_ms=settings.debug_delay_ms,
    )
    replica_id = settings.resolved_replica_id()
    triton_backend.use_settings(settings)  # tritonserver starts only if a model uses it

    server, health = create_server(settings.max_message_bytes)
    runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(RuntimeServicer(dataplane, replica_id), server)
    port = server.add_insecure_port(f"{settings.host}:{settings.port}")
    await server.start()
    log.info("runtime %s serving gRPC on %s:%d", replica_id, settings.host, port)

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


def main(settings: RuntimeSettings) -> None:
    asyncio.run(serve(settings))
