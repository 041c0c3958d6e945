"""What runs where: the services, their metrics endpoints and the runtime pools.

The monitor needs one picture whatever the platform: which services exist,
whether each is alive, where its ``/metrics`` is, which runtime replica it
is, and how many replicas each runtime pool should have. The two platform
adapters fetch the raw facts (the supervisor's control API, the Kubernetes
API); the functions here turn them into that picture, so the translation is
tested without either.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

KINDS = ("gateway", "scheduler", "runtime", "cache", "monitor")

# Service states.
RUNNING = "running"
STARTING = "starting"
DEAD = "dead"

# The one runtime pool of a local suite: every runtime serves every model.
LOCAL_POOL = "runtime"

# Labels the Helm chart puts on every object (helm/aiworks/templates/_helpers.tpl).
INSTANCE_LABEL = "app.kubernetes.io/instance"
COMPONENT_LABEL = "app.kubernetes.io/component"
MODEL_LABEL = "aiworks.io/model"
TRACK_LABEL = "version"
PORT_ANNOTATION = "prometheus.io/port"


@dataclass(frozen=True)
class Service:
    """One process (local) or pod (Kubernetes) of the suite."""

    name: str
    kind: str
    state: str = RUNNING
    metrics_address: str | None = None  # host:port of its /metrics
    replica_id: str | None = None  # runtimes: the id it registers with the scheduler
    pool: str | None = None  # runtimes: the pool that scales it
    detail: str = ""  # why it is not running, in words


@dataclass(frozen=True)
class Pool:
    """A set of runtime replicas scaled together."""

    name: str
    desired: int
    models: tuple[str, ...] = ()  # the models it serves; empty: every model


@dataclass(frozen=True)
class Inventory:
    """Services and pools at one moment."""

    services: tuple[Service, ...] = ()
    pools: tuple[Pool, ...] = ()

    def by_target(self) -> dict[str, Service]:
        return {s.metrics_address: s for s in self.services if s.metrics_address}

    def targets(self) -> list[str]:
        return sorted(self.by_target())

    def runtimes(self, pool: str | None = None) -> list[Service]:
        return [s for s in self.services if s.kind == "runtime" and (pool is None or s.pool == pool)]


def from_supervisor(doc: dict[str, Any]) -> Inventory:
    """The inventory from ``GET /v1/services`` of the supervisor's control API."""
    services = []
    for s in doc.get("services", []):
        kind = s["kind"]
        alive = bool(s.get("alive"))
        detail = "" if alive else f"exited with code {s.get('exit_code')}"
        services.append(
            Service(
                name=s["name"],
                kind=kind,
                state=RUNNING if alive else DEAD,
                metrics_address=s.get("metrics_address"),
                replica_id=s.get("replica_id"),
                pool=LOCAL_POOL if kind == "runtime" else None,
                detail=detail,
            )
        )
    desired = int(doc.get("runtime_replicas", sum(1 for s in services if s.kind == "runtime")))
    return Inventory(tuple(services), (Pool(LOCAL_POOL, desired),))


def from_static(terms: Iterable[str]) -> Inventory:
    """A fixed inventory from ``NAME=KIND@HOST:PORT`` terms (HOST:PORT: its /metrics), as docker-compose lists it.

    Nothing here can be restarted or scaled (there is no supervisor to ask), so there are no pools;
    a runtime's replica id is its name. Every service counts as running: the scrape shows a dead one.
    """
    services = []
    for term in terms:
        name, sep, rest = term.strip().partition("=")
        kind, at, address = rest.partition("@")
        host, colon, port = address.rpartition(":")
        if not (sep and at and colon and name and host and port.isdigit()):
            raise ValueError(f"'{term}' is not NAME=KIND@HOST:PORT (for example runtime-1=runtime@runtime-1:8021)")
        if kind not in KINDS:
            raise ValueError(f"'{term}': kind '{kind}' is not one of {', '.join(KINDS)}")
        services.append(
            Service(name=name, kind=kind, metrics_address=address, replica_id=name if kind == "runtime" else None)
        )
    if len({s.name for s in services}) != len(services):
        raise ValueError("a static service is listed twice")
    return Inventory(tuple(services))


def _labels(obj) -> dict[str, str]:
    return dict(obj.metadata.labels or {})


def pod_state(pod) -> tuple[str, str]:
    """(state, detail) of a Kubernetes pod: running when every container is ready."""
    status = pod.status
    phase = (status.phase if status else None) or "Unknown"
    containers = (status.container_statuses if status else None) or []
    for c in containers:
        waiting = c.state.waiting if c.state else None
        if waiting is not None and waiting.reason in ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull"):
            return DEAD, f"container {c.name}: {waiting.reason}"
    if phase in ("Failed", "Unknown", "Succeeded"):
        return DEAD, f"pod phase {phase}"
    if phase == "Running" and containers and all(c.ready for c in containers):
        return RUNNING, ""
    return STARTING, f"pod phase {phase}, not ready"


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def from_kubernetes(pods: Iterable, deployments: Iterable) -> Inventory:
    """The inventory from a release's pods and Deployments (kubernetes client model objects).

    Every runtime Deployment except canary tracks is a pool (canary rollouts
    own their replica count). A pod's metrics endpoint is its IP and its
    ``prometheus.io/port`` annotation, as a Prometheus pod scrape would see it.
    """
    pools: list[Pool] = []
    selectors: list[tuple[str, dict[str, str]]] = []
    for d in deployments:
        labels = _labels(d)
        if labels.get(COMPONENT_LABEL) != "runtime" or labels.get(TRACK_LABEL) == "canary":
            continue
        model = labels.get(MODEL_LABEL)
        pools.append(Pool(d.metadata.name, int(d.spec.replicas or 0), (model,) if model else ()))
        selectors.append((d.metadata.name, dict(d.spec.selector.match_labels or {})))
    services = []
    for pod in pods:
        if pod.metadata.deletion_timestamp is not None:
            continue  # already going; its replacement is what counts
        labels = _labels(pod)
        kind = labels.get(COMPONENT_LABEL)
        if kind not in KINDS:
            continue
        state, detail = pod_state(pod)
        port = (pod.metadata.annotations or {}).get(PORT_ANNOTATION)
        ip = pod.status.pod_ip if pod.status else None
        pool = next((name for name, sel in selectors if _selects(sel, labels)), None) if kind == "runtime" else None
        services.append(
            Service(
                name=pod.metadata.name,
                kind=kind,
                state=state,
                metrics_address=f"{ip}:{port}" if ip and port else None,
                replica_id=pod.metadata.name if kind == "runtime" else None,  # AIWORKS_RUNTIME_REPLICA_ID=$(POD_NAME)
                pool=pool,
                detail=detail,
            )
        )
    return Inventory(tuple(services), tuple(pools))
