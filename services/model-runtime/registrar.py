"""Registers this replica with the scheduler and heartbeats its load, its models and its GPUs.

A heartbeat leaves every ``interval_s`` (counted from the last one's sending, so a scheduler slow to
answer still hears one each interval, as long as it answers within one; one unanswered for 1.5 intervals
is given up, :attr:`Registrar.answer_timeout_s`), and also as soon as a backend goes
down or comes back (checked every ``watch_s``), so the scheduler learns of a
restarting tritonserver in well under a second. Versions loaded or unloaded
are told by the load's own answer and the next regular heartbeat, as before. :meth:`beat_now` sends one at once and waits for the
answer: the data plane awaits it before a failed batch's error leaves, so the
scheduler already knows the model is coming back when the error arrives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiworks.core.converters import from_model_spec
from aiworks.core.errors import AIWorksError, Status
from aiworks.pb.scheduler.v1 import scheduler_pb2 as spb
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.scheduler.client import SchedulerClient

log = logging.getLogger(__name__)


def gpu_messages(read: Callable[[], list] | None) -> list[spb.GpuInfo]:
    """NVML readings (:class:`aiworks.core.gpu.GpuReading`) as GpuInfo messages; none without NVML."""
    if read is None:
        return []
    try:
        readings = read()
    except Exception as exc:  # a GPU fell off the bus: the heartbeat still goes
        log.warning("cannot read the GPUs for the heartbeat: %s", exc)
        return []
    return [
        spb.GpuInfo(
            index=r.index,
            uuid=r.uuid,
            name=r.name,
            memory_total_bytes=r.memory_total_bytes,
            memory_used_bytes=r.memory_used_bytes,
            utilization_ratio=r.utilization_ratio,
        )
        for r in readings
    ]


class Registrar:
    """Keeps the scheduler informed; re-registers whenever the scheduler forgets us."""

    def __init__(
        self,
        scheduler: SchedulerClient,
        dataplane: RuntimeDataPlane,
        *,
        replica_id: str,
        address: str,
        device: str,
        labels: dict[str, str],
        interval_s: float,
        gpus: Callable[[], list] | None = None,
        watch_s: float = 0.2,
        scheduler_address: str = "",
    ):
        self._scheduler = scheduler
        self.scheduler = scheduler_address  # for the logs (one registrar per scheduler)
        self._dataplane = dataplane
        self._info = dict(replica_id=replica_id, address=address, device=device, labels=labels)
        self._gpus = gpus
        self.interval_s = interval_s
        self.watch_s = watch_s
        self.registered = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._sent_states: tuple = ()
        self.stopping = False  # heartbeats say so from then on: the scheduler routes nothing new here

    def _models(self):
        self._sent_states = self._health()
        return [from_model_spec(s) for s in self._dataplane.advertised_specs()]

    def _health(self) -> tuple:
        return tuple(sorted(self._dataplane.unhealthy_versions()))

    def _queues(self):
        queues = self._dataplane.queues
        queues.sweep()
        return [spb.QueueStatus(**vars(q)) for q in queues.stats()]

    def _kv(self):
        return [
            spb.KvStatus(model=m, version=v, free_tokens=free, budget_tokens=budget, waiting_sequences=waiting,
                         waiting_by_class=by_class)  # fmt: skip
            for m, v, free, budget, waiting, by_class in self._dataplane.kv_room()
        ]

    async def register(self) -> None:
        reply = await self._scheduler.register_replica(
            spb.ReplicaInfo(models=self._models(), gpus=gpu_messages(self._gpus), **self._info), timeout_s=5
        )
        if reply.heartbeat_interval_s > 0:
            self.interval_s = reply.heartbeat_interval_s
        if not self.registered.is_set():
            log.info("registered with the scheduler %s as %s at %s", self.scheduler, self._info["replica_id"],
                     self._info["address"])  # fmt: skip
        self.registered.set()

    async def _beat(self) -> None:
        async with self._send_lock:
            if not self.registered.is_set():
                if not self.stopping:  # a stopping replica does not join a scheduler that forgot it
                    await self.register()
                return
            reply = await self._scheduler.heartbeat(
                spb.HeartbeatRequest(
                    replica_id=self._info["replica_id"],
                    inflight_batches=self._dataplane.inflight_batches,
                    models=self._models(),
                    gpus=gpu_messages(self._gpus),
                    queues=self._queues(),
                    kv=self._kv(),
                    stopping=self.stopping,
                ),
                timeout_s=self.answer_timeout_s,
            )
            if not reply.known and not self.stopping:
                log.warning("the scheduler %s no longer knows this replica; registering again", self.scheduler)
                self.registered.clear()
                await self.register()

    async def beat_now(self, timeout_s: float = 1.0) -> None:
        """Send a heartbeat now and wait for the scheduler's answer (at most ``timeout_s``; never raises)."""
        try:
            await asyncio.wait_for(self._beat(), timeout_s)
        except (TimeoutError, AIWorksError) as exc:
            log.warning("immediate heartbeat to the scheduler %s failed: %s", self.scheduler, exc)

    async def leave(self, timeout_s: float = 1.0) -> None:
        """Tell the scheduler now that this replica is stopping (never raises); the heartbeats go on saying so."""
        self.stopping = True
        await self.beat_now(timeout_s)

    @property
    def answer_timeout_s(self) -> float:
        """How long a heartbeat waits for its answer: 1.5 intervals. A beat lost on a dead connection then
        delays the next one to 2.5 intervals after the last one heard, inside the scheduler's 3.5 (its
        ``heartbeat_timeout_s``); at 3 intervals, as before, the replica was removed while alive."""
        return max(self.interval_s * 1.5, 0.5)

    def _changed(self) -> bool:
        return self._health() != self._sent_states

    async def run(self) -> None:
        """Register, then heartbeat forever; survives scheduler restarts."""
        warned = False
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval_s  # from the send: a slow answer does not stretch the cadence
            try:
                await self._beat()
                warned = False
            except AIWorksError as exc:
                if not warned:
                    log.warning("cannot reach the scheduler %s (%s): %s; retrying", self.scheduler, exc.status.name,
                                exc.message)  # fmt: skip
                    warned = True
                if exc.status is not Status.DEADLINE_EXCEEDED:
                    # Unanswered is not forgotten: a slow scheduler still knows this replica, and one that
                    # restarted says so in the next answer (known: false), which registers again.
                    self.registered.clear()
            while loop.time() < due and not self._changed():
                await asyncio.sleep(min(self.watch_s, max(0.0, due - loop.time())))
