"""The ``aiworks`` command line.

Heavy imports happen inside each command, so ``aiworks --help`` is instant.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path

from aiworks.core.flags import add_scheduler_address, add_settings_flags, add_tls_dir
from aiworks.core.output import add_output_flag

DESCRIPTION = """\
AIWorks: serve ONNX models over the KServe v2 / Open Inference Protocol with
dynamic batching, replica routing and one-command local start-up.

Start here:
  aiworks up                      start the whole suite locally (HTTP :8000, gRPC :8001)
  aiworks bench -m digits         measure throughput and latency against a running suite
  aiworks status                  queues, replicas and their load
"""


def _settings_from(cls, args: argparse.Namespace, fields: list[str]):
    """Build a Settings object; CLI flags given override the environment."""
    from pydantic import ValidationError

    overrides = {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}
    try:
        return cls(**overrides)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
        )
        prefix = cls.model_config.get("env_prefix", "")
        raise SystemExit(f"error: invalid settings ({problems}). Pass the flag or set {prefix}<NAME>.") from None


# ---- service commands ------------------------------------------------------------------------


# Each service command's flags: settings fields, declared once in the service's settings model (name, type,
# description) and turned into flags by add_settings_flags; the same list picks what overrides the environment.
GATEWAY_SETTINGS = "aiworks.gateway.settings:GatewaySettings"
GATEWAY_FLAGS = [
    "host", "http_port", "grpc_port", "metrics_port", "scheduler_address", "cache_address", "max_request_bytes",
    "log_level", "otlp_endpoint", "trace_file",
]  # fmt: skip
SCHEDULER_SETTINGS = "aiworks.scheduler.settings:SchedulerSettings"
SCHEDULER_FLAGS = ["host", "port", "metrics_port", "log_level", "otlp_endpoint", "trace_file"]
RUNTIME_SETTINGS = "aiworks.runtime.settings:RuntimeSettings"
RUNTIME_FLAGS = [
    "host", "port", "metrics_port", "replica_id", "scheduler_address", "model_repository", "models", "device",
    "batching", "log_level", "otlp_endpoint", "trace_file",
]  # fmt: skip
RUNTIME_TRITON_FLAGS = [
    "triton_url", "triton_repository", "triton_metrics_url", "triton_server_path", "triton_grpc_port",
    "triton_instance_kind", "triton_restart_backoff_s", "triton_recover_give_up_s", "memory_budget_bytes",
    "gpu_memory_fraction",
]  # fmt: skip


def _settings_class(path: str):
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def cmd_gateway(args) -> None:
    from aiworks.core.logging import setup_logging
    from aiworks.gateway.server import main

    settings = _settings_from(_settings_class(GATEWAY_SETTINGS), args, GATEWAY_FLAGS)
    setup_logging("gateway", settings.log_level)
    main(settings)


def cmd_scheduler(args) -> None:
    from aiworks.core.logging import setup_logging
    from aiworks.scheduler.server import main

    settings = _settings_from(_settings_class(SCHEDULER_SETTINGS), args, SCHEDULER_FLAGS)
    setup_logging("scheduler", settings.log_level)
    main(settings)


def cmd_runtime(args) -> None:
    from aiworks.core.logging import setup_logging
    from aiworks.runtime.server import main

    settings = _settings_from(_settings_class(RUNTIME_SETTINGS), args, [*RUNTIME_FLAGS, *RUNTIME_TRITON_FLAGS])
    setup_logging(f"runtime[{settings.resolved_replica_id()}]", settings.log_level)
    main(settings)


# ---- user commands ---------------------------------------------------------------------------


def cmd_up(args) -> None:
    from aiworks.core.logging import redact_url
    from aiworks.demo.models import build_demo_repository
    from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s up: %(message)s", datefmt="%H:%M:%S")
    repo = Path(args.model_repository)
    if build_demo_repository(repo, progress=lambda m: print(m, flush=True)):
        print(f"built the demo model repository in {repo}", flush=True)
    config = SuiteConfig(
        model_repository=repo.resolve(),
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        scheduler_port=args.scheduler_port,
        runtime_base_port=args.runtime_base_port,
        replicas=args.replicas,
        batching=not args.no_batching,
        cache=not args.no_cache,
        # From the environment too, so a password need not appear on this command line either.
        redis_url=args.redis_url or os.environ.get("AIWORKS_CACHE_REDIS_URL") or None,
        log_dir=Path(args.log_dir),
        log_level=args.log_level,
        metrics_base_port=args.metrics_base_port,
        monitor=not args.no_monitor,
        monitor_port=args.monitor_port,
        max_replicas=args.max_replicas,
        control_port=args.control_port,
        prometheus=args.prometheus,
        prometheus_port=args.prometheus_port,
        tls=args.tls or bool(args.tls_dir),
        tls_dir=Path(args.tls_dir) if args.tls_dir else None,
        tiers=args.tiers,
    )
    supervisor = Supervisor(config)
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append("SIGTERM"))
    signal.signal(signal.SIGINT, lambda *_: stopping.append("SIGINT"))
    try:
        supervisor.start()
        lines = [
            "",
            "AIWorks is ready.",
            f"  HTTP (KServe v2): {supervisor.http_url}/v2",
            f"  gRPC (KServe v2): {args.host}:{args.grpc_port}" + (" (TLS)" if supervisor.tls_dir else ""),
            f"  scheduler:        {supervisor.scheduler_address}",
        ]
        if supervisor.cache_address:
            store = redact_url(config.redis_url) or "in-process store"
            lines.append(f"  cache:            {supervisor.cache_address} ({store})")
        if supervisor.monitor_url:
            url = supervisor.monitor_url
            lines.append(f"  monitor:          {url} (see `aiworks events --monitor-address {url}`)")
        lines.append(f"  control API:      {supervisor.control_url}/v1/services (bearer token: docs/security.md)")
        lines.append(f"  callers checked:  {supervisor.caller_auth}")
        targets = supervisor.metrics_targets()
        lines.append(
            "  metrics:          " + ", ".join(f"{kind} {' '.join(addrs)}" for kind, addrs in sorted(targets.items()))
        )
        if config.tiers:
            lines.append(f"  tiers:            {supervisor.http_url}/v1/batches, POST …/infer with "
                         f"Prefer: respond-async, /v2/streams/NAME (files in {supervisor.batch_files})")  # fmt: skip
        if supervisor.prometheus is not None:
            lines.append(f"  Prometheus:       {supervisor.prometheus.url}")
        lines.append("  logs:             " + ", ".join(str(c.log_path) for c in supervisor.children))
        if supervisor.tls_dir:
            lines += _tls_hints(supervisor, args.grpc_port)
        else:
            lines += _token_hints(supervisor)
        lines.append("Press Ctrl-C to stop.")
        print("\n".join(lines), flush=True)
        supervisor.watch(lambda: bool(stopping))
        if supervisor.stop_requested and not stopping:
            stopping.append("control API")
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        supervisor.stop()
        raise SystemExit(1) from None
    finally:
        if stopping or sys.exc_info()[0] is KeyboardInterrupt:
            print(f"stopping ({stopping[0] if stopping else 'interrupt'})...", flush=True)
        supervisor.stop()
    print("stopped.", flush=True)


def _token_hints(supervisor) -> list[str]:
    """How the tools reach the internal services: as admin, with the installation's token file."""
    from aiworks.security.callers import DEFAULT_TOKEN_FILE, TOKEN_FILE_ENV

    if supervisor.token_file == DEFAULT_TOKEN_FILE.resolve():
        return ["The tools (aiworks status, traffic, rollout) run from this folder use .aiworks/internal-token."]
    return [f"The tools need its token file: export {TOKEN_FILE_ENV}={supervisor.token_file}"]


