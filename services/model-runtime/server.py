"""Wires the runtime together and runs it: ``aiworks runtime``."""

from __future__ import annotations

import asyncio
import logging
import time

from aiworks.core.errors import AIWorksError
from aiworks.core.lifecycle import settle_memory, stop_event
from aiworks.core.looplag import start_loop_lag_probe
from aiworks.core.metrics import on_loop, serve_metrics_or_warn, stop_metrics
from aiworks.core.rpc import add_port, create_server, set_serving, use_process_caller
from aiworks.core.tracing import setup_tracing, shutdown_tracing
from aiworks.pb.runtime.v1 import runtime_pb2, runtime_pb2_grpc
from aiworks.runtime import onnxruntime_backend, torch_backend, triton_backend
from aiworks.runtime.batcher import QueueLimits
from aiworks.runtime.collector import RuntimeCollector
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.registrar import Registrar
from aiworks.runtime.repository import ModelRepository
from aiworks.runtime.residency import startup_models
from aiworks.runtime.servicer import CALLERS_BY_METHOD, RuntimeServicer
from aiworks.runtime.settings import RuntimeSettings
from aiworks.scheduler.client import SchedulerClient
from aiworks.security.audit import AuditLog
from aiworks.security.callers import own_caller, server_check
from aiworks.security.keyring import watch_internal_token
from aiworks.security.model_guard import ModelGuard

log = logging.getLogger("aiworks.runtime")

LIVENESS_SERVICE = "aiworks.runtime.v1.RuntimeService"
"""gRPC health service that is SERVING while the process serves; the overall status ("") is readiness."""


def _nvml(device: str):
    """NVML's GPUs for a replica that advertises a GPU (its own metrics); None elsewhere."""
    if device != "gpu":
        return None
    try:
        from aiworks.core.gpu import NvmlGpus
    except ImportError:
        return None
    return NvmlGpus.open()


async def _start_audit(settings: RuntimeSettings, replica_id: str) -> AuditLog | None:
    path = settings.resolved_audit_log(replica_id)
    if path is None:
        return None
    key = settings.audit_key_file.read_bytes().strip() if settings.audit_key_file else None
    audit = AuditLog(path, key=key)
    try:
        await audit.start()
    except AIWorksError as exc:  # another process writes it, or its last line is broken
        raise SystemExit(f"cannot open the audit log: {exc}") from None
    return audit


def _model_guard(settings: RuntimeSettings, replica_id: str, audit: AuditLog | None) -> ModelGuard:
    """Keys from the settings' files and variables; a bad key file stops the replica at start-up."""
    try:
        guard = ModelGuard.load(
            repository=settings.model_repository,
            data_key_files=settings.model_key_files,
            data_keys=[k.get_secret_value() for k in settings.model_keys],
            public_key_files=settings.model_public_key_files,
            require_signature=settings.require_signed_models,
            watermark_key_file=settings.model_watermark_key_file,
            watermark_owner=settings.model_watermark_owner,
            audit=audit,
            actor=replica_id,
        )
    except AIWorksError as exc:
        raise SystemExit(f"cannot use the model keys: {exc}") from None
    if guard.checks:
        log.info("model files are checked: %s", "; ".join(guard.checks))
    return guard


def _memory_budget(settings: RuntimeSettings, nvml) -> int:
    """The residency budget: the setting, or on a gpu replica a share of its first GPU's memory."""
    if settings.memory_budget_bytes or nvml is None:
        return settings.memory_budget_bytes
    readings = nvml.read()
    if not readings:
        return 0
    budget = int(readings[0].memory_total_bytes * settings.gpu_memory_fraction)
    log.info(
        "resident models may use %.1f GiB: %.0f%% of GPU %d (%s)",
        budget / 2**30, settings.gpu_memory_fraction * 100, readings[0].index, readings[0].name,
    )  # fmt: skip
    return budget


def _uses_triton(settings: RuntimeSettings, configs: dict) -> bool:
    return bool(settings.triton_url) or any(c is not None and c.backend == "triton" for c in configs.values())


async def _follow_backend_health(dataplane: RuntimeDataPlane, health, interval_s: float = 0.2) -> None:
    """The replica's gRPC health follows its backends' (a tritonserver restarting makes it NOT_SERVING)."""
    serving = True
    while True:
        await asyncio.sleep(interval_s)
        healthy = not dataplane.unhealthy_versions()
        if healthy != serving:
            serving = healthy
            await set_serving(health, healthy)
            if healthy:
                log.info("every backend is healthy again: serving")
            else:
                log.warning("a backend is unhealthy: this replica reports NOT_SERVING until it recovers")


