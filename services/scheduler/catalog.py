"""Which runtime replicas serve which model versions: the read side, shared by the scheduler and gateways.

The scheduler's :class:`~aiworks.scheduler.registry.ReplicaRegistry` changes
it (registrations, heartbeats, loads, unloads); each gateway keeps a mirror of
it built from the routing table it watches
(:class:`~aiworks.scheduler.mirror.RoutingMirror`). Both answer the same
questions the same way: which version a request gets, which replicas hold it,
and why none does (404 unknown, 503 known but nowhere live or being
unloaded).

Retiring a model version (docs/scheduler.md, "Hot update") adds two marks:

- **closing** keys take no new requests (resolution skips them), while their
  replicas still advertise them: an unload in progress;
- **retiring** keys are no longer advertised by some replica (a reload
  retired them there) but that replica still executes them until its queue of
  them is answered: :meth:`Catalog.holders` still lists it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiworks.core.errors import Unavailable, no_available_version, unknown_model, unknown_version
from aiworks.core.model_config import ModelSpec, ModelState
from aiworks.scheduler.replica_state import ReplicaHealth

Key = tuple[str, str]  # (model, version)


@dataclass
class Replica:
    """One runtime replica, as the scheduler tracks it and as a gateway routes to it."""

    replica_id: str
    address: str
    device: str = "cpu"
    labels: dict[str, str] = field(default_factory=dict)
    models: dict[Key, ModelSpec] = field(default_factory=dict)
    client: object = None  # aiworks.runtime.client.RuntimeClient
    live: bool = True
    stopping: bool = False  # it said so in a heartbeat (the scheduler's): not live until it registers again
    # The scheduler's: its last heartbeat, and the queues and batches it reported.
    last_heartbeat_s: float = 0.0
    beats: int = 0  # heartbeats received since it registered
    inflight_batches: int = 0
    queues: list = field(default_factory=list)
    # The GPUs of a "gpu" replica as of its last heartbeat (GpuInfo fields), for status.
    gpus: list[dict] = field(default_factory=list)
    # Generative versions' KV room (aiworks.scheduler.views.KvRoom by key; None: it reports none) and when it
    # was read (the scheduler: the heartbeat's arrival; a gateway: that, on its own clock, from the table).
    kv: dict | None = None
    kv_at_s: float = 0.0
    # A gateway's: (when, model version, KV tokens) of each generation it sent since the figures were read.
    kv_sent: list = field(default_factory=list)
    # A gateway's: requests it has in flight there, since when it has had some and when it last answered
    # one (a replica that stopped answering is noticed before any timeout), and its health as it sees it.
    outstanding: int = 0
    busy_since_s: float = 0.0
    answered_s: float = 0.0
    health: ReplicaHealth = field(default_factory=ReplicaHealth)

    def __post_init__(self):
        self.health.name = self.replica_id

    def holds(self, key: Key) -> bool:
        spec = self.models.get(key)
        return spec is not None and spec.ready

    def recovering(self, key: Key) -> bool:
        """It advertises ``key`` as LOADING: its backend is coming back (a tritonserver restarting)."""
        spec = self.models.get(key)
        return spec is not None and spec.state is ModelState.LOADING


class Catalog:
    """Replicas keyed by id, the versions they serve, and the versions being retired."""

    def __init__(self):
        self.replicas: dict[str, Replica] = {}
        # Every model version seen, so "known but nowhere live" is UNAVAILABLE, not NOT_FOUND.
        self.known: dict[Key, ModelSpec | None] = {}
        self.closing: set[Key] = set()
        self.retiring: dict[Key, dict[str, ModelSpec]] = {}  # key -> replica id -> the spec it held
        # Versions some replica reports KV room for (generative ones): only these are routed by it.
        self.kv_keys: set[Key] = set()

    def draining(self, key: Key) -> bool:
        return key in self.closing or key in self.retiring

    def spec_on(self, replica: Replica, key: Key) -> ModelSpec | None:
        """The spec of ``key`` on ``replica``: advertised, or retiring there."""
        spec = replica.models.get(key)
        if spec is None:
            spec = self.retiring.get(key, {}).get(replica.replica_id)
        return spec

    # ---- queries -------------------------------------------------------------------------

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.live]

    def holders(self, key: Key) -> list[Replica]:
        """Live replicas that can run ``key``'s requests: those that hold it, and those still retiring it."""
        retiring = self.retiring.get(key, ())
        return [r for r in self.replicas.values() if r.live and (r.holds(key) or r.replica_id in retiring)]

    def recovering(self, key: Key, exclude: frozenset[str] | set[str] = frozenset()) -> list[Replica]:
        """Replicas whose ``key`` is coming back (its backend restarts): its requests wait for them, not fail."""
        return [r for r in self.replicas.values() if r.recovering(key) and r.replica_id not in exclude]

    def advertisers(self, key: Key) -> list[Replica]:
        """Live replicas that hold ``key`` as loaded (retiring ones not included)."""
        return [r for r in self.replicas.values() if r.live and r.holds(key)]

    def resolve(self, model: str, version: str) -> ModelSpec:
        """The spec for a request's model and version (latest ready when version is empty).

        Unknown model or version: NOT_FOUND. Known, but no live replica holds it: UNAVAILABLE.
        """
        live_specs = {
            k: s
            for r in self.live()
            for k, s in r.models.items()
            if k[0] == model and s.ready and k not in self.closing
        }
        if version:
            spec = live_specs.get((model, version)) or self._coming(model).get((model, version))
            if spec is not None:
                return spec
            if (model, version) in self.closing:
                raise Unavailable(f"model '{model}' version {version} is being unloaded")
            if (model, version) in self.known:
                raise Unavailable(f"model '{model}' version {version} has no live replica")
            if any(k[0] == model for k in self.known) or self._listed(model):
                raise unknown_version(model, version)
            raise unknown_model(model)
        candidates = live_specs or self._coming(model)
        if candidates:
            return candidates[max(candidates, key=lambda k: version_order(k[1]))]
        if any(k[0] == model for k in self.closing):
            raise Unavailable(f"model '{model}' is being unloaded")
        if any(k[0] == model for k in self.known):
            raise Unavailable(f"model '{model}' has no live replica")
        if self._listed(model):  # in a replica's repository, not loaded (unloaded, or its load failed)
            raise no_available_version(model, "it is not loaded")
        raise unknown_model(model)

    def _listed(self, model: str) -> bool:
        return any(k[0] == model for r in self.live() for k in r.models)

    def _coming(self, model: str) -> dict[Key, ModelSpec]:
        """Versions of ``model`` coming back (their backend recovers): they take requests, which wait."""
        return {
            k: s
            for r in self.replicas.values()
            for k, s in r.models.items()
            if k[0] == model and s.state is ModelState.LOADING and k not in self.closing
        }

    def versions(self, model: str) -> list[str]:
        found = {
            k[1]
            for r in self.live()
            for k, s in r.models.items()
            if k[0] == model and s.ready and k not in self.closing
        }
        return sorted(found, key=version_order)


def version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)
