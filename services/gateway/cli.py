"""``aiworks usage`` and ``aiworks tenants``: metered usage and API keys (docs/tenancy.md).

    aiworks usage                                      the last 24 h, from the gateway at 127.0.0.1:8000
    aiworks usage --start 2026-01-01 --end 2026-02-01 --tenant acme -o json
    aiworks usage --redis-url redis://127.0.0.1:6379/0 read the shared Redis directly (every replica's usage)
    aiworks tenants add-key research --label notebook  print a new key once; store only its hash

Through the gateway a tenant sees its own usage and an admin tenant anyone's;
the API key comes from ``$AIWORKS_API_KEY`` or ``--api-key-file``, never
from the command line, where other users could read it. Reading Redis
directly needs no key: whoever can reach that Redis is an operator.

Heavy imports happen inside the commands, so ``aiworks --help`` stays fast.
This module is the gateway's face for tools (with ``settings``): they import
nothing else from the gateway.
"""

from __future__ import annotations

import os
import sys

from aiworks.core.flags import add_gateway_url, add_tls_dir, ca_file
from aiworks.core.output import add_output_flag

API_KEY_ENV = "AIWORKS_API_KEY"
KEYS_FILE_ENV = "AIWORKS_GATEWAY_API_KEYS_FILE"
TENANTS_FILE_ENV = "AIWORKS_GATEWAY_TENANTS_FILE"
_COLUMNS = ("requests", "rows", "compute_seconds", "cache_hits", "prompt_tokens", "completion_tokens")


def add_tenancy_parsers(sub) -> None:
    """Add ``usage`` and ``tenants`` to the ``aiworks`` command's subparsers."""
    us = sub.add_parser(
        "usage",
        help="usage per tenant and model (requests, rows, compute seconds, cache hits)",
        description=(
            "Usage in whole windows (the gateway's AIWORKS_GATEWAY_USAGE_WINDOW_S, 1 h by default), from a "
            f"gateway's GET /v2/usage (API key from ${API_KEY_ENV} or --api-key-file) or, with --redis-url, "
            "straight from the Redis the gateways share. Times are ISO 8601 (no zone: UTC) or epoch seconds."
        ),
    )
    add_gateway_url(us, default="http://127.0.0.1:8000")
    us.add_argument("--api-key-file", help=f"file holding the API key (default: ${API_KEY_ENV})")
    add_tls_dir(us, "folder whose ca.crt signs the gateway's certificate (https:// URLs)", cacert=True)
    us.add_argument("--redis-url", help="read the usage from this Redis instead of a gateway")
    us.add_argument("--window-s", type=int, default=3600, help="usage window of the gateways (with --redis-url)")
    us.add_argument("--start", help="from (default: 24 h before --end)")
    us.add_argument("--end", help="until (default: now)")
    us.add_argument("--tenant", help="one tenant only (a non-admin tenant always sees only its own)")
    us.add_argument("--model", help="one model only")
    us.add_argument("--windows", action="store_true", help="one row per window instead of totals")
    add_output_flag(us)
    us.set_defaults(func=run_usage)

    tn = sub.add_parser("tenants", help="manage tenants' API keys")
    actions = tn.add_subparsers(dest="tenants_action", metavar="ACTION", required=True)
    ak = actions.add_parser(
        "add-key",
        help="create an API key for a tenant: print it once, append only its hash to the API keys file",
        description=(
            "The key goes to standard output (KEY=$(aiworks tenants add-key acme)); its SHA-256 is appended to "
            "the API keys file, rewritten atomically with mode 0600. Gateways read the file at start."
        ),
    )
    ak.add_argument("tenant", help="tenant id, as in the tenants file")
    ak.add_argument("--api-keys-file", help=f"API keys file (default: ${KEYS_FILE_ENV})")
    ak.add_argument("--tenants-file", help=f"check the tenant exists here (default: ${TENANTS_FILE_ENV}, if set)")
    ak.add_argument("--label", default="", help="a note for people, e.g. who holds the key")
    ak.set_defaults(func=run_add_key)


# ---- usage ---------------------------------------------------------------------------------------


def run_usage(args) -> None:
    from aiworks.core.errors import AIWorksError

    try:
        report = _usage_from_redis(args) if args.redis_url else _usage_from_gateway(args)
    except AIWorksError as exc:
        raise SystemExit(f"error: {exc}") from None
    from aiworks.core.output import emit

    emit(report, args.output, lambda: format_report(report, per_window=args.windows))