async def serve(settings: RuntimeSettings) -> None:
    stop = stop_event()
    repository = ModelRepository(settings.model_repository)
    if not repository.root.is_dir():
        raise SystemExit(f"model repository {repository.root} does not exist")
    replica_id = settings.resolved_replica_id()
    setup_tracing("runtime", settings, instance=replica_id)
    tls = settings.tls_files()  # mutual TLS with the scheduler when set
    callers = server_check(
        settings, "runtime", settings.host, runtime_pb2.DESCRIPTOR.services_by_name["RuntimeService"], CALLERS_BY_METHOD
    )
    use_process_caller(own_caller(settings, "runtime"))  # to the scheduler, over plaintext
    audit = await _start_audit(settings, replica_id)
    guard = _model_guard(settings, replica_id, audit)
    onnxruntime_backend.use_model_guard(guard)
    torch_backend.use_model_guard(guard)
    nvml = _nvml(settings.device)
    if settings.device == "gpu" and nvml is None:
        log.warning("device gpu, but NVML sees no GPU here: this replica advertises no GPU details")
    dataplane = RuntimeDataPlane(
        repository,
        intra_op_threads=settings.intra_op_threads,
        inline_below_us=settings.inline_below_us,
        memory_budget_bytes=_memory_budget(settings, nvml),
        warmup=settings.warmup,
        debug_delay_ms=settings.debug_delay_ms,
        replica_id=replica_id,
        drain_timeout_s=settings.drain_timeout_s,
        batching=settings.batching,
        max_load_file_bytes=settings.max_load_file_bytes,
        batch_lane_nice=settings.batch_lane_nice,
        queue_limits=QueueLimits(
            settings.max_queue_requests, settings.max_queue_bytes, settings.priority_aging_ms / 1e3,
            settings.max_sequence_backlog, settings.batch_share_when_online, settings.online_window_ms / 1e3,
        ),
    )
    triton_backend.use_settings(settings)
    servicer = RuntimeServicer(dataplane, replica_id)
    collector = RuntimeCollector(
        replica_id,
        on_loop(asyncio.get_running_loop(), lambda: len(dataplane.ready_specs())),
        triton_backend.device_metrics,
        nvml,
        on_loop(asyncio.get_running_loop(), dataplane.queues.stats),
        lambda: servicer.inflight,
        on_loop(asyncio.get_running_loop(), dataplane.queues.sequence_stats),
    ).register()
    metrics, metrics_port = serve_metrics_or_warn(settings.metrics_port, settings.host)
    lag = start_loop_lag_probe("runtime")

    server, health = create_server(settings.max_message_bytes, callers)
    await set_serving(health, False)  # grpcio's servicer starts with "" SERVING; ready comes after the loads
    runtime_pb2_grpc.add_RuntimeServiceServicer_to_server(servicer, server)
    port = add_port(server, f"{settings.host}:{settings.port}", tls)
    await server.start()
    log.info(
        "runtime %s serving gRPC%s on %s:%d (callers checked by %s; metrics %s)",
        replica_id,
        " with mutual TLS" if tls else "",
        settings.host,
        port,
        callers.auth.describe,
        metrics_port or "off",
    )

    configs = {}
    for name in repository.names():
        try:
            configs[name] = repository.entry(name).config
        except Exception:
            configs[name] = None
    if _uses_triton(settings, configs):  # start (or reach) Triton now, with these settings, not on first use
        try:
            await asyncio.get_running_loop().run_in_executor(None, triton_backend.configure, settings)
        except AIWorksError as exc:
            log.error("Triton is not available: %s; its models cannot load until it is", exc)
    started = time.perf_counter()
    failed = []
    for name in startup_models(configs, settings.models):  # preload and warm-up: aiworks.runtime.residency
        try:
            await dataplane.load(name, preloaded=True)
        except Exception as exc:
            failed.append(name)
            log.error("could not load model %s: %s", name, exc)
    log.info("start-up loads took %.0f ms", (time.perf_counter() - started) * 1e3)
    # The process is alive once it is up (liveness); it is ready only when its models loaded, so
    # probes, Services and `helm test` see a replica that has nothing to serve as not ready.
    await set_serving(health, True, LIVENESS_SERVICE)

    # One registrar per scheduler: with several (high availability) each knows this replica independently.
    schedulers, registrars = [], []
    for scheduler_address in settings.scheduler_addresses():
        scheduler = SchedulerClient(scheduler_address, settings.max_message_bytes, tls=tls)
        schedulers.append(scheduler)
        registrars.append(Registrar(
            scheduler,
            dataplane,
            replica_id=replica_id,
            address=settings.resolved_advertise_address(port),
            device=settings.device,
            labels=settings.labels,
            interval_s=settings.heartbeat_interval_s,
            gpus=nvml.read if nvml is not None else None,
            scheduler_address=scheduler_address,
        ))  # fmt: skip

    async def beat_all_now(timeout_s: float = 1.0) -> None:
        await asyncio.gather(*(r.beat_now(timeout_s) for r in registrars))

    dataplane.on_backend_down = beat_all_now
    beats = [asyncio.create_task(r.run()) for r in registrars]
    # Models named in the settings must all load; of "every model in the repository", at least one.
    missing = [name for name in failed if name in (settings.models or ())]
    follower = None
    if missing or not dataplane.ready_specs():
        log.error(
            "runtime %s is NOT ready: %s", replica_id,
            f"model(s) {', '.join(missing)} failed to load" if missing else f"no model in {repository.root} loaded",
        )  # fmt: skip
    else:
        await set_serving(health, True)
        # From here readiness ("") follows the backends (a tritonserver restarting makes it NOT_SERVING).
        follower = asyncio.create_task(_follow_backend_health(dataplane, health))
        log.info("runtime %s ready with %d model version(s)", replica_id, len(dataplane.ready_specs()))

    token_watch = watch_internal_token(settings, callers)  # a rotated internal token, taken without a restart
    settle_memory()  # started: what exists now lives as long as the process
    await stop.wait()
    if follower is not None:
        follower.cancel()
    await set_serving(health, False)  # not ready; still alive while it drains
    drained = await _drain(servicer, registrars, stop, settings.drain_s)
    log.info("runtime %s stopping", replica_id)
    if token_watch is not None:
        token_watch.cancel()
    await set_serving(health, False, LIVENESS_SERVICE)
    for beat in beats:
        beat.cancel()
    # The gateways' request streams stay open while idle: with nothing in flight they are closed at once.
    await server.stop(grace=0.5 if drained else 5)
    for scheduler in schedulers:
        await scheduler.close()
    await dataplane.close()
    triton_backend.shutdown()
    lag.stop()
    await stop_metrics(metrics)
    collector.unregister()
    if nvml is not None:
        nvml.close()
    if audit is not None:
        await audit.close()
    shutdown_tracing()