def _tls_hints(supervisor, grpc_port: int) -> list[str]:
    """How to call a suite started with --tls: the CA to trust, and the admin certificate for the tools."""
    certs = supervisor.tls_dir
    try:
        certs = certs.relative_to(Path.cwd())
    except ValueError:
        pass
    admin = certs / "admin" if (supervisor.tls_dir / "admin").is_dir() else certs  # a --tls-dir of your own
    host = supervisor.reach_host
    http = supervisor.http_url.removeprefix("https://")
    return [
        f"  TLS:              mutual TLS between the services; certificates in {certs} (CA {certs}/ca.crt)",
        "Call it over TLS:",
        f"  curl --cacert {certs}/ca.crt {supervisor.http_url}/v2/health/ready",
        f'  tritonclient.http.InferenceServerClient("{http}", ssl=True, ssl_options={{"ca_certs": "{certs}/ca.crt"}})',
        f'  tritonclient.grpc.InferenceServerClient("{host}:{grpc_port}", ssl=True, root_certificates="{certs}/ca.crt")',
        f"  aiworks status --tls-dir {admin} --scheduler-address {supervisor.scheduler_address}",
        f"  aiworks traffic --tls-dir {admin} --scheduler-address {supervisor.scheduler_address} get digits",
    ]


def cmd_demo_models(args) -> None:
    from aiworks.demo.models import build_demo_repository

    built = build_demo_repository(Path(args.out), force=args.force, progress=lambda m: print(m, flush=True))
    print(f"demo model repository {'built in' if built else 'already present at'} {args.out}")
    if args.qa_streaming:
        from aiworks.demo.qa_streaming import build_qa_streaming_models

        names = [p.name for p in build_qa_streaming_models(Path(args.out))]
        print(f"streaming and stateful QA models written to {args.out}: {', '.join(names)} (docs/sequences.md)")
    if args.qa:
        from aiworks.demo.triton_qa import build_triton_qa_models

        names = [p.name for p in build_triton_qa_models(Path(args.out))]
        print(f"Triton's example models written to {args.out}: {', '.join(names)} (docs/triton.md)")


