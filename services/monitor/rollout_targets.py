"""Where a rollout's weights go: one port, :class:`TrafficTarget`, with two adapters.

The controller thinks in one split per model: stable version, canary version,
canary percent (stable gets the rest). How that split is enforced depends on
where the suite runs:

- :class:`LocalTraffic`: the scheduler applies it itself, as its
  ``TrafficPolicy`` (``SetTrafficPolicy`` over gRPC), the same thing
  ``aiworks traffic set`` writes. ``{stable: 100 - w, canary: w}``, zero
  weights included, so the policy always names both versions and pins the
  model to them (without a policy the latest version would serve).
- :class:`KubernetesTraffic`: the Istio VirtualService of the model's runtime
  pool gets ``stable``/``canary`` subset weights, and, because the scheduler
  picks the replica of every batch over its long-lived streams (mesh/README.md),
  the scheduler's ``TrafficPolicy`` gets the same weights through the wrapped
  :class:`LocalTraffic`. Both are written on every change; a failure of
  either fails the change, which the controller retries (both writes are
  idempotent).

Only these two classes talk to the outside; the controller's tests use a
recording fake of the port.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from typing import Protocol

import grpc

from aiworks.core.errors import AIWorksError, InvalidArgument, NotFound, Status, Unavailable, from_rpc_error
from aiworks.core.rpc import client_channel, process_tls
from aiworks.pb.scheduler.v1 import scheduler_pb2 as pb
from aiworks.pb.scheduler.v1 import scheduler_pb2_grpc

log = logging.getLogger(__name__)

ISTIO_GROUP = "networking.istio.io"
ISTIO_VERSION = "v1"
VIRTUAL_SERVICES = "virtualservices"
STABLE_SUBSET = "stable"
CANARY_SUBSET = "canary"


def _precondition(message: str) -> AIWorksError:
    return AIWorksError(message, Status.FAILED_PRECONDITION)


def split_weights(stable: str, canary: str, canary_weight: int) -> dict[str, int]:
    """``{stable: 100 - w, canary: w}``; the version-level form of a split."""
    if not 0 <= canary_weight <= 100:
        raise InvalidArgument(f"canary weight must be 0..100, not {canary_weight}")
    return {stable: 100 - canary_weight, canary: canary_weight}


class TrafficTarget(Protocol):
    """Applies a model's stable/canary split and tells which versions exist."""

    name: str

    async def set_split(self, model: str, stable: str, canary: str, canary_weight: int) -> None:
        """Send ``canary_weight`` percent of the model's traffic to ``canary``, the rest to ``stable``."""
        ...

    async def weights(self, model: str) -> dict[str, int]:
        """The version weights in force (empty: none, the latest version serves)."""
        ...

    async def serving_version(self, model: str) -> str:
        """The version that serves the model's unversioned traffic now: the heaviest weighted, else the latest."""
        ...

    async def ready_versions(self, model: str) -> list[str]:
        """Versions that some replica has ready."""
        ...

    async def close(self) -> None: ...


class LocalTraffic:
    """The scheduler's ``TrafficPolicy``, over its gRPC API (``aiworks.scheduler.v1``)."""

    name = "local"

    def __init__(self, scheduler_address: str, timeout_s: float = 5.0, max_message_bytes: int = 4 << 20):
        self.address = scheduler_address
        self.timeout_s = timeout_s
        self._max_message_bytes = max_message_bytes
        self._channel: grpc.aio.Channel | None = None

    def _stub(self) -> scheduler_pb2_grpc.SchedulerServiceStub:
        if self._channel is None:
            # mTLS when the monitor runs with certificates (aiworks up --tls): its process-wide identity.
            self._channel = client_channel(self.address, self._max_message_bytes, process_tls(), server_name="scheduler")
        return scheduler_pb2_grpc.SchedulerServiceStub(self._channel)

    async def _call(self, method: str, request):
        try:
            return await getattr(self._stub(), method)(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise from_rpc_error(exc, f"the scheduler at {self.address}") from None

    async def set_split(self, model: str, stable: str, canary: str, canary_weight: int) -> None:
        policy = pb.TrafficPolicy(model=model, weights=split_weights(stable, canary, canary_weight))
        await self._call("SetTrafficPolicy", pb.SetTrafficPolicyRequest(policy=policy))

    async def weights(self, model: str) -> dict[str, int]:
        reply = await self._call("GetTrafficPolicy", pb.GetTrafficPolicyRequest(model=model))
        return dict(reply.weights)

    async def serving_version(self, model: str) -> str:
        weights = await self.weights(model)
        if weights and any(weights.values()):
            return max(weights, key=lambda v: (weights[v], _version_order(v)))
        ready = await self.ready_versions(model)
        if not ready:
            raise NotFound(f"model '{model}' has no ready version on a live replica")
        return ready[-1]  # the latest, as the scheduler resolves a request that names none

    async def ready_versions(self, model: str) -> list[str]:
        # From Status, which the mesh already lets the monitor call (mesh/authorization-policy-scheduler.yaml).
        reply = await self._call("Status", pb.StatusRequest())
        found = set()
        for replica in reply.replicas:
            if replica.live:
                for entry in replica.models:  # "name:version", ready versions only
                    name, _, version = entry.rpartition(":")
                    if name == model:
                        found.add(version)
        return sorted(found, key=_version_order)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)


def chart_fullname(release: str, chart: str = "aiworks") -> str:
    """The Helm chart's ``aiworks.fullname`` for a release (no fullnameOverride)."""
    return release[:63].rstrip("-") if chart in release else f"{release}-{chart}"[:63].rstrip("-")


