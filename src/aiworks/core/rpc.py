"""gRPC plumbing shared by every service: servers, channels, health and errors.

Servicer methods are wrapped by :func:`handle_errors`, which turns an
:class:`AIWorksError` into the gRPC status from the one error table, and any
other exception into INTERNAL with a log line. Clients turn failures back into
:class:`AIWorksError` with :func:`aiworks.core.errors.from_rpc_error`.
"""

from __future__ import annotations

import functools
import logging

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from aiworks.core.errors import AIWorksError

log = logging.getLogger(__name__)


def channel_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Peers are long-lived; keep connections warm and notice dead ones.
        ("grpc.keepalive_time_ms", 20_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def create_server(max_message_bytes: int) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A grpc.aio server with ``grpc.health.v1`` registered (status NOT_SERVING)."""
    server = grpc.aio.server(options=channel_options(max_message_bytes))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    return server, health_servicer


async def set_serving(health_servicer, serving: bool, service: str = "") -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    await health_servicer.set(service, status)


def insecure_channel(address: str, max_message_bytes: int) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=channel_options(max_message_bytes))


def handle_errors(method):
    """Map exceptions raised by an async servicer method to gRPC statuses."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except AIWorksError as exc:
            if exc.retry_after_s is not None:
                context.set_trailing_metadata((("retry-after", str(int(max(1, exc.retry_after_s)))),))
            await context.abort(exc.status.grpc_code, exc.message)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # a bug: say so, keep serving
            log.exception("unhandled error in %s", method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}")

    return wrapper