def cmd_status(args) -> None:
    from aiworks.status import show_status

    redis_url = args.redis_url
    if not redis_url:  # run from the folder of `aiworks up --tiers`: its Redis, as the tools find its token
        from aiworks.supervisor.supervisor import local_tiers_redis_url

        redis_url = local_tiers_redis_url()
    show_status(args.scheduler_address, args.tls_dir, args.output, redis_url)


def cmd_bench(args) -> None:
    from aiworks.bench.loadgen import run_cli

    run_cli(args)


# ---- parser ----------------------------------------------------------------------------------


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aiworks")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser(command: str = "") -> argparse.ArgumentParser:
    """The ``aiworks`` parser. A service command's flags come from its settings model, which costs an import (and
    needs that service's packages): only ``command``'s are added, the one :func:`main` sees on the command line."""

    def settings_flags(name: str) -> bool:
        return command == name

    parser = argparse.ArgumentParser(
        prog="aiworks", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    up = sub.add_parser(
        "up",
        help="start the scheduler, runtime replicas, gateway, cache and monitor as local processes",
        description=(
            "Start the suite as local processes and wait until it is ready; Ctrl-C stops it. The monitor restarts "
            "services that die, scales runtimes between --replicas and --max-replicas and ejects failing replicas "
            "(`aiworks events` lists what it did; --no-monitor leaves it out)."
        ),
    )
    up.add_argument("--http-port", type=int, default=8000, help="gateway HTTP port (default 8000)")
    up.add_argument("--grpc-port", type=int, default=8001, help="gateway gRPC port (default 8001)")
    up.add_argument("--scheduler-port", type=int, default=8010, help="scheduler gRPC port; 0 picks a free one")
    up.add_argument(
        "--runtime-base-port", type=int, default=8020, help="first runtime port (one per replica); 0 picks free ones"
    )
    up.add_argument(
        "--replicas", type=int, default=2, help="runtime replicas to start, and the fewest kept (default 2)"
    )
    up.add_argument(
        "--max-replicas", type=int, default=4, help="most runtime replicas the monitor scales out to (default 4)"
    )
    up.add_argument("--host", default="127.0.0.1", help="interface every service binds (default 127.0.0.1)")
    up.add_argument(
        "--model-repository",
        default="model-repository",
        help="Triton-layout model repository; the demo models are built there if it is missing or empty",
    )
    up.add_argument("--no-batching", action="store_true", help="send every request as its own batch")
    up.add_argument(
        "--redis-url",
        help="result cache on this Redis (redis://host:port/db; default $AIWORKS_CACHE_REDIS_URL, which keeps a "
        "password out of ps); unset: in-process store",
    )
    up.add_argument("--no-cache", action="store_true", help="start no cache service")
    up.add_argument(
        "--tiers",
        action="store_true",
        help="also the nearline and offline tiers (needs --redis-url): the Batch API, asynchronous requests and "
        "result streams on the gateway, one batch runner, one nearline worker (docs/tiers.md)",
    )
    up.add_argument(
        "--no-monitor", action="store_true", help="start no monitor (no restarts, autoscaling or ejection)"
    )
    up.add_argument("--monitor-port", type=int, default=8040, help="monitor's events API and /metrics (default 8040)")
    up.add_argument(
        "--metrics-base-port",
        type=int,
        default=8100,
        help="metrics ports: gateway +0, scheduler +1, cache +2, batch runner +5, nearline worker +6, runtime-i "
        "+10+i (default 8100); 0 picks free ones",
    )
    up.add_argument(
        "--control-port", type=int, default=8050, help="supervisor's control API on 127.0.0.1 (default 8050); 0: free"
    )
    up.add_argument(
        "--prometheus", action="store_true", help="also run a local Prometheus that scrapes every service"
    )
    up.add_argument("--prometheus-port", type=int, default=9090, help="port of that Prometheus (default 9090)")
    up.add_argument("--log-dir", default=".aiworks/logs", help="folder for each service's log file")
    up.add_argument(
        "--tls",
        action="store_true",
        help="mutual TLS between the services and TLS on the gateway's ports; certificates in .aiworks/certs",
    )
    up.add_argument(
        "--tls-dir",
        help="certificates for --tls: used as they are if the folder has one per service, else written there",
    )
    up.add_argument("--log-level", default="INFO", help="log level of every service")
    up.set_defaults(func=cmd_up)

    gw = sub.add_parser("gateway", help="run one gateway (env AIWORKS_GATEWAY_*)")
    if settings_flags("gateway"):
        add_settings_flags(gw, GATEWAY_SETTINGS, GATEWAY_FLAGS)
    gw.set_defaults(func=cmd_gateway)

    sc = sub.add_parser("scheduler", help="run the scheduler (env AIWORKS_SCHEDULER_*)")
    if settings_flags("scheduler"):
        add_settings_flags(sc, SCHEDULER_SETTINGS, SCHEDULER_FLAGS)
    sc.set_defaults(func=cmd_scheduler)

    rt = sub.add_parser("runtime", help="run one model-runtime replica (env AIWORKS_RUNTIME_*)")
    if settings_flags("runtime"):
        add_settings_flags(rt, RUNTIME_SETTINGS, RUNTIME_FLAGS)
        add_settings_flags(rt.add_argument_group("Triton and GPU"), RUNTIME_SETTINGS, RUNTIME_TRITON_FLAGS)
    rt.set_defaults(func=cmd_runtime)

    st = sub.add_parser("status", help="show queues, replicas and their load")
    add_scheduler_address(st)
    add_tls_dir(st)
    add_output_flag(st)
    st.add_argument(
        "--redis-url", default=os.environ.get("AIWORKS_BATCH_REDIS_URL"),
        help="also show batch jobs not yet ended and the async backlog from this Redis (env AIWORKS_BATCH_REDIS_URL; "
        "default: the one `aiworks up --tiers` run from this folder uses)",
    )  # fmt: skip
    st.set_defaults(func=cmd_status)

    dm = sub.add_parser("demo-models", help="build the demo model repository (iris, digits v1 and v2)")
    dm.add_argument("--out", default="model-repository")
    dm.add_argument("--force", action="store_true", help="rebuild even if it exists")
    dm.add_argument(
        "--qa-streaming", action="store_true",
        help="also write the streaming and stateful QA models (repeat_int32, simple_sequence, ...; docs/sequences.md)",
    )  # fmt: skip
    dm.add_argument(
        "--qa", action="store_true",
        help="also write Triton's example models (simple, simple_int8, simple_string, simple_identity, "
        "densenet_onnx; docs/triton.md)",
    )  # fmt: skip
    dm.set_defaults(func=cmd_demo_models)

    from aiworks.bench.options import add_bench_parser
    from aiworks.cache.cli import add_cache_parser
    from aiworks.kube.cli import add_kube_parser
    from aiworks.lifecycle.cli import add_lifecycle_parsers
    from aiworks.monitor.cli import add_monitor_parsers
    from aiworks.rollout_cli import add_rollout_parser
    from aiworks.security.cli import add_security_parsers
    from aiworks.storage.cli import add_storage_parser
    from aiworks.traffic_cli import add_traffic_parser

    add_bench_parser(sub).set_defaults(func=cmd_bench)
    add_cache_parser(sub, settings_flags=settings_flags("cache"))
    add_traffic_parser(sub)
    add_rollout_parser(sub)
    add_lifecycle_parsers(sub)
    add_monitor_parsers(sub, settings_flags=settings_flags("monitor"))
    add_security_parsers(sub)
    add_storage_parser(sub)
    add_kube_parser(sub)
    from aiworks.gateway.cli import add_tenancy_parsers
    add_tenancy_parsers(sub)
    from aiworks.probe import add_probe_parser
    add_probe_parser(sub)
    from aiworks.batch.cli import add_batch_parser
    add_batch_parser(sub)
    from aiworks.nearline.cli import add_nearline_parser
    add_nearline_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    try:
        parser = build_parser(next((a for a in argv if not a.startswith("-")), ""))  # the command, if any
        args = parser.parse_args(argv)
        if args.command is None:  # a bare `aiworks`: what it can do
            parser.print_help()
            return
        args.func(args)
    except BrokenPipeError:  # `aiworks … | head`: the reader left, which is no error of ours to print
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit, flushing what is left
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
