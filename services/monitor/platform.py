"""The one port through which the monitor touches the world, and its local adapter.

Every side effect of the control loop (restarting a service, scaling a runtime
pool, ejecting a replica) and the discovery it acts on go through a
:class:`Platform`. The control loop therefore runs unchanged against local
processes (:class:`LocalPlatform`, the supervisor's control API of
``aiworks up``), a Kubernetes release (:class:`aiworks.monitor.k8s.KubernetesPlatform`)
or a unit test's fake.

Ejection is the scheduler's business on every platform (it owns routing), so
both adapters hand it to the same :class:`SchedulerEjector`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import aiohttp
import grpc

from aiworks.core.errors import AIWorksError, Status, Unavailable, from_rpc_error
from aiworks.core.rpc import client_channel, process_tls
from aiworks.monitor.discovery import Inventory, Service, from_supervisor
from aiworks.pb.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from aiworks.security.callers import ClientCaller
from aiworks.security.tls import TLSFiles

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EjectResult:
    """What the scheduler did with an ejection request."""

    ejected: bool
    ejected_for_s: float
    message: str


class Platform(ABC):
    """Discovery and every side effect of the monitor."""

    name: str = "platform"

    @abstractmethod
    async def inventory(self) -> Inventory:
        """The services and runtime pools now."""

    @abstractmethod
    async def restart(self, service: Service) -> str:
        """Restart a dead (or misbehaving) service; returns what was done, in words."""

    @abstractmethod
    async def scale(self, pool: str, replicas: int) -> None:
        """Set the number of replicas of a runtime pool."""

    @abstractmethod
    async def eject(self, replica_id: str, duration_s: float, reason: str) -> EjectResult:
        """Ask the scheduler to take a replica out of routing for ``duration_s``."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


class SchedulerEjector:
    """Calls the scheduler's ``EjectReplica`` RPC (over mutual TLS with ``tls``, default the monitor's own files)."""

    def __init__(
        self, address: str, max_message_bytes: int = 4 << 20, timeout_s: float = 5.0, tls: TLSFiles | None = None
    ):
        self.address = address
        self.timeout_s = timeout_s
        self._max_message_bytes = max_message_bytes
        self._tls = tls or process_tls()
        self._channel: grpc.aio.Channel | None = None

    async def eject(self, replica_id: str, duration_s: float, reason: str) -> EjectResult:
        if self._channel is None:
            self._channel = client_channel(self.address, self._max_message_bytes, self._tls, server_name="scheduler")
        stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)
        request = scheduler_pb2.EjectReplicaRequest(replica_id=replica_id, duration_s=duration_s, reason=reason)
        try:
            reply = await stub.EjectReplica(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"the scheduler at {self.address}") from None
        return EjectResult(reply.ejected, reply.ejected_for_s, reply.message)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


_STATUS_BY_HTTP = {s.http: s for s in reversed(Status)}


class LocalPlatform(Platform):
    """The processes of ``aiworks up``, through the supervisor's control API.

    Without a supervisor URL (a monitor started on its own, docker-compose) it
    watches the ``static`` inventory it was given (or nothing) and refuses
    restarts and scaling; ejection still works.
    """

    name = "local"

    def __init__(
        self,
        supervisor_url: str | None,
        ejector: SchedulerEjector,
        timeout_s: float = 5.0,
        caller: ClientCaller | None = None,
        static: Inventory | None = None,
    ):
        self.url = supervisor_url.rstrip("/") if supervisor_url else None
        self.static = static
        self.ejector = ejector
        # The control API wants a bearer token (the monitor's, from its token file) and JSON bodies.
        self.caller = caller  # its bearer is read at each call: a rotated internal token reaches the next call
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        if self.url is None:
            raise AIWorksError(
                "no supervisor to act through: set AIWORKS_MONITOR_SUPERVISOR_URL", Status.FAILED_PRECONDITION
            )
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout)
        try:
            payload = body if body is not None or method == "GET" else {}
            async with self._session.request(
                method, f"{self.url}{path}", json=payload,
                headers={"Authorization": self.caller.bearer()} if self.caller else {},
            ) as resp:
                doc = await resp.json(content_type=None)
                if resp.status >= 400:
                    status = _STATUS_BY_HTTP.get(resp.status, Status.INTERNAL)
                    raise AIWorksError(f"supervisor: {doc.get('error', resp.reason)}", status)
                return doc
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise Unavailable(f"the supervisor at {self.url} is unreachable: {exc}") from None

    async def inventory(self) -> Inventory:
        if self.url is None:
            return self.static or Inventory()
        return from_supervisor(await self._call("GET", "/v1/services"))

    async def restart(self, service: Service) -> str:
        doc = await self._call("POST", f"/v1/services/{service.name}/restart")
        return f"restarted {service.name} as pid {doc.get('pid')}"

    async def scale(self, pool: str, replicas: int) -> None:
        await self._call("POST", "/v1/runtime/scale", {"replicas": replicas})

    async def eject(self, replica_id: str, duration_s: float, reason: str) -> EjectResult:
        return await self.ejector.eject(replica_id, duration_s, reason)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
        await self.ejector.close()
