"""Wires the gateway together and runs both front ends in one event loop: ``aiworks gateway``."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import uvicorn
from tritonclient.grpc import service_pb2_grpc

from aiworks.batch.jobs import JobStore
from aiworks.batch.service import BatchService
from aiworks.cache.client import CacheClient
from aiworks.core.errors import AIWorksError
from aiworks.core.lifecycle import settle_memory, stop_event
from aiworks.core.looplag import start_loop_lag_probe
from aiworks.core.metrics import serve_metrics_or_warn, stop_metrics
from aiworks.core.redis_client import fail_fast_redis
from aiworks.core.rpc import add_port, create_server, set_serving, use_process_caller
from aiworks.core.tracing import setup_tracing, shutdown_tracing
from aiworks.gateway.batch_routes import watch_ended_jobs
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.diagnostics import Diagnostics
from aiworks.gateway.grpc_servicer import InferenceServicer
from aiworks.gateway.http_app import create_app
from aiworks.gateway.http_protocol import bounded_protocol
from aiworks.gateway.settings import GatewaySettings
from aiworks.gateway.shared_memory import SharedMemoryRegistry
from aiworks.gateway.stream_grpc import ResultStreamsServicer
from aiworks.gateway.tenancy_layer import Tenancy
from aiworks.nearline.queue import AsyncQueue
from aiworks.pb.streams.v1 import streams_pb2_grpc
from aiworks.scheduler.client import Routing, SchedulerClient
from aiworks.security.callers import own_caller
from aiworks.security.keyring import watch_internal_token, watch_key_file
from aiworks.security.sealing import Sealer
from aiworks.security.tls import uvicorn_ssl_options
from aiworks.streams.store import Publisher, Reader
from aiworks.streams.subscription import Subscriptions

log = logging.getLogger("aiworks.gateway")


class _HttpServer(uvicorn.Server):
    """uvicorn without its own signal handling: the gateway stops both servers together."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def http_config(app, settings: GatewaySettings, public_tls=None) -> uvicorn.Config:
    """The HTTP server's settings. ``timeout_graceful_shutdown``: without it uvicorn waits on stop for every
    response still running, and an SSE subscriber that never leaves kept the gateway from ever exiting."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.http_port,
        log_config=None,
        access_log=False,
        lifespan="off",
        http=bounded_protocol(settings.max_header_bytes),
        timeout_keep_alive=30,
        timeout_graceful_shutdown=settings.shutdown_grace_s,
        **(uvicorn_ssl_options(public_tls) if public_tls else {}),
    )


async def _start_tenancy(settings: GatewaySettings) -> Tenancy:
    """Tenants, keys, limits, usage and audit log, built once; a bad file stops the gateway naming it."""
    try:
        tenancy = Tenancy.from_settings(settings)
        await tenancy.start()
    except (AIWorksError, OSError) as exc:
        raise SystemExit(f"gateway: {exc}") from None
    log.info(
        "tenancy: %s; limits and usage %s; audit log %s",
        "demo mode (no tenants file)" if tenancy.demo_mode else f"tenants from {settings.tenants_file}",
        "shared through Redis" if settings.redis_url else "in this process",
        tenancy.audit.name if tenancy.audit else "off",
    )
    return tenancy


def _credential_sealer(settings: GatewaySettings, tenancy: Tenancy) -> Sealer | None:
    """What seals the credentials that wait in Redis with batch jobs and asynchronous requests.

    With tenants, either tier needs the credential key file: a credential is never kept in clear. In demo
    mode no credential is kept (nothing checks one), so the key is optional there."""
    tiers = bool(settings.batch_files_url or settings.async_requests)
    if settings.credential_key_file is not None:
        try:
            sealer = Sealer.from_file(settings.credential_key_file)
        except AIWorksError as exc:
            raise SystemExit(f"gateway: AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE: {exc.message}") from None
        log.info("credential key file %s: %s; %s", settings.credential_key_file, sealer.describe(),
                 tenancy.auth.work_tokens.describe() if tenancy.auth.work_tokens else "no work tokens")
        return sealer
    if tiers and not tenancy.demo_mode:
        raise SystemExit(
            "gateway: the Batch API and asynchronous requests keep each caller's credential in Redis until a runner "
            "sends it, sealed: set AIWORKS_GATEWAY_CREDENTIAL_KEY_FILE to the installation's credential key file, "
            "the one the batch runners and nearline workers read (`aiworks certs --credential-key FILE` makes one)"
        )
    return None


async def serve(settings: GatewaySettings) -> None:
    stop = stop_event()
    setup_tracing("gateway", settings)
    tenancy = await _start_tenancy(settings)
    sealer = _credential_sealer(settings, tenancy)  # before any port opens: a refusal here costs nothing
    metrics, metrics_port = serve_metrics_or_warn(settings.metrics_port, settings.host)
    # TLS on the public ports with a certificate; mutual TLS to the scheduler and cache once a CA is set too.
    public_tls = settings.tls_files(mutual=False)
    internal_tls = public_tls if public_tls and public_tls.ca else None
    use_process_caller(own_caller(settings, "gateway"))  # to the scheduler, runtimes and cache, over plaintext
    scheduler = SchedulerClient(settings.scheduler_address, settings.max_message_bytes, 10.0, internal_tls)
    # The scheduler's routing table, watched; requests go from here straight to the runtimes.
    routing = Routing(scheduler, runtime_timeout_s=settings.request_timeout_s)
    await routing.start(wait_s=5.0)
    cache = None
    if settings.cache_address:
        cache = CacheClient(
            settings.cache_address,
            max_message_bytes=settings.max_message_bytes,
            lookup_timeout_s=settings.cache_lookup_timeout_s,
            retry_after_s=settings.cache_retry_after_s,
            tls=internal_tls,
        )
    diagnostics = Diagnostics(settings.trace_file.name if settings.trace_file else "")
    publisher = subscriptions = None
    if settings.result_streams:
        if not settings.redis_url:
            raise SystemExit("AIWORKS_GATEWAY_RESULT_STREAMS needs AIWORKS_GATEWAY_REDIS_URL: the streams are in Redis")
        publisher = Publisher(
            fail_fast_redis(settings.redis_url, max_connections=4, timeout_s=5.0), max_len=settings.stream_max_len,
            queue_size=settings.stream_publish_queue, max_record_bytes=settings.stream_max_record_bytes,
        )  # fmt: skip
        publisher.start()
        # Each subscriber holds a connection while its read blocks (1 s at most): one per subscriber.
        reader = Reader(
            fail_fast_redis(settings.redis_url, max_connections=settings.stream_max_subscribers + 4, timeout_s=5.0),
            claim_idle_s=settings.stream_claim_idle_s,
        )
        # One set of subscribers for both front ends (SSE and gRPC): one bound, one policy.
        subscriptions = Subscriptions(
            reader, buffer_events=settings.stream_buffer_events, send_timeout_s=settings.stream_send_timeout_s,
            max_subscribers=settings.stream_max_subscribers,
            max_per_tenant=settings.stream_max_subscribers_per_tenant,
        )  # fmt: skip
    dataplane = GatewayDataPlane(
        scheduler, routing, settings.server_name, cache=cache, tenancy=tenancy, diagnostics=diagnostics,
        max_load_file_bytes=settings.max_load_file_bytes,
        shared_memory=SharedMemoryRegistry(settings.shared_memory_max_regions), streams=publisher,
    )  # fmt: skip

    grpc_server, health = create_server(settings.max_request_bytes, max_metadata_bytes=settings.max_header_bytes)
    servicer = InferenceServicer(dataplane, settings.max_request_bytes)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, grpc_server)
    if subscriptions is not None:
        streams_pb2_grpc.add_ResultStreamsServicer_to_server(
            ResultStreamsServicer(dataplane, subscriptions), grpc_server
        )
    grpc_port = add_port(grpc_server, f"{settings.host}:{settings.grpc_port}", public_tls, require_client_cert=False)
    await grpc_server.start()

    batch = None
    if settings.batch_files_url:
        if not settings.redis_url:
            raise SystemExit("AIWORKS_GATEWAY_BATCH_FILES_URL needs AIWORKS_GATEWAY_REDIS_URL (jobs live in Redis)")
        batch = BatchService(
            JobStore.from_url(settings.redis_url, sealer=sealer), settings.batch_files_url,
            chunk_size=settings.batch_chunk_size,
            max_active_jobs=settings.batch_max_active_jobs,
        )
    ended_watch = None
    if settings.redis_url and tenancy.auth.work_tokens is not None:
        # Work tokens of batch jobs that have ended are refused: read from the job store every second.
        ended_store = batch.store if batch is not None else JobStore.from_url(settings.redis_url)
        ended_watch = asyncio.create_task(watch_ended_jobs(ended_store, tenancy.auth.ended_work))
    nearline = None
    if settings.async_requests:
        if not settings.redis_url:
            raise SystemExit("AIWORKS_GATEWAY_ASYNC_REQUESTS needs AIWORKS_GATEWAY_REDIS_URL: the queue is in Redis")
        nearline = AsyncQueue.from_url(settings.redis_url, ttl_s=settings.async_result_ttl_s, sealer=sealer)
    app = create_app(
        dataplane, max_request_bytes=settings.max_request_bytes, batch=batch,
        batch_max_file_bytes=settings.batch_max_file_bytes, nearline=nearline,
        nearline_max_backlog=settings.async_max_backlog, nearline_deadline_s=settings.async_deadline_s,
        nearline_max_backlog_per_tenant=settings.async_max_backlog_per_tenant,
        streams=subscriptions,
    )  # fmt: skip
    http = _HttpServer(http_config(app, settings, public_tls))
    http_task = asyncio.create_task(http.serve())
    while not http.started:
        if http_task.done():
            await http_task
            raise SystemExit(f"HTTP server could not start on {settings.host}:{settings.http_port}")
        await asyncio.sleep(0.01)
    await set_serving(health, True)
    lag = start_loop_lag_probe("gateway")
    # A rotation step written to the key file (the Secret, on Kubernetes) is taken here without a restart.
    key_watch = watch_key_file(settings.credential_key_file if sealer else None,
                               [sealer, tenancy.auth.work_tokens], settings.credential_key_reload_s)  # fmt: skip
    token_watch = watch_internal_token(settings)  # the token it presents to the scheduler, runtimes and cache
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
    settle_memory()  # started: what exists now lives as long as the process
    await stop.wait()
    await set_serving(health, False)
    if settings.drain_s > 0:
        await _drain(stop, dataplane, settings.drain_s)
    log.info("gateway stopping")
    for watch in (key_watch, token_watch, ended_watch):
        if watch is not None:
            watch.cancel()
    http.should_exit = True  # both stop together, each bounded by shutdown_grace_s
    await asyncio.gather(http_task, grpc_server.stop(grace=settings.shutdown_grace_s))
    if cache is not None:
        await cache.close()
        log.info("result cache client: %s", cache.counters.as_dict())
    # Before the limits close: answers still awaited for abandoned requests settle (free their slots) now.
    await routing.close()
    await scheduler.close()
    dataplane.shared_memory.close()
    if batch is not None:
        await batch.store.close()
    elif ended_watch is not None:
        await ended_store.close()
    if nearline is not None:
        await nearline.close()
    if publisher is not None:
        await publisher.close()
        await publisher.redis.aclose()
        await subscriptions.reader.redis.aclose()
    await tenancy.close()  # the last usage to Redis, the last audit lines to disk
    lag.stop()
    await stop_metrics(metrics)
    shutdown_tracing()


async def _drain(stop: asyncio.Event, dataplane: GatewayDataPlane, drain_s: float) -> None:
    """Keep serving for ``drain_s`` while readiness says no, so load balancers move new requests elsewhere.

    On Kubernetes a deleted pod's endpoint leaves the Services and meshes a few seconds after its
    SIGTERM: a gateway that closed its ports at once refused what was still sent to it. A second
    signal (Ctrl-C again) ends the wait.
    """
    dataplane.draining = True
    log.info("gateway draining: reporting not ready, still serving, for %.1f s before its ports close", drain_s)
    stop.clear()
    try:
        await asyncio.wait_for(stop.wait(), drain_s)
        log.info("gateway drain cut short by a second signal")
    except TimeoutError:
        pass


def main(settings: GatewaySettings) -> None:
    asyncio.run(serve(settings))
