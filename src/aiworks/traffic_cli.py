"""``aiworks traffic``: set and read a model's version weights (canary releases) and shadow version.

    aiworks traffic set digits 1=90 2=10     90% of requests without a version to v1, 10% to v2
    aiworks traffic set digits --clear       back to the latest version
    aiworks traffic set digits --shadow 2    mirror every request to v2, compare, discard its answers
    aiworks traffic set digits --shadow 2 --shadow-fraction 0.1 --shadow-compare argmax
    aiworks traffic set digits --no-shadow   stop mirroring
    aiworks traffic get digits
    aiworks traffic show digits              the policy and the shadow's agreement counts
    aiworks traffic --tls-dir .aiworks/certs/admin get digits     against `aiworks up --tls`
    aiworks traffic get digits -o json       (or -o yaml) for scripts

Heavy imports happen inside the command, so ``aiworks --help`` stays fast.
"""

from __future__ import annotations

import argparse

from aiworks.core.flags import add_scheduler_address, add_tls_dir
from aiworks.core.output import add_output_flag


def add_traffic_parser(sub) -> argparse.ArgumentParser:
    """Add ``traffic set`` and ``traffic get`` to the ``aiworks`` command's subparsers."""
    p = sub.add_parser(
        "traffic",
        help="set or show a model's version weights (canary releases)",
        description=(
            "Weights apply to requests that name no version: each version gets weight/sum of them. "
            "A version without a live replica is skipped and the others share its part."
        ),
    )
    add_scheduler_address(p)
    add_tls_dir(p)
    actions = p.add_subparsers(dest="traffic_action", metavar="ACTION", required=True)
    set_ = actions.add_parser(
        "set",
        help="set version weights, e.g. `aiworks traffic set digits 1=90 2=10`, or a shadow version",
        description=(
            "Weights and shadow are set independently: weights alone keep the shadow in force, "
            "--shadow or --no-shadow alone keep the weights."
        ),
    )
    set_.add_argument("model")
    set_.add_argument("weights", nargs="*", metavar="VERSION=WEIGHT")
    set_.add_argument("--clear", action="store_true", help="remove the weights: the latest version serves")
    set_.add_argument(
        "--shadow", metavar="VERSION", help="mirror live requests to VERSION; its answers are compared, then discarded"
    )
    set_.add_argument("--shadow-fraction", type=float, default=1.0, help="share of requests mirrored (default 1)")
    set_.add_argument(
        "--shadow-compare",
        choices=["allclose", "argmax"],
        default="allclose",
        help="allclose: floats within the tolerance, others exactly (default); argmax: per-row class decisions",
    )
    set_.add_argument("--shadow-tolerance", type=float, default=1e-4, help="rtol and atol of allclose (default 1e-4)")
    set_.add_argument("--no-shadow", action="store_true", help="stop mirroring to the shadow version")
    add_output_flag(set_)
    get = actions.add_parser("get", help="show a model's version weights and shadow")
    get.add_argument("model")
    add_output_flag(get)
    show = actions.add_parser("show", help="show a model's policy and its shadow's comparison counts")
    show.add_argument("model")
    add_output_flag(show)
    p.set_defaults(func=run_traffic)
    return p


def run_traffic(args) -> None:
    import grpc

    from aiworks.core.errors import AIWorksError
    from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
    from aiworks.scheduler.client import BlockingSchedulerClient
    from aiworks.security.callers import tool_caller
    from aiworks.security.tls import tool_tls
    from aiworks.status import rpc_hint

    if args.traffic_action == "set":
        if args.weights and args.clear:
            raise SystemExit("error: give VERSION=WEIGHT terms (for example 1=90 2=10) or --clear, not both")
        if args.shadow and args.no_shadow:
            raise SystemExit("error: give --shadow VERSION or --no-shadow, not both")
        if not (args.weights or args.clear or args.shadow or args.no_shadow):
            raise SystemExit(
                "error: give VERSION=WEIGHT terms (for example 1=90 2=10), --clear, --shadow or --no-shadow"
            )
        weights = {}
        for term in args.weights:
            version, sep, weight = term.partition("=")
            if not sep or not version or not weight.isdigit():
                raise SystemExit(f"error: '{term}' is not VERSION=WEIGHT (for example 1=90)")
            weights[version] = int(weight)
    try:
        tls = tool_tls(args.tls_dir)
        caller = None if tls else tool_caller()
    except AIWorksError as exc:
        raise SystemExit(f"error: {exc}") from None
    try:
        with BlockingSchedulerClient(args.scheduler_address, tls, caller) as scheduler:
            if args.traffic_action == "set":
                if not (args.weights or args.clear):  # a shadow change keeps the weights in force
                    current = scheduler.get_traffic(args.model)
                    weights = dict(current.weights)
                policy = pb.TrafficPolicy(model=args.model, weights=weights)
                if args.shadow:
                    policy.shadow.CopyFrom(
                        pb.ShadowPolicy(
                            version=args.shadow,
                            fraction=args.shadow_fraction,
                            compare=args.shadow_compare,
                            tolerance=args.shadow_tolerance,
                        )
                    )
                elif args.no_shadow:
                    policy.shadow.SetInParent()  # present with no version: removes the shadow
                reply = scheduler.set_traffic(policy)
                shadows = None
            else:
                reply = scheduler.get_traffic(args.model)
                shadows = None
                if args.traffic_action == "show":
                    status = scheduler.status()
                    shadows = [s for s in status.shadows if s.model == args.model]
    except grpc.RpcError as exc:
        raise SystemExit(f"error: {exc.details()}{rpc_hint(exc, tls)}") from None
    from aiworks.core.output import emit

    if shadows is None:
        emit(reply, args.output, lambda: format_policy(reply))
    else:
        table = format_policy(reply) + "\n" + (format_shadows(shadows) if shadows else "  no shadow traffic yet")
        emit({"policy": reply, "shadows": shadows}, args.output, lambda: table)


def format_policy(policy) -> str:
    if not policy.weights:
        text = f"{policy.model}: no weights; requests without a version go to the latest ready version"
    else:
        total = sum(policy.weights.values()) or 1
        parts = [f"v{v}={w} ({100 * w / total:.0f}%)" for v, w in sorted(policy.weights.items(), key=lambda i: i[0])]
        text = f"{policy.model}: " + "  ".join(parts)
    if policy.HasField("shadow") and policy.shadow.version:
        s = policy.shadow
        how = f"allclose, tolerance {s.tolerance:g}" if s.compare == "allclose" else s.compare
        text += f"\n  shadow: v{s.version}, {100 * s.fraction:g}% of requests mirrored, compared by {how}"
    return text


def format_shadows(shadows) -> str:
    """Comparison counts per shadow version (``StatusResponse.shadows`` entries)."""
    lines = [
        f"  {'shadow':<8} {'active':<6} {'mirrored':>9} {'compared':>9} {'agreed':>9} {'agreement':>9} "
        f"{'errors':>7} {'dropped':>8} {'inflight':>8}  compare"
    ]
    for s in shadows:
        agreement = f"{100 * s.agreement:.1f}%" if s.compared else "-"
        lines.append(
            f"  v{s.shadow_version:<7} {'yes' if s.active else 'no':<6} {s.mirrored:>9} {s.compared:>9} "
            f"{s.agreed:>9} {agreement:>9} {s.errors:>7} {s.dropped:>8} {s.inflight:>8}  {s.compare}"
        )
    return "\n".join(lines)
