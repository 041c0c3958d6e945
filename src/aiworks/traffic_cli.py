"""``aiworks traffic``: set and read a model's version weights (canary releases).

    aiworks traffic set digits 1=90 2=10     90% of requests without a version to v1, 10% to v2
    aiworks traffic set digits --clear       back to the latest version
    aiworks traffic get digits

Heavy imports happen inside the command, so ``aiworks --help`` stays fast.
"""

from __future__ import annotations

import argparse


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
    p.add_argument("--scheduler", default="127.0.0.1:8010", help="scheduler address (default 127.0.0.1:8010)")
    actions = p.add_subparsers(dest="traffic_action", metavar="ACTION", required=True)
    set_ = actions.add_parser("set", help="set version weights, e.g. `aiworks traffic set digits 1=90 2=10`")
    set_.add_argument("model")
    set_.add_argument("weights", nargs="*", metavar="VERSION=WEIGHT")
    set_.add_argument("--clear", action="store_true", help="remove the weights: the latest version serves")
    get = actions.add_parser("get", help="show a model's version weights")
    get.add_argument("model")
    p.set_defaults(func=run_traffic)
    return p


def run_traffic(args) -> None:
    import grpc

    from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
    from aiworks.pb.scheduler.v1 import scheduler_pb2_grpc

    if args.traffic_action == "set":
        if bool(args.weights) == bool(args.clear):
            raise SystemExit("error: give VERSION=WEIGHT terms (for example 1=90 2=10), or --clear")
        weights = {}
        for term in args.weights:
            version, sep, weight = term.partition("=")
            if not sep or not version or not weight.isdigit():
                raise SystemExit(f"error: '{term}' is not VERSION=WEIGHT (for example 1=90)")
            weights[version] = int(weight)
    try:
        with grpc.insecure_channel(args.scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            if args.traffic_action == "set":
                policy = pb.TrafficPolicy(model=args.model, weights=weights)
                reply = stub.SetTrafficPolicy(pb.SetTrafficPolicyRequest(policy=policy), timeout=5)
            else:
                reply = stub.GetTrafficPolicy(pb.GetTrafficPolicyRequest(model=args.model), timeout=5)
    except grpc.RpcError as exc:
        raise SystemExit(f"error: {exc.details()}") from None
    print(format_policy(reply))


def format_policy(policy) -> str:
    if not policy.weights:
        return f"{policy.model}: no weights; requests without a version go to the latest ready version"
    total = sum(policy.weights.values()) or 1
    parts = [f"v{v}={w} ({100 * w / total:.0f}%)" for v, w in sorted(policy.weights.items(), key=lambda i: i[0])]
    return f"{policy.model}: " + "  ".join(parts)
