"""``aiworks probe SERVICE``: is the service of this container or pod serving? (healthchecks, exec probes)

It reads the service's own settings from the environment (``AIWORKS_<SVC>_*``),
as the service itself does, and asks it on loopback the way a peer would: the
scheduler, runtime and cache through ``grpc.health.v1``, over mutual TLS with
the service's own certificate when TLS is set (a plain probe cannot pass the
handshake); the gateway through ``/v2/health/ready`` (HTTPS when it has a
certificate; the chain is checked against its CA, not the name, since the
probe dials 127.0.0.1 itself); the monitor through ``/healthz``; the batch
runner and the nearline worker (the tiers image) through their ``/metrics``,
on ``AIWORKS_BATCH_METRICS_PORT`` / ``AIWORKS_NEARLINE_METRICS_PORT``: they
serve nothing else, so this says the process is up, not that its jobs move.

Exit status 0: serving; 1: not serving or unreachable, with the reason on stderr.
"""

from __future__ import annotations

import os
import ssl
import sys
import urllib.request

from pydantic import ValidationError

GRPC_SERVICES = ("scheduler", "runtime", "cache")
# The tiers' processes: their /metrics port's variable (the tiers image sets both).
TIER_PORTS = {"batch-runner": "AIWORKS_BATCH_METRICS_PORT", "nearline-worker": "AIWORKS_NEARLINE_METRICS_PORT"}
SERVICES = (*GRPC_SERVICES, "gateway", "monitor", *TIER_PORTS)


def _settings(service: str):
    if service == "scheduler":
        from aiworks.scheduler.settings import SchedulerSettings as cls
    elif service == "runtime":
        from aiworks.runtime.settings import RuntimeSettings as cls
    elif service == "cache":
        from aiworks.cache.settings import CacheSettings as cls
    elif service == "gateway":
        from aiworks.gateway.settings import GatewaySettings as cls
    else:
        from aiworks.monitor.settings import MonitorSettings as cls
    return cls()


def probe(service: str, timeout_s: float = 3.0) -> str:
    """What the service answered (``SERVING``, ``200``); raises on anything but serving."""
    if service in TIER_PORTS:
        port = int(os.environ.get(TIER_PORTS[service]) or 0)
        if not port:
            raise RuntimeError(f"{TIER_PORTS[service]} is not set: {service} serves no /metrics to ask")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout_s) as resp:
            return str(resp.status)
    settings = _settings(service)
    if service in GRPC_SERVICES:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from aiworks.core.rpc import blocking_channel

        with blocking_channel(f"127.0.0.1:{settings.port}", settings.tls_files(), server_name=service) as ch:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            raise RuntimeError(f"{service} says {status}")
        return status
    context = None
    if service == "gateway":
        files = settings.tls_files(mutual=False)
        scheme = "https" if files else "http"
        if files:
            context = ssl.create_default_context(cafile=str(files.ca) if files.ca else None)
            context.check_hostname = False  # 127.0.0.1 is dialled on purpose; the chain is still verified
        url = f"{scheme}://127.0.0.1:{settings.http_port}/v2/health/ready"
    else:
        url = f"http://127.0.0.1:{settings.port}/healthz"
    with urllib.request.urlopen(url, timeout=timeout_s, context=context) as resp:
        return str(resp.status)


def cmd_probe(args) -> None:
    try:
        answer = probe(args.service, args.timeout_s)
    except ValidationError as exc:
        print(f"{args.service} is not configured: {exc.errors()[0]['msg']}", file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as exc:  # any failure is "not healthy", said in one line
        why = f"{exc.code().name}: {exc.details()}" if hasattr(exc, "details") else f"{type(exc).__name__}: {exc}"
        print(f"{args.service} is not serving: {why}", file=sys.stderr)
        raise SystemExit(1) from None
    if not args.quiet:
        print(f"{args.service}: {answer}")


def add_probe_parser(sub) -> None:
    """Add ``aiworks probe`` to the ``aiworks`` subparsers."""
    p = sub.add_parser(
        "probe",
        help="check that the service configured by this environment serves (container healthchecks)",
        description=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("service", choices=SERVICES)
    p.add_argument("--timeout-s", type=float, default=3.0, help="how long to wait for the answer (default 3)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing when serving")
    p.set_defaults(func=cmd_probe)