async def _drain(servicer: RuntimeServicer, registrars: list[Registrar], stop: asyncio.Event, drain_s: float) -> bool:
    """After the stop signal: tell the schedulers to route nothing new here, then wait for what is in flight
    and for the stateful sequences held here to end (the gateways still send their later requests here), at
    most ``drain_s`` or until a second signal. Requests that gateways sent before the new routing reached
    them are served and waited for too; from the end of the drain on, what still arrives gets UNAVAILABLE,
    which the gateway retries on another replica (a sequence's request: the sequence is lost, HTTP 412).
    True when nothing is left."""
    stop.clear()
    await asyncio.gather(*(r.leave() for r in registrars))
    inflight, sequences = servicer.held()
    if inflight or sequences:
        log.info("runtime %s draining: %d request(s) in flight, %d sequence(s) held, waiting up to %.0f s",
                 servicer.replica_id, inflight, sequences, drain_s)  # fmt: skip
    started = time.perf_counter()
    drained = await servicer.drain(drain_s, stop)
    servicer.stopping = True
    if drained:
        if time.perf_counter() - started > 0.05:
            log.info("runtime %s drained in %.1f s", servicer.replica_id, time.perf_counter() - started)
    else:
        inflight, sequences = servicer.held()
        log.warning("runtime %s stops with %d request(s) in flight and %d sequence(s) held (%s)",
                    servicer.replica_id, inflight, sequences,
                    "second signal" if stop.is_set() else f"drain limit {drain_s:.0f} s")  # fmt: skip
    return drained


def main(settings: RuntimeSettings) -> None:
    asyncio.run(serve(settings))
