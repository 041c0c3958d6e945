"""The Kubernetes adapter of the monitor's :class:`~aiworks.monitor.platform.Platform`.

Deliberately thin: list the release's pods and runtime Deployments, delete a
pod (its Deployment starts a new one: the restart), and patch a Deployment's
``scale`` subresource. Everything it reads is turned into the monitor's
inventory by :func:`aiworks.monitor.discovery.from_kubernetes`. The
``kubernetes`` client is synchronous, so each call runs in a worker thread.
The Role in ``helm/aiworks/templates/monitor.yaml`` grants exactly these verbs.
"""

from __future__ import annotations

import asyncio
import logging

from aiworks.core.errors import AIWorksError, Status, Unavailable
from aiworks.monitor.discovery import COMPONENT_LABEL, INSTANCE_LABEL, Inventory, Service, from_kubernetes
from aiworks.monitor.platform import EjectResult, Platform, SchedulerEjector

log = logging.getLogger(__name__)


def _api_clients():
    """CoreV1Api and AppsV1Api with the pod's service account, or the local kubeconfig outside a cluster."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.CoreV1Api(), client.AppsV1Api()


class KubernetesPlatform(Platform):
    """The pods and Deployments of one Helm release in one namespace."""

    name = "kubernetes"

    def __init__(self, namespace: str, release: str, ejector: SchedulerEjector, core_api=None, apps_api=None):
        self.namespace = namespace
        self.release = release
        self.ejector = ejector
        if core_api is None or apps_api is None:
            core_api, apps_api = _api_clients()
        self.core = core_api
        self.apps = apps_api

    async def _call(self, what: str, fn, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException

        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except ApiException as exc:
            status = {404: Status.NOT_FOUND, 403: Status.PERMISSION_DENIED, 409: Status.ALREADY_EXISTS}.get(
                exc.status, Status.UNAVAILABLE
            )
            raise AIWorksError(f"Kubernetes API: {what}: {exc.status} {exc.reason}", status) from None
        except OSError as exc:
            raise Unavailable(f"Kubernetes API unreachable ({what}): {exc}") from None

    async def inventory(self) -> Inventory:
        selector = f"{INSTANCE_LABEL}={self.release}"
        pods = await self._call("list pods", self.core.list_namespaced_pod, self.namespace, label_selector=selector)
        deployments = await self._call(
            "list deployments",
            self.apps.list_namespaced_deployment,
            self.namespace,
            label_selector=f"{selector},{COMPONENT_LABEL}=runtime",
        )
        return from_kubernetes(pods.items, deployments.items)

    async def restart(self, service: Service) -> str:
        await self._call(f"delete pod {service.name}", self.core.delete_namespaced_pod, service.name, self.namespace)
        return f"deleted pod {service.name}; its Deployment replaces it"

    async def scale(self, pool: str, replicas: int) -> None:
        await self._call(
            f"scale deployment {pool}",
            self.apps.patch_namespaced_deployment_scale,
            pool,
            self.namespace,
            {"spec": {"replicas": replicas}},
        )

    async def eject(self, replica_id: str, duration_s: float, reason: str) -> EjectResult:
        return await self.ejector.eject(replica_id, duration_s, reason)

    async def close(self) -> None:
        await self.ejector.close()
