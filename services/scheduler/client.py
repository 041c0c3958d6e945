"""The scheduler's public face: its client, and the routing every gateway does with it.

- :class:`SchedulerClient` calls the SchedulerService's control methods
  (metadata, the repository, load and unload, statistics, status, traffic
  policies, ejection, a replica's registration and heartbeats); the
  generated stub stays inside this package.
- :class:`BlockingSchedulerClient` makes the few calls tools and the command
  line need (status, readiness, traffic policies) without an event loop.
- :class:`Routing` is what a gateway holds: it watches the scheduler's
  routing table (a :class:`~aiworks.scheduler.mirror.RoutingMirror` of it),
  reports this gateway's routing state back every second, and sends each
  request straight to a runtime replica through a
  :class:`~aiworks.scheduler.dispatch.Dispatcher`. With several scheduler
  addresses it watches one and moves to the next when that one goes away;
  requests keep flowing meanwhile on the table it has.

Other code imports this module, never the scheduler's other modules.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Iterable

import grpc

from aiworks.core.converters import to_model_spec, to_statistics
from aiworks.core.errors import AIWorksError, Unavailable, from_rpc_error
from aiworks.core.inference import InferRequest, ModelStatistics
from aiworks.core.load_overrides import LoadOverrides
from aiworks.core.model_config import ModelSpec
from aiworks.core.options import Priority, RequestOptions
from aiworks.core.rpc import blocking_channel, client_channel
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
from aiworks.pb.scheduler.v1 import scheduler_pb2_grpc
from aiworks.runtime.client import Answer, RuntimeClient, Work
from aiworks.scheduler.converters import (
    report_to_pb,
    status_from_pb,
    table_from_pb,
    traffic_from_pb,
    traffic_to_pb,
)
from aiworks.scheduler.dispatch import Dispatcher
from aiworks.scheduler.mirror import RoutingMirror
from aiworks.scheduler.pipeline import is_pipeline, parse_steps
from aiworks.scheduler.traffic_state import TrafficPolicy
from aiworks.scheduler.views import StatusView
from aiworks.security.callers import ClientCaller
from aiworks.security.tls import TLSFiles

log = logging.getLogger(__name__)

__all__ = ["Answer", "BlockingSchedulerClient", "Routing", "SchedulerClient", "TrafficPolicy", "Work",
           "parse_addresses"]  # fmt: skip


def parse_addresses(addresses: str | Iterable[str]) -> list[str]:
    """``host:port[,host:port...]`` (or a list of them) as a list; the first is tried first."""
    items = addresses.split(",") if isinstance(addresses, str) else list(addresses)
    found = [a.strip() for a in items if a and a.strip()]
    if not found:
        raise ValueError("no scheduler address given")
    return found


class SchedulerClient:
    """Calls the SchedulerService (the first address that answers); failures become AIWorksError."""

    def __init__(self, addresses: str | Iterable[str], max_message_bytes: int = 64 << 20, timeout_s: float = 10.0,
                 tls: TLSFiles | None = None, caller: ClientCaller | None = None):  # fmt: skip
        self.addresses = parse_addresses(addresses)
        self.max_message_bytes = max_message_bytes
        self.timeout_s = timeout_s
        self.tls = tls
        self._channels = [
            client_channel(a, max_message_bytes, tls, server_name="scheduler", caller=caller) for a in self.addresses
        ]
        self._stubs = [scheduler_pb2_grpc.SchedulerServiceStub(c) for c in self._channels]
        self._current = 0

    @property
    def address(self) -> str:
        return self.addresses[self._current]

    async def _call(self, method: str, request, timeout_s: float | None = None):
        """Call ``method`` on the current scheduler; move on to the next one while they are unreachable."""
        last: AIWorksError | None = None
        for _ in range(len(self._stubs)):
            index = self._current
            try:
                return await getattr(self._stubs[index], method)(request, timeout=timeout_s or self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                error = from_rpc_error(exc, f"scheduler {self.addresses[index]}")
                if exc.code() != grpc.StatusCode.UNAVAILABLE or len(self._stubs) == 1:
                    raise error from None
                last = error
                self._current = (index + 1) % len(self._stubs)
        raise last

    async def ready(self) -> bool:
        return (await self._call("ServerReady", pb.ServerReadyRequest(), 2)).ready

    async def model_ready(self, name: str, version: str) -> bool:
        return (await self._call("ModelReady", pb.ModelRef(name=name, version=version), 2)).ready

    async def metadata(self, name: str, version: str) -> tuple[ModelSpec, list[str]]:
        reply = await self._call("ModelMetadata", pb.ModelRef(name=name, version=version), 5)
        return to_model_spec(reply.spec), list(reply.versions)

    async def index(self, ready_only: bool) -> list[ModelSpec]:
        reply = await self._call("RepositoryIndex", pb.RepositoryIndexRequest(ready_only=ready_only), 10)
        return [to_model_spec(s) for s in reply.models]

    async def load(self, name: str, overrides: LoadOverrides | None = None) -> tuple[list[ModelSpec], int]:
        """(Re)load ``name`` on every replica: its versions, and the routing table's generation that shows them.

        ``overrides`` (Triton's load parameters) go to every replica with the load.
        """
        request = pb.LoadModelRequest(name=name)
        if overrides:
            request.config_override = overrides.config
            request.files.update(overrides.files)
        reply = await self._call("LoadModel", request, 180)
        return [to_model_spec(s) for s in reply.versions], reply.generation

    async def unload(self, name: str) -> int:
        """Unload ``name`` everywhere; returns the routing table's generation that shows it gone."""
        return (await self._call("UnloadModel", pb.ModelRef(name=name), 60)).generation

    async def statistics(self, name: str, version: str) -> list[tuple[str, list[ModelStatistics]]]:
        reply = await self._call("ModelStatistics", pb.ModelRef(name=name, version=version), 10)
        return [(r.replica_id, [to_statistics(m) for m in r.models]) for r in reply.replicas]

    async def status(self) -> StatusView:
        return status_from_pb(await self._call("Status", pb.StatusRequest(), 5))

    async def status_message(self) -> pb.StatusResponse:
        """The status as it travels (``-o json`` prints it field for field)."""
        return await self._call("Status", pb.StatusRequest(), 5)

    async def set_traffic(self, policy: TrafficPolicy, *, keep_shadow: bool = False) -> TrafficPolicy:
        message = traffic_to_pb(policy)
        if keep_shadow:
            message.ClearField("shadow")
        elif policy.shadow is None:
            message.shadow.SetInParent()  # an empty shadow removes the one in force
        reply = await self._call("SetTrafficPolicy", pb.SetTrafficPolicyRequest(policy=message), 5)
        return traffic_from_pb(reply)

    async def get_traffic(self, model: str) -> TrafficPolicy:
        return traffic_from_pb(await self._call("GetTrafficPolicy", pb.GetTrafficPolicyRequest(model=model), 5))

    async def eject(self, replica_id: str, duration_s: float = 0.0, reason: str = "") -> tuple[bool, float, str]:
        reply = await self._call(
            "EjectReplica", pb.EjectReplicaRequest(replica_id=replica_id, duration_s=duration_s, reason=reason), 5
        )
        return reply.ejected, reply.ejected_for_s, reply.message

    async def register_replica(self, info: pb.ReplicaInfo, timeout_s: float = 5.0) -> pb.RegisterReplicaResponse:
        """A runtime replica introduces itself (its address, device, labels, models and GPUs)."""
        return await self._call("RegisterReplica", info, timeout_s)

    async def heartbeat(self, beat: pb.HeartbeatRequest, timeout_s: float) -> pb.HeartbeatResponse:
        """A runtime replica's load and models; ``known`` is false once the scheduler has forgotten it."""
        return await self._call("Heartbeat", beat, timeout_s)

    def watch_routing(self, index: int, reports) -> grpc.aio.StreamStreamCall:
        """Open ``WatchRouting`` on scheduler ``index``; ``reports`` yields the RoutingReport messages to send."""
        return self._stubs[index].WatchRouting(reports)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


class BlockingSchedulerClient:
    """Blocking calls to one scheduler, for tools, probes and the command line; replies are the messages as they
    travel (``-o json`` prints them field for field). Failures stay :class:`grpc.RpcError`, whose code lets a tool
    say what to do about them (see :func:`aiworks.status.rpc_hint`). Use it as a context manager, or :meth:`close`.
    """

    def __init__(self, address: str, tls: TLSFiles | None = None, caller: ClientCaller | None = None,
                 timeout_s: float = 5.0):  # fmt: skip
        self.address = address
        self.timeout_s = timeout_s
        self._channel = blocking_channel(address, tls, server_name="scheduler", caller=caller)
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)

    def status(self, timeout_s: float | None = None) -> pb.StatusResponse:
        return self._stub.Status(pb.StatusRequest(), timeout=timeout_s or self.timeout_s)

    def model_ready(self, name: str, version: str = "", timeout_s: float | None = None) -> bool:
        return self._stub.ModelReady(pb.ModelRef(name=name, version=version), timeout=timeout_s or self.timeout_s).ready

    def get_traffic(self, model: str) -> pb.TrafficPolicy:
        return self._stub.GetTrafficPolicy(pb.GetTrafficPolicyRequest(model=model), timeout=self.timeout_s)

    def set_traffic(self, policy: pb.TrafficPolicy) -> pb.TrafficPolicy:
        """Set ``policy``; a shadow field left unset keeps the shadow in force, an empty one removes it."""
        return self._stub.SetTrafficPolicy(pb.SetTrafficPolicyRequest(policy=policy), timeout=self.timeout_s)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> BlockingSchedulerClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Routing:
    """A gateway's routing: the watched routing table and the dispatcher that routes by it."""

    def __init__(self, scheduler: SchedulerClient, *, runtime_timeout_s: float = 60.0,
                 gateway_id: str | None = None, report_interval_s: float = 1.0):  # fmt: skip
        self.scheduler = scheduler
        self.gateway_id = gateway_id or f"{socket.gethostname()}-{os.getpid()}"
        self.report_interval_s = report_interval_s

        def connect(address: str) -> RuntimeClient:
            return RuntimeClient(address, scheduler.max_message_bytes, runtime_timeout_s, scheduler.tls)

        self.mirror = RoutingMirror(connect)
        self.dispatcher = Dispatcher(self.mirror)
        self._task: asyncio.Task | None = None
        self.connected = asyncio.Event()

    async def start(self, wait_s: float = 0.0) -> None:
        """Start watching; with ``wait_s``, wait that long at most for the first table."""
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="routing-watch")
        if wait_s:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.mirror.received.wait(), wait_s)

    async def _watch(self) -> None:
        """Keep one WatchRouting stream open, on the first scheduler that answers; report on it."""
        warned = False
        while True:
            index = self.scheduler._current
            address = self.scheduler.addresses[index]
            call = self.scheduler.watch_routing(index, self._reports())
            try:
                async for message in call:
                    if not self.connected.is_set():
                        log.info("watching the routing table of scheduler %s", address)
                        self.connected.set()
                    warned = False
                    table = table_from_pb(message)
                    self.mirror.apply(table)
                    self.dispatcher.apply(table)
            except asyncio.CancelledError:
                call.cancel()
                raise
            except grpc.aio.AioRpcError as exc:
                if not warned:
                    log.warning("routing table of scheduler %s unavailable (%s: %s); requests route by the table "
                                "received last", address, exc.code().name, exc.details())  # fmt: skip
                    warned = True
            self.connected.clear()
            if len(self.scheduler.addresses) > 1:
                self.scheduler._current = (index + 1) % len(self.scheduler.addresses)
            await asyncio.sleep(0.2)

    async def _reports(self):
        while True:
            yield report_to_pb(self.dispatcher.report(self.gateway_id))
            await asyncio.sleep(self.report_interval_s)

    async def caught_up(self, generation: int, timeout_s: float = 2.0) -> bool:
        """Wait until this gateway's table is at least ``generation`` (after a change it asked for)."""
        return await self.mirror.caught_up(generation, timeout_s)

    # ---- what the gateway asks --------------------------------------------------------------

    @property
    def default_priority(self) -> Priority:
        return self.dispatcher.default_priority

    def ready(self) -> bool:
        """A routing table arrived and some replica is live in it."""
        return self.mirror.ready and bool(self.mirror.live())

    def _need_table(self) -> None:
        if not self.mirror.ready:
            raise Unavailable(f"no routing table from the scheduler at {', '.join(self.scheduler.addresses)} yet")

    def resolve(self, model: str, version: str) -> ModelSpec:
        """The spec a request for ``model``/``version`` gets (weights applied); 404 or 503 as the table says."""
        self._need_table()
        return self.dispatcher.resolve(model, version)

    def spec(self, model: str, version: str) -> ModelSpec:
        """The spec of ``model``/``version`` (latest when empty), without weights: metadata, filters, masking."""
        self._need_table()
        return self.mirror.resolve(model, version)

    def versions(self, model: str) -> list[str]:
        return self.mirror.versions(model)

    def model_ready(self, model: str, version: str) -> bool:
        self._need_table()
        spec = self.mirror.resolve(model, version)
        if is_pipeline(spec):  # ready when every step's model is
            try:
                return all(self.model_ready(s.model, s.version) for s in parse_steps(spec))
            except AIWorksError:
                return False
        return bool(self.mirror.holders((spec.name, spec.version)))

    async def infer(self, request: InferRequest, options: RequestOptions, *, spec: ModelSpec | None = None,
                    work: Work | None = None) -> Answer:  # fmt: skip
        """Send one request to a replica (see :class:`Dispatcher`); ``work`` gets what it cost."""
        self._need_table()
        return await self.dispatcher.infer(request, options, spec=spec, work=work)

    async def infer_stream(self, request: InferRequest, options: RequestOptions, *, spec: ModelSpec | None = None,
                           work: Work | None = None) -> AsyncIterator[Answer]:  # fmt: skip
        """The answers to one request as they come; a decoupled model's 0..N and a final one (see :class:`Dispatcher`).

        Close the iterator (``contextlib.aclosing``) when stopping early: that cancels the request at its replica.
        """
        self._need_table()
        async with contextlib.aclosing(self.dispatcher.infer_stream(request, options, spec=spec, work=work)) as answers:
            async for answer in answers:
                yield answer

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.mirror.close()
