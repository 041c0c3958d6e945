"""``aiworks kube``: what the Helm chart's hook Job and `helm test` pod run."""

from __future__ import annotations

import argparse
import sys

from aiworks.core.flags import add_gateway_url, add_scheduler_address, add_tls_dir


def add_kube_parser(sub) -> None:
    kube = sub.add_parser("kube", help="the Helm chart's install hook and test (run inside the cluster)")
    actions = kube.add_subparsers(dest="kube_command", metavar="ACTION", required=True)

    es = actions.add_parser(
        "ensure-secrets",
        help="make the release's certificates, first API key and Redis password as Secrets, unless present",
        description=(
            "Run by the chart's pre-install/pre-upgrade hook with the pod's ServiceAccount. Each part is "
            "idempotent: a Secret that exists and fits is kept; certificates within 30 days of expiry, or "
            "missing a name, are reissued by the same CA."
        ),
    )
    es.add_argument("--prefix", required=True, help="the release's full name: Secrets are PREFIX-...")
    es.add_argument(
        "--identity", action="append", default=[], metavar="NAME[=DNS,...]",
        help="issue PREFIX-NAME-tls for this identity, valid for NAME and the DNS names given; repeat",
    )  # fmt: skip
    es.add_argument("--validity-days", type=int, default=365, help="lifetime of issued certificates")
    es.add_argument("--api-key-tenant", help="make PREFIX-api-keys with one key for this tenant")
    es.add_argument("--redis-host", help="make PREFIX-redis with a password for the Redis at HOST:PORT")
    es.add_argument("--internal-token", action="store_true", help="make PREFIX-internal-token (the monitor's API)")
    es.add_argument("--credential-key", action="store_true",
                    help="make PREFIX-credential-key (the tiers' sealed credentials)")  # fmt: skip
    es.add_argument("--label", action="append", default=[], metavar="KEY=VALUE", help="label on made Secrets")
    es.set_defaults(func=cmd_ensure_secrets)

    ck = actions.add_parser(
        "check",
        help="wait until the gateway and every named model are ready (helm test)",
        description="Exit 0 when the gateway's /v2/health/ready answers 200 and the scheduler reports every "
        "--model ready; 1 after --timeout, naming what is not.",
    )
    add_gateway_url(ck, help="gateway URL, http:// or https:// (required)")
    ck.add_argument("--gateway", dest="gateway_url", help=argparse.SUPPRESS)  # its spelling before --gateway-url
    add_scheduler_address(ck, default=None, help="scheduler host:port (required)")
    ck.add_argument("--model", action="append", default=[], help="a model that must be ready; repeat")
    add_tls_dir(ck, "tls.crt, tls.key, ca.crt of the admin identity (mutual TLS)")
    ck.add_argument("--timeout", type=float, default=120.0, help="seconds to wait (default 120)")
    ck.set_defaults(func=cmd_check)


def cmd_ensure_secrets(args) -> None:
    from aiworks.core.errors import AIWorksError
    from aiworks.kube.api import KubeAPI
    from aiworks.kube.secrets import Plan, ensure_secrets

    services = {}
    for entry in args.identity:
        name, _, names = entry.partition("=")
        services[name] = [n for n in names.split(",") if n]
    labels = dict(label.split("=", 1) for label in args.label)
    plan = Plan(
        prefix=args.prefix, services=services, validity_days=args.validity_days,
        api_key_tenant=args.api_key_tenant, redis_host=args.redis_host, labels=labels,
        internal_token=args.internal_token, credential_key=args.credential_key,
    )  # fmt: skip
    try:
        ensure_secrets(KubeAPI.in_cluster(), plan, log=lambda m: print(m, flush=True))
    except AIWorksError as exc:
        raise SystemExit(f"error: {exc}") from None
    print("secrets in place", flush=True)


def cmd_check(args) -> None:
    from aiworks.core.flags import require
    from aiworks.kube.check import check

    require(args, "--gateway-url", "--scheduler-address")
    if not check(args.gateway_url, args.scheduler_address, args.model, tls_dir=args.tls_dir, timeout_s=args.timeout,
                 log=lambda m: print(m, flush=True)):  # fmt: skip
        sys.exit(1)
