"""Result streams over gRPC server streaming: ``aiworks.streams.v1.ResultStreams/Subscribe`` (docs/tiers.md).

Served on the gateway's public gRPC port. The same subscriptions as ``GET /v2/streams/{name}``
(stream_routes.py): both front ends translate, :mod:`aiworks.streams.subscription` does the rest.
Credentials are the call's metadata, as for inference. Each event is one ``StreamEvent`` written
with ``context.write``, which waits while the client's HTTP/2 flow-control window is full: that is
the wait the stream's slow-consumer policy bounds (drop) or lets last (pause).
"""

from __future__ import annotations

import logging

import grpc

from aiworks.core import metrics
from aiworks.core.errors import AIWorksError
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.pb.streams.v1 import streams_pb2 as pb
from aiworks.pb.streams.v1 import streams_pb2_grpc
from aiworks.streams.subscription import DROPPED_ENDING, Event, Subscriptions

log = logging.getLogger(__name__)


class ResultStreamsServicer(streams_pb2_grpc.ResultStreamsServicer):
    def __init__(self, dataplane: GatewayDataPlane, subscriptions: Subscriptions):
        self.dataplane = dataplane
        self.subscriptions = subscriptions

    async def Subscribe(self, request, context):
        try:
            principal = self.dataplane.authenticate(context.invocation_metadata())
            self.dataplane.refuse_work_token(principal, "subscribe to result streams")
            subscription = await self.subscriptions.open(
                principal.tenant_id, request.name, group=request.group or None, consumer=request.consumer or None,
                start=request.from_id or None, policy=principal.tenant.stream_policy(request.name),
                tenant_limit=principal.tenant.max_stream_subscribers,
            )  # fmt: skip
        except AIWorksError as exc:
            if exc.retry_after_s:
                context.set_trailing_metadata((("retry-after", str(int(max(1, exc.retry_after_s)))),))
            await context.abort(exc.status.grpc_code, exc.message)

        async def send(event: Event) -> None:
            await context.write(pb.StreamEvent(event=event.kind, id=event.id, data=event.data))

        try:
            ending = await subscription.run(send)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001 - ends this subscriber only, named
            log.warning("stream subscriber ended: %s", exc)
            metrics.STREAM_SUBSCRIBERS_DROPPED.labels("error").inc()
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the stream could not be read: {type(exc).__name__}")
        finally:
            subscription.close()
        if ending == DROPPED_ENDING:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"dropped: the subscriber did not read for {self.subscriptions.send_timeout_s:g} s",
            )