def _usage_from_redis(args) -> dict:
    import asyncio
    import time

    from aiworks.core.logging import redact_url
    from aiworks.gateway.metering import DEFAULT_USAGE_SPAN_S, UsageMeter, parse_time

    end = parse_time(args.end, "end") if args.end else time.time()
    start = parse_time(args.start, "start") if args.start else end - DEFAULT_USAGE_SPAN_S

    async def read() -> dict:
        meter = UsageMeter(args.redis_url, window_s=args.window_s, timeout_s=2.0)
        try:
            report = await meter.report(start, end, tenant=args.tenant, model=args.model)
        finally:
            await meter.close()
        if report.source != "redis":
            raise SystemExit(f"error: Redis at {redact_url(args.redis_url)} did not answer")
        return report.to_dict()

    return asyncio.run(read())


def _read_api_key(args) -> str | None:
    if args.api_key_file:
        try:
            with open(args.api_key_file) as f:
                return f.read().strip() or None
        except OSError as exc:
            raise SystemExit(f"error: API key file {args.api_key_file}: {exc.strerror}") from None
    return os.environ.get(API_KEY_ENV) or None


def _usage_from_gateway(args) -> dict:
    import json
    import ssl
    import urllib.error
    import urllib.parse
    import urllib.request

    query = {k: v for k in ("start", "end", "tenant", "model") if (v := getattr(args, k))}
    url = f"{args.gateway_url.rstrip('/')}/v2/usage" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    headers = {"accept": "application/json"}
    key = _read_api_key(args)
    if key:
        headers["authorization"] = f"Bearer {key}"
    ca = ca_file(args)
    context = ssl.create_default_context(cafile=str(ca)) if ca else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30, context=context) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as exc:
        try:
            message = json.loads(exc.read()).get("error", exc.reason)
        except ValueError:
            message = exc.reason
        hint = f" (set ${API_KEY_ENV} or pass --api-key-file)" if exc.code == 401 and not key else ""
        raise SystemExit(f"error: {url} answered {exc.code}: {message}{hint}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise SystemExit(f"error: cannot reach {args.gateway_url}: {getattr(exc, 'reason', exc)}") from None


def format_report(report: dict, *, per_window: bool = False) -> str:
    """The report as a table: totals per tenant and model, or one row per window."""
    rows = report["usage"] if per_window else report["totals"]
    head = (
        f"usage {report['start']} .. {report['end']} (windows of {report['window_s']:g} s, source {report['source']})"
    )
    if not rows:
        return head + "\nno usage in this period"
    names = (["window_start"] if per_window else []) + ["tenant", "model", *_COLUMNS]
    table = [names]
    for r in rows:
        cells = [r["window_start"]] if per_window else []
        cells += [r["tenant"] or '""', r["model"], str(r["requests"]), str(r["rows"])]
        cells += [f"{r['compute_seconds']:.3f}", str(r["cache_hits"])]
        cells += [str(r.get("prompt_tokens", 0)), str(r.get("completion_tokens", 0))]  # 0 from an older gateway
        table.append(cells)
    widths = [max(len(row[i]) for row in table) for i in range(len(names))]
    numeric = set(range(len(names) - len(_COLUMNS), len(names)))
    lines = [
        "  ".join(cell.rjust(w) if i in numeric else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
        for row in table
    ]
    return "\n".join([head, *lines])


# ---- API keys ------------------------------------------------------------------------------------


def run_add_key(args) -> None:
    from aiworks.core.errors import AIWorksError
    from aiworks.gateway.auth import add_api_key

    keys_file = args.api_keys_file or os.environ.get(KEYS_FILE_ENV)
    if not keys_file:
        raise SystemExit(f"error: name the API keys file: --api-keys-file or ${KEYS_FILE_ENV}")
    tenants_file = args.tenants_file or os.environ.get(TENANTS_FILE_ENV) or None
    try:
        key = add_api_key(keys_file, args.tenant, args.label, tenants_file=tenants_file)
    except AIWorksError as exc:
        raise SystemExit(f"error: {exc}") from None
    except OSError as exc:
        raise SystemExit(f"error: API keys file {keys_file}: {exc.strerror or exc}") from None
    print(
        f"API key for tenant '{args.tenant}' (shown once; only its hash is stored in {keys_file}). "
        "Gateways read the file at start: restart them to accept the key.",
        file=sys.stderr,
    )
    print(key)


def new_api_key() -> tuple[str, str]:
    """A new API key and its stored form (``sha256:<hex>``), for tools that provision keys (``aiworks kube``)."""
    from aiworks.gateway.auth import generate_api_key

    return generate_api_key()
