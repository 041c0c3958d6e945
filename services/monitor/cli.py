"""``aiworks monitor`` (run the monitor) and ``aiworks events`` (read what it did).

``aiworks.cli`` adds both with ``add_monitor_parsers(sub)``; flags given
override the ``AIWORKS_MONITOR_`` environment, as for every service. The
events command is a small HTTP client of a running monitor, so it works the
same against ``aiworks up``, a container or a port-forwarded pod; an
``https://`` monitor URL is verified with the CA of ``--tls-dir`` (or
``$AIWORKS_TLS_DIR``), whose certificate it also presents.
"""

from __future__ import annotations

import argparse
import json
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

from aiworks.core.flags import add_monitor_address, add_tls_dir
from aiworks.core.output import add_output_flag

SETTINGS = "aiworks.monitor.settings:MonitorSettings"
FLAGS = [
    "host", "port", "platform", "supervisor_url", "scheduler_address", "prometheus_url", "namespace", "release",
    "interval_s", "events_file", "min_replicas", "max_replicas", "log_level",
]  # fmt: skip

DEFAULT_MONITOR_URL = "http://127.0.0.1:8040"

MONITOR_HELP = """\
Watch the suite and act on what it sees: restart services that died, scale
runtime replicas out on sustained queue depth or p99 latency and back in when
quiet, ask the scheduler to eject replicas that keep failing, and report
anomalies against each replica's learned baseline (latency spike, error
surge, steady memory growth). Every action is an event (see `aiworks events`).

`aiworks up` starts one for you. Every flag has an AIWORKS_MONITOR_<FLAG>
variable; thresholds and cool-downs are variables only (docs/monitor.md).

HTTP API on --port: GET /v1/events, GET /v1/replicas, GET /healthz, GET /metrics.
"""

EVENTS_HELP = """\
List the events of a running monitor: restarts, scaling, ejections and
anomalies, oldest first, each with its time, target and reason.

examples:
  aiworks events                          the last 50 events of the local suite's monitor
  aiworks events --kind restart           restarts only
  aiworks events --follow                 keep printing new events until Ctrl-C
  aiworks events -o json | jq .details    one JSON object per line (-o yaml: one document each)
  aiworks events --monitor-address https://monitor.example:8040 --tls-dir certs/admin
"""


def cmd_monitor(args: argparse.Namespace) -> None:
    from aiworks.cli import _settings_from
    from aiworks.core.logging import setup_logging
    from aiworks.core.rpc import use_process_caller, use_process_tls
    from aiworks.monitor.server import main
    from aiworks.monitor.settings import MonitorSettings
    from aiworks.security.callers import own_caller

    settings = _settings_from(MonitorSettings, args, FLAGS)
    setup_logging("monitor", settings.log_level)
    use_process_tls(settings.tls_files())  # its calls to the scheduler use mutual TLS when set
    use_process_caller(own_caller(settings, "monitor"))  # or, over plaintext, its token
    main(settings)


def fetch_events(
    monitor_url: str,
    since: int = 0,
    kind: str | None = None,
    limit: int | None = None,
    context: ssl.SSLContext | None = None,
) -> dict:
    """``GET /v1/events`` of the monitor at ``monitor_url`` (``context`` for an https URL)."""
    query = {"since": since}
    if kind:
        query["kind"] = kind
    if limit is not None:
        query["limit"] = limit
    url = f"{monitor_url.rstrip('/')}/v1/events?{urllib.parse.urlencode(query)}"
    with urllib.request.urlopen(url, timeout=5, context=context) as resp:
        return json.load(resp)


def _tls_context(tls_dir: str | None) -> ssl.SSLContext | None:
    from aiworks.core.errors import AIWorksError
    from aiworks.security.tls import client_ssl_context, tool_tls

    try:
        files = tool_tls(tls_dir)
        return client_ssl_context(files) if files else None
    except AIWorksError as exc:
        raise SystemExit(f"error: {exc}") from None


# The --follow loop's pause. Tests replace this name, never time.sleep: every thread in the process shares that one.
_pause = time.sleep


def format_event(event: dict) -> str:
    return f"{event['time']}  {event['kind']:<15} {event['target']:<16} {event['reason']:<14} {event['message']}"


def _print(event: dict, output: str) -> None:
    from aiworks.core.output import emit_record

    emit_record(event, output, lambda: format_event(event))


def cmd_events(args: argparse.Namespace) -> None:
    monitor = args.monitor_address
    context = _tls_context(args.tls_dir) if monitor.startswith("https://") else None
    try:
        doc = fetch_events(monitor, kind=args.kind, limit=args.limit, context=context)
    except (urllib.error.URLError, OSError) as exc:
        raise SystemExit(f"error: cannot reach the monitor at {monitor}: {exc}") from None
    for event in doc["events"]:
        _print(event, args.output)
    if not args.follow:
        if not doc["events"] and args.output == "table":
            print("no events yet", file=sys.stderr)
        return
    cursor = doc["last_id"]
    warned = False
    try:
        while True:
            _pause(args.interval_s)
            try:
                doc = fetch_events(monitor, since=cursor, kind=args.kind, context=context)
            except (urllib.error.URLError, OSError) as exc:
                if not warned:
                    print(f"monitor unreachable ({exc}); retrying", file=sys.stderr, flush=True)
                    warned = True
                continue
            warned = False
            for event in doc["events"]:
                _print(event, args.output)
            cursor = doc["next"]
    except KeyboardInterrupt:
        pass


def add_monitor_parsers(sub, settings_flags: bool = True) -> None:
    """Add the ``monitor`` and ``events`` commands to the ``aiworks`` subparsers. ``monitor``'s flags are the
    settings fields in :data:`FLAGS` (``settings_flags=False`` leaves them out: ``aiworks --help`` need not
    import them)."""
    p = sub.add_parser(
        "monitor",
        help="run the monitor: restarts, autoscaling, ejection, anomalies (env AIWORKS_MONITOR_*)",
        description=MONITOR_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    if settings_flags:
        from aiworks.core.flags import add_settings_flags

        add_settings_flags(p, SETTINGS, FLAGS)
    p.set_defaults(func=cmd_monitor)

    e = sub.add_parser(
        "events",
        help="list what the monitor did and saw (restarts, scaling, ejections, anomalies)",
        description=EVENTS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_monitor_address(e, DEFAULT_MONITOR_URL)
    e.add_argument("--kind", help="only events of this kind: restart, scale_out, scale_in, eject, anomaly, ...")
    e.add_argument("--limit", type=int, default=50, help="show at most the newest N events at first (default 50)")
    e.add_argument("-f", "--follow", action="store_true", help="keep printing new events until Ctrl-C")
    add_output_flag(e)  # json: one object per event and line; yaml: one document per event
    e.add_argument("--interval-s", type=float, default=1.0, help="polling interval of --follow (default 1 s)")
    add_tls_dir(e, "tls.crt, tls.key and ca.crt for an https:// monitor URL (default $AIWORKS_TLS_DIR)")
    e.set_defaults(func=cmd_events)