def set_route_weights(spec: dict, canary_weight: int) -> dict:
    """A copy of a VirtualService ``spec`` with every stable/canary route set to ``100 - w`` / ``w``.

    Routes are the ones the chart renders for a runtime pool: destinations
    with ``subset: stable`` (and ``canary`` once the pool has one). A route
    without a canary destination gets one, copied from its stable destination
    with the subset changed, so the same object serves every step. Routes
    without a stable destination are left alone; a spec with none at all is
    refused, since writing it would change nothing.
    """
    if not 0 <= canary_weight <= 100:
        raise InvalidArgument(f"canary weight must be 0..100, not {canary_weight}")
    out = copy.deepcopy(spec)
    changed = 0
    for route in out.get("http", []):
        destinations = route.get("route", [])
        stable = [d for d in destinations if d.get("destination", {}).get("subset") == STABLE_SUBSET]
        if not stable:
            continue
        canary = [d for d in destinations if d.get("destination", {}).get("subset") == CANARY_SUBSET]
        others = [d for d in destinations if d not in stable and d not in canary]
        if others:
            raise _precondition(
                f"route {route.get('name', '?')!r} has destinations besides the stable and canary subsets"
            )
        if not canary:
            added = copy.deepcopy(stable[0])
            added["destination"]["subset"] = CANARY_SUBSET
            canary = [added]
        stable[0]["weight"] = 100 - canary_weight
        canary[0]["weight"] = canary_weight
        route["route"] = [stable[0], canary[0]]
        changed += 1
    if not changed:
        raise _precondition("the VirtualService has no route to a 'stable' subset")
    return out


class KubernetesTraffic:
    """The runtime pool's Istio VirtualService, plus the scheduler's policy through ``scheduler``.

    ``custom_api`` is a ``kubernetes.client.CustomObjectsApi`` (the pod's
    service account, or the local kubeconfig, when omitted). The object
    patched is ``<fullname>-runtime-<model>``, as the chart names it; pass
    ``virtual_service`` to name it otherwise. The monitor's Role grants get
    and patch on virtualservices when Istio is enabled.
    """

    name = "kubernetes"

    def __init__(
        self,
        namespace: str,
        release: str,
        scheduler: TrafficTarget | None,
        custom_api=None,
        *,
        virtual_service: Callable[[str], str] | None = None,
    ):
        self.namespace = namespace
        self.scheduler = scheduler
        fullname = chart_fullname(release)
        self.virtual_service = virtual_service or (lambda model: f"{fullname}-runtime-{model}")
        if custom_api is None:
            custom_api = _custom_objects_api()
        self.api = custom_api

    async def _call(self, what: str, fn, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException

        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as exc:
            message = f"Kubernetes API: {what}: {exc.status} {exc.reason}"
            if exc.status == 404:
                raise NotFound(message) from None
            status = {403: Status.PERMISSION_DENIED, 409: Status.ALREADY_EXISTS}.get(exc.status, Status.UNAVAILABLE)
            raise AIWorksError(message, status) from None
        except OSError as exc:
            raise Unavailable(f"Kubernetes API unreachable ({what}): {exc}") from None

    async def _get(self, name: str) -> dict:
        return await self._call(
            f"get virtualservice {name}",
            self.api.get_namespaced_custom_object,
            ISTIO_GROUP, ISTIO_VERSION, self.namespace, VIRTUAL_SERVICES, name,
        )  # fmt: skip

    async def set_split(self, model: str, stable: str, canary: str, canary_weight: int) -> None:
        name = self.virtual_service(model)
        for attempt in range(3):
            current = await self._get(name)
            spec = set_route_weights(current.get("spec", {}), canary_weight)
            # resourceVersion makes the patch conditional: a concurrent edit answers 409 and we read again.
            body = {"metadata": {"resourceVersion": current.get("metadata", {}).get("resourceVersion")}, "spec": spec}
            if body["metadata"]["resourceVersion"] is None:
                del body["metadata"]
            try:
                await self._call(
                    f"patch virtualservice {name}",
                    self.api.patch_namespaced_custom_object,
                    ISTIO_GROUP, ISTIO_VERSION, self.namespace, VIRTUAL_SERVICES, name, body,
                )  # fmt: skip
                break
            except AIWorksError as exc:
                if exc.status is not Status.ALREADY_EXISTS or attempt == 2:
                    raise
                log.info("virtualservice %s changed while patching it; reading it again", name)
        log.info("virtualservice %s: stable %d%%, canary %d%%", name, 100 - canary_weight, canary_weight)
        if self.scheduler is not None:
            await self.scheduler.set_split(model, stable, canary, canary_weight)

    async def weights(self, model: str) -> dict[str, int]:
        if self.scheduler is not None:
            return await self.scheduler.weights(model)
        return {}

    async def subset_weights(self, model: str) -> dict[str, int]:
        """``{"stable": w, "canary": w}`` as the VirtualService's first stable route has them."""
        spec = (await self._get(self.virtual_service(model))).get("spec", {})
        for route in spec.get("http", []):
            found = {d["destination"].get("subset"): int(d.get("weight", 0)) for d in route.get("route", [])}
            if STABLE_SUBSET in found:
                return found
        return {}

    async def serving_version(self, model: str) -> str:
        if self.scheduler is None:
            raise _precondition("without the scheduler the stable version must be given (--from)")
        return await self.scheduler.serving_version(model)

    async def ready_versions(self, model: str) -> list[str]:
        if self.scheduler is None:
            return []
        return await self.scheduler.ready_versions(model)

    async def close(self) -> None:
        if self.scheduler is not None:
            await self.scheduler.close()


def _custom_objects_api():
    """CustomObjectsApi with the pod's service account, or the local kubeconfig outside a cluster."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CustomObjectsApi()
