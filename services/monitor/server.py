"""Wires the monitor together and runs it: ``aiworks monitor``.

One aiohttp server on ``host:port`` serves the events API, the replicas'
health, ``/healthz`` and ``/metrics`` (one port, as the Helm chart and
docker-compose expect), while the control loop runs as a task beside it.
The routes only translate HTTP to calls on the :class:`EventLog` and the
:class:`Controller`.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from aiworks.core.errors import AIWorksError, InvalidArgument
from aiworks.core.lifecycle import settle_memory, stop_event
from aiworks.core.looplag import start_loop_lag_probe
from aiworks.monitor import events as ev
from aiworks.monitor.collect import Collector, PrometheusCollector, Scraper
from aiworks.monitor.controller import Controller
from aiworks.monitor.discovery import from_static
from aiworks.monitor.events import EventLog
from aiworks.monitor.metrics import MonitorMetrics
from aiworks.monitor.platform import LocalPlatform, Platform, SchedulerEjector
from aiworks.monitor.rollout import RolloutController, RolloutPolicy, parse_steps
from aiworks.monitor.rollout_judge import PrometheusSource, ScrapeSource
from aiworks.monitor.rollout_routes import add_rollout_routes
from aiworks.monitor.rollout_targets import KubernetesTraffic, LocalTraffic
from aiworks.monitor.settings import MonitorSettings
from aiworks.security.callers import CallerAuth, check_control_request, own_caller, read_secrets
from aiworks.security.keyring import watch_internal_token

log = logging.getLogger("aiworks.monitor")

DEFAULT_EVENTS_LIMIT = 100


def build_platform(settings: MonitorSettings) -> Platform:
    ejector = SchedulerEjector(settings.scheduler_address, settings.max_message_bytes)
    if settings.platform == "kubernetes":
        from aiworks.monitor.k8s import KubernetesPlatform

        return KubernetesPlatform(settings.namespace, settings.release, ejector)
    static = from_static(settings.static_services) if settings.static_services and not settings.supervisor_url else None
    return LocalPlatform(settings.supervisor_url, ejector, caller=own_caller(settings, "monitor"), static=static)


def build_collector(settings: MonitorSettings) -> Collector:
    if settings.prometheus_url:
        return PrometheusCollector(settings.prometheus_url, settings.scrape_timeout_s)
    return Scraper(settings.scrape_timeout_s)


def build_rollouts(settings: MonitorSettings, platform: Platform, events: EventLog, audit=None) -> RolloutController:
    """The canary controller (docs/rollouts.md): weights through the scheduler (and Istio on Kubernetes)."""
    scheduler = LocalTraffic(settings.scheduler_address, max_message_bytes=settings.max_message_bytes)
    if settings.platform == "kubernetes":
        target = KubernetesTraffic(settings.namespace, settings.release, scheduler)
    else:
        target = scheduler
    if settings.prometheus_url:
        source = PrometheusSource(
            settings.prometheus_url, settings.scrape_timeout_s, min_range_s=settings.rollout_prometheus_min_range_s
        )
    else:

        async def targets() -> list[str]:
            inventory = await platform.inventory()
            return [
                s.metrics_address for s in inventory.services if s.kind in ("gateway", "scheduler") and s.metrics_address
            ]

        source = ScrapeSource(targets, settings.scrape_timeout_s)
    policy = RolloutPolicy(
        steps=parse_steps(settings.rollout_steps),
        dwell_s=settings.rollout_dwell_s,
        max_error_rate_increase=settings.rollout_max_error_rate_increase,
        max_p99_ratio=settings.rollout_max_p99_ratio,
        min_requests=settings.rollout_min_requests,
        max_extensions=settings.rollout_max_extensions,
        p99_floor_s=settings.rollout_p99_floor_s,
    )

    def emit(kind, target, reason, message, details):
        events.record(kind, target, reason, message, **details)

    return RolloutController(target, source, emit, audit, defaults=policy, interval_s=settings.interval_s)


def _int_param(request: web.Request, name: str, default: int | None) -> int | None:
    raw = request.query.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(f"query parameter {name} must be an integer, not {raw!r}") from None
    if value < 0:
        raise InvalidArgument(f"query parameter {name} must not be negative")
    return value


def _error_response(exc: AIWorksError) -> web.Response:
    headers = {"WWW-Authenticate": 'Bearer realm="aiworks-monitor"'} if exc.status.http == 401 else None
    return web.json_response({"error": exc.message}, status=exc.status.http, headers=headers)


@web.middleware
async def _errors(request: web.Request, handler):
    try:
        return await handler(request)
    except AIWorksError as exc:
        return _error_response(exc)


# Who may change things through the API (docs/security.md): the operator's CLI. Reads stay open.
_ACT = frozenset({"admin"})


def control_guard(auth: CallerAuth | None):
    """Every request but GET and HEAD needs an admin's bearer token, a JSON body and a Content-Length."""

    @web.middleware
    async def guard(request: web.Request, handler):
        if request.method not in ("GET", "HEAD"):
            try:
                check_control_request(
                    auth, request.headers, allowed=_ACT, what=f"{request.method} {request.path}", body=True,
                    closed_hint=" (set AIWORKS_MONITOR_INTERNAL_TOKEN_FILE)",
                )  # fmt: skip
            except AIWorksError as exc:
                return _error_response(exc)
        return await handler(request)

    return guard


