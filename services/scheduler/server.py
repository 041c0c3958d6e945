"""Wires the scheduler together and runs it: ``aiworks scheduler``."""

from __future__ import annotations

import asyncio
import logging

from aiworks.core.lifecycle import settle_memory, stop_event
from aiworks.core.looplag import start_loop_lag_probe
from aiworks.core.metrics import on_loop, serve_metrics_or_warn, stop_metrics
from aiworks.core.rpc import add_port, create_server, set_serving, use_process_caller
from aiworks.core.tracing import setup_tracing, shutdown_tracing
from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from aiworks.runtime.client import RuntimeClient
from aiworks.scheduler.collector import SchedulerCollector
from aiworks.scheduler.dataplane import Scheduler
from aiworks.scheduler.registry import ReplicaRegistry
from aiworks.scheduler.servicer import CALLERS_BY_METHOD, SchedulerServicer
from aiworks.scheduler.settings import SchedulerSettings
from aiworks.scheduler.traffic_state import TrafficPolicy
from aiworks.scheduler.traffic_store import open_store
from aiworks.security.callers import own_caller, server_check
from aiworks.security.keyring import watch_internal_token

log = logging.getLogger("aiworks.scheduler")


def seed_policies(seed: dict[str, dict[str, int]]) -> list[TrafficPolicy]:
    """The deployment's seed weights as policies; a seed with every weight 0 (no canary yet) is none."""
    return [TrafficPolicy(model, weights) for model, weights in sorted(seed.items()) if any(weights.values())]


async def serve(settings: SchedulerSettings) -> None:
    stop = stop_event()
    setup_tracing("scheduler", settings)
    tls = settings.tls_files()  # mutual TLS with gateways, runtimes and tools when set
    service = scheduler_pb2.DESCRIPTOR.services_by_name["SchedulerService"]
    callers = server_check(settings, "scheduler", settings.host, service, CALLERS_BY_METHOD)
    use_process_caller(own_caller(settings, "scheduler"))  # to the runtimes, over plaintext
    registry = ReplicaRegistry(
        lambda address: RuntimeClient(address, settings.max_message_bytes, settings.runtime_timeout_s, tls)
    )
    store = open_store(settings.redis_url, settings.state_file, poll_s=settings.traffic_poll_s,
                       prefix=settings.traffic_key_prefix)  # fmt: skip
    scheduler = Scheduler(settings, registry, store=store)
    await scheduler.restore_traffic(seed_policies(settings.traffic_seed))
    audit = None
    if settings.audit_log:
        from aiworks.security.audit import AuditLog

        audit = AuditLog(settings.audit_log)
        await audit.start()
    server, health = create_server(settings.max_message_bytes, callers)
    servicer = SchedulerServicer(scheduler, audit, callers.auth.describe)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(servicer, server)
    port = add_port(server, f"{settings.host}:{settings.port}", tls)
    await server.start()
    expiry = asyncio.create_task(scheduler.expire_loop())
    follow = asyncio.create_task(scheduler.follow_store())
    token_watch = watch_internal_token(settings, callers)  # a rotated internal token, taken without a restart
    collector = SchedulerCollector(on_loop(asyncio.get_running_loop(), scheduler.status)).register()
    metrics, metrics_port = serve_metrics_or_warn(settings.metrics_port, settings.host)
    await set_serving(health, True)
    lag = start_loop_lag_probe("scheduler")
    log.info(
        "scheduler serving gRPC%s on %s:%d (callers checked by %s; metrics %s; traffic policies in %s)",
        " with mutual TLS" if tls else "",
        settings.host,
        port,
        callers.auth.describe,
        metrics_port or "off",
        store.describe if store is not None else "memory only",
    )
    settle_memory()  # started: what exists now lives as long as the process
    await stop.wait()
    log.info("scheduler stopping")
    if token_watch is not None:
        token_watch.cancel()
    await set_serving(health, False)
    expiry.cancel()
    follow.cancel()
    await server.stop(grace=5)
    await scheduler.close()
    if audit is not None:
        await audit.close()
    lag.stop()
    await stop_metrics(metrics)
    collector.unregister()
    shutdown_tracing()


def main(settings: SchedulerSettings) -> None:
    asyncio.run(serve(settings))
