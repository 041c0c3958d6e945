"""A gRPC health probe over mutual TLS: ``python -m aiworks.kube.probe --port 8010 --tls-dir DIR --identity scheduler``.

The kubelet's own ``grpc`` probe speaks plaintext only, and internal servers
with mutual TLS refuse it, so the chart runs this as an exec probe there. It
imports only grpc and the health stubs, to keep each probe cheap. Exit 0:
SERVING; 1: anything else, with the reason on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def probe(port: int, tls_dir: Path | None, identity: str, service: str = "", timeout_s: float = 2.0) -> str | None:
    """None when the server answers SERVING for ``service``; otherwise why not."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    address = f"127.0.0.1:{port}"
    if tls_dir is None:
        channel = grpc.insecure_channel(address)
    else:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=(tls_dir / "ca.crt").read_bytes(),
            private_key=(tls_dir / "tls.key").read_bytes(),
            certificate_chain=(tls_dir / "tls.crt").read_bytes(),
        )
        # Certificates name the service, not the loopback address dialled.
        channel = grpc.secure_channel(address, credentials, options=[("grpc.ssl_target_name_override", identity)])
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m aiworks.kube.probe", description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True, help="gRPC port on 127.0.0.1")
    parser.add_argument("--tls-dir", type=Path, help="tls.crt, tls.key and ca.crt; unset: plaintext")
    parser.add_argument("--identity", default="", help="the server's identity (certificate name): scheduler ...")
    parser.add_argument("--service", default="", help='grpc.health.v1 service name ("" = the whole server)')
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    args = parser.parse_args(argv)
    problem = probe(args.port, args.tls_dir, args.identity, args.service, args.timeout)
    if problem:
        print(f"not serving: {problem}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
