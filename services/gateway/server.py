"""Wires the gateway together and runs both front ends in one event loop: ``aiworks gateway``."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn
from tritonclient.grpc import service_pb2_grpc

from aiworks.core.lifecycle import stop_event
from aiworks.core.metrics import serve_metrics_or_warn, stop_metrics
from aiworks.core.rpc import create_server, set_serving
from aiworks.core.tracing import setup_tracing, shutdown_tracing
from aiworks.gateway.cache_client import CacheClient
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.grpc_servicer import InferenceServicer
from aiworks.gateway.http_app import create_app
from aiworks.gateway.scheduler_client import SchedulerClient
from aiworks.gateway.settings import GatewaySettings

log = logging.getLogger("aiworks.gateway")


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway stops both servers together."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(settings: GatewaySettings) -> None:
    stop = stop_event()
    setup_tracing("gateway", settings)
    metrics, metrics_port = serve_metrics_or_warn(settings.metrics_port, settings.host)
    scheduler = SchedulerClient(settings.scheduler_address, settings.max_message_bytes, settings.request_timeout_s)
    cache = None
    if settings.cache_address:
        cache = CacheClient(
            settings.cache_address,
            scheduler.metadata,
            max_message_bytes=settings.max_message_bytes,
            lookup_timeout_s=settings.cache_lookup_timeout_s,
            metadata_ttl_s=settings.cache_metadata_ttl_s,
            retry_after_s=settings.cache_retry_after_s,
        )
    dataplane = GatewayDataPlane(scheduler, settings.server_name, cache=cache)

    grpc_server, health = create_server(settings.max_request_bytes)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(InferenceServicer(dataplane), grpc_server)
    grpc_port = grpc_server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
    await grpc_server.start()

    app = create_app(dataplane, max_request_bytes=settings.max_request_bytes)
    http = _HttpServer(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.http_port,
            log_config=None,
            access_log=False,
            lifespan="off",
            http="httptools",
            timeout_keep_alive=30,
        )
    )
    http_task = asyncio.create_task(http.serve())
    while not http.started:
        if http_task.done():
            await http_task
            raise SystemExit(f"HTTP server could not start on {settings.host}:{settings.http_port}")
        await asyncio.sleep(0.01)
    await set_serving(health, True)
    log.info(
        "gateway serving HTTP on %s:%d and gRPC on %s:%d (scheduler %s, cache %s, metrics %s)",
        settings.host,
        settings.http_port,
        settings.host,
        grpc_port,
        settings.scheduler_address,
        settings.cache_address or "off",
        metrics_port or "off",
    )
    await stop.wait()
    log.info("gateway stopping")
    await set_serving(health, False)
    http.should_exit = True
    await http_task
    await grpc_server.stop(grace=5)
    if cache is not None:
        await cache.close()
        log.info("result cache client: %s", cache.counters.as_dict())
    await scheduler.close()
    await stop_metrics(metrics)
    shutdown_tracing()


def main(settings: GatewaySettings) -> None:
    asyncio.run(serve(settings))