def control_auth(settings: MonitorSettings) -> CallerAuth | None:
    """What checks the API's bearer tokens: the token file's secret; ``None`` (closed) without one."""
    secret = None
    if settings.internal_token_file:
        try:
            secret = read_secrets(settings.internal_token_file)
        except AIWorksError as exc:
            raise SystemExit(f"monitor: AIWORKS_MONITOR_INTERNAL_TOKEN_FILE: {exc}") from None
    if secret is None and not settings.insecure:
        return None
    return CallerAuth(secret=secret, insecure=settings.insecure)


def create_app(
    controller: Controller, events: EventLog, metrics: MonitorMetrics, auth: CallerAuth | None = None
) -> web.Application:
    """The HTTP API; see docs/monitor.md. ``auth`` checks the callers of its POST routes (``None``: refused)."""

    async def list_events(request: web.Request) -> web.Response:
        since = _int_param(request, "since", 0)
        limit = _int_param(request, "limit", DEFAULT_EVENTS_LIMIT) or None
        last_id = events.last_id  # read first: events recorded meanwhile are left for the next call
        found = [e for e in events.since(since, kind=request.query.get("kind") or None, limit=limit) if e.id <= last_id]
        # Where to continue: after the last event returned if the page was full, else after everything seen.
        following = found[-1].id if limit and len(found) == limit and since else last_id
        return web.json_response({"events": [e.to_json() for e in found], "last_id": last_id, "next": following})

    async def replicas(request: web.Request) -> web.Response:
        return web.json_response(controller.report())

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "platform": controller.platform.name})

    async def prometheus(request: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(middlewares=[_errors, control_guard(auth)])
    app.router.add_get("/v1/events", list_events)
    app.router.add_get("/v1/replicas", replicas)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", prometheus)
    return app


async def serve(settings: MonitorSettings) -> None:
    stop = stop_event()
    events = EventLog(settings.events_max, settings.events_file)
    metrics = MonitorMetrics(process=True)
    platform = build_platform(settings)
    collector = build_collector(settings)
    controller = Controller(settings, platform, collector, events, metrics=metrics)
    audit_log = None
    audit = None
    if settings.audit_log:
        from aiworks.security.audit import AuditLog

        audit_log = AuditLog(settings.audit_log)
        await audit_log.start()

        def audit(action: str, details: dict) -> None:
            audit_log.admin(
                actor="monitor", action=action, model=details.get("model"), version=details.get("canary"),
                details={k: v for k, v in details.items() if isinstance(v, (str, int, float, bool))},
            )  # fmt: skip

    rollouts = build_rollouts(settings, platform, events, audit)
    auth = control_auth(settings)
    app = create_app(controller, events, metrics, auth)
    add_rollout_routes(app, rollouts)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, settings.host, settings.port).start()
    source = f"Prometheus at {settings.prometheus_url}" if settings.prometheus_url else "each /metrics endpoint"
    if platform.name == "kubernetes":
        where = f" (release {settings.release} in {settings.namespace})"
    else:
        where = (
            f" through {settings.supervisor_url}" if settings.supervisor_url
            else f" ({len(settings.static_services)} static service(s), no supervisor: observing only)"
        )  # fmt: skip
    events.record(
        ev.STARTED, "monitor", "started",
        f"watching the {platform.name} platform{where} every {settings.interval_s:g} s, reading {source}",
        platform=platform.name, scheduler=settings.scheduler_address,
    )  # fmt: skip
    if platform.name == "local" and not settings.supervisor_url and not settings.static_services:
        log.warning("no supervisor URL: nothing is discovered, restarted or scaled (AIWORKS_MONITOR_SUPERVISOR_URL)")
    elif platform.name == "local" and not settings.supervisor_url:
        log.info("no supervisor: watching the static services, restarting and scaling none")
    if auth is not None and auth.insecure:
        log.warning("INSECURE: the monitor's POST routes accept every caller (AIWORKS_MONITOR_INSECURE=true)")
    log.info(
        "monitor serving HTTP on %s:%d (POST routes %s)", settings.host, settings.port,
        "closed: no AIWORKS_MONITOR_INTERNAL_TOKEN_FILE" if auth is None else "need an admin's bearer token",
    )  # fmt: skip
    lag = start_loop_lag_probe("monitor")
    loop_task = asyncio.create_task(controller.run(stop))
    rollout_task = asyncio.create_task(rollouts.run(stop))
    # A rotated internal token, taken without a restart: the API's accepted tokens and the monitor's own.
    token_watch = watch_internal_token(settings, auth, also=[getattr(platform, "caller", None)])
    settle_memory()  # started: what exists now lives as long as the process
    await stop.wait()
    log.info("monitor stopping")
    if token_watch is not None:
        token_watch.cancel()
    lag.stop()
    await loop_task
    await rollout_task
    await rollouts.close()
    if audit_log is not None:
        await audit_log.close()
    await runner.cleanup()
    await collector.close()
    await platform.close()


def main(settings: MonitorSettings) -> None:
    asyncio.run(serve(settings))
