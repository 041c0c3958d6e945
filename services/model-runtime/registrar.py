"""Registers this replica with the scheduler and heartbeats its load and models."""

from __future__ import annotations

import asyncio
import logging

import grpc
from aiworks.runtime.dataplane import RuntimeDataPlane

from aiworks.core.converters import from_model_spec
from aiworks.pb.scheduler.v1 import scheduler_pb2 as spb
from aiworks.pb.scheduler.v1 import scheduler_pb2_grpc

log = logging.getLogger(__name__)


class Registrar:
    """Keeps the scheduler informed; re-registers whenever the scheduler forgets us."""

    def __init__(
        self,
        channel: grpc.aio.Channel,
        dataplane: RuntimeDataPlane,
        *,
        replica_id: str,
        address: str,
        device: str,
        labels: dict[str, str],
        interval_s: float,
    ):
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        self._dataplane = dataplane
        self._info = dict(replica_id=replica_id, address=address, device=device, labels=labels)
        self.interval_s = interval_s
        self.registered = asyncio.Event()

    def _models(self):
        return [from_model_spec(s) for s in self._dataplane.ready_specs()]

    def _queues(self):
        queues = self._dataplane.queues
        queues.sweep()
        return [spb.QueueStatus(**vars(q)) for q in queues.stats()]

    async def register(self) -> None:
        reply = await self._stub.RegisterReplica(spb.ReplicaInfo(models=self._models(), **self._info), timeout=5)
        if reply.heartbeat_interval_s > 0:
            self.interval_s = reply.heartbeat_interval_s
        if not self.registered.is_set():
            log.info("registered with the scheduler as %s at %s", self._info["replica_id"], self._info["address"])
        self.registered.set()

    async def run(self) -> None:
        """Register, then heartbeat forever; survives scheduler restarts."""
        warned = False
        while True:
            try:
                if not self.registered.is_set():
                    await self.register()
                else:
                    reply = await self._stub.Heartbeat(
                        spb.HeartbeatRequest(
                            replica_id=self._info["replica_id"],
                            inflight_batches=self._dataplane.inflight_batches,
                            models=self._models(),
                            queues=self._queues(),
                        ),
                        timeout=max(self.interval_s * 3, 1.0),
                    )
                    if not reply.known:
                        log.warning("the scheduler no longer knows this replica; registering again")
                        self.registered.clear()
                        continue
                warned = False
            except grpc.aio.AioRpcError as exc:
                if not warned:
                    log.warning("cannot reach the scheduler (%s): %s; retrying", exc.code().name, exc.details())
                    warned = True
                self.registered.clear()
            await asyncio.sleep(self.interval_s)
