"""Which runtime replicas exist, what they hold, and how busy they are.

Retiring a model version (docs/scheduler.md, "Hot update") adds two marks:

- **closing** keys take no new requests (resolution skips them), while their
  replicas still advertise them: an unload in progress;
- **retiring** keys are no longer advertised by some replica (a reload
  retired them there) but that replica still executes them until the
  scheduler has drained their queue: :meth:`holders` keeps routing the
  queue's batches to it. A key that vanishes from a replica while it is
  protected (:meth:`guard`, from the start of a reload until the key is
  released) or closing becomes retiring, whether the runtime's heartbeat or
  the load's answer tells first, and also when a heartbeat sent before the
  reload arrives after it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from collections.abc import Callable

from aiworks.core.errors import NotFound, Unavailable
from aiworks.core.model_config import ModelSpec, ModelState
from aiworks.scheduler.replica_state import ReplicaHealth

log = logging.getLogger(__name__)

Key = tuple[str, str]  # (model, version)


@dataclass
class Replica:
    """One runtime replica as the scheduler tracks it."""

    replica_id: str
    address: str
    device: str = "cpu"
    labels: dict[str, str] = field(default_factory=dict)
    models: dict[Key, ModelSpec] = field(default_factory=dict)
    client: object = None
    last_heartbeat_s: float = 0.0
    live: bool = True
    outstanding_batches: dict[Key, int] = field(default_factory=dict)
    outstanding_rows: int = 0
    # Ejection state and latency averages (the router's view; see replica_state.py).
    health: ReplicaHealth = field(default_factory=ReplicaHealth)
    # The GPUs of a "gpu" replica as of its last heartbeat (GpuInfo fields), for status.
    gpus: list[dict] = field(default_factory=list)

    def __post_init__(self):
        self.health.name = self.replica_id

    def holds(self, key: Key) -> bool:
        spec = self.models.get(key)
        return spec is not None and spec.ready

    def recovering(self, key: Key) -> bool:
        """It advertises ``key`` as LOADING: its backend is coming back (a tritonserver restarting)."""
        spec = self.models.get(key)
        return spec is not None and spec.state is ModelState.LOADING


class ReplicaRegistry:
    """Replicas keyed by id, plus the catalog of model versions they serve.

    ``clock`` is injectable so tests can drive heartbeat expiry without sleeping.
    """

    def __init__(self, connect: Callable[[str], object], *, clock: Callable[[], float] = time.monotonic):
        self._connect = connect
        self._clock = clock
        self.replicas: dict[str, Replica] = {}
        # Every model version seen, so "known but nowhere live" is UNAVAILABLE, not NOT_FOUND.
        self.known: dict[Key, ModelSpec] = {}
        self.changed = asyncio.Condition()
        self.closing: set[Key] = set()
        self.retiring: dict[Key, dict[str, ModelSpec]] = {}  # key -> replica id -> the spec it held
        self.protected: set[Key] = set()  # keys of models being reloaded, until released

    # ---- membership ----------------------------------------------------------------------

    def register(
        self, replica_id: str, address: str, device: str, labels: dict, specs: list[ModelSpec], gpus: list[dict] = ()
    ) -> Replica:
        old = self.replicas.get(replica_id)
        if old is not None and old.address == address:
            replica = old
        else:
            if old is not None:
                self._close(old)
            replica = Replica(replica_id, address, device, dict(labels), client=self._connect(address))
            self.replicas[replica_id] = replica
            log.info("replica %s registered at %s (%s)", replica_id, address, device)
        replica.device, replica.labels, replica.live = device, dict(labels), True
        replica.gpus = list(gpus)
        replica.last_heartbeat_s = self._clock()
        self.set_models(replica, specs)
        return replica

    def heartbeat(self, replica_id: str, specs: list[ModelSpec], gpus: list[dict] = ()) -> bool:
        replica = self.replicas.get(replica_id)
        if replica is None:
            return False
        replica.gpus = list(gpus)
        replica.last_heartbeat_s = self._clock()
        if not replica.live:
            log.info("replica %s is back", replica_id)
        replica.live = True
        self.set_models(replica, specs)
        return True

    def set_models(self, replica: Replica, specs: list[ModelSpec]) -> None:
        old = replica.models
        replica.models = {(s.name, s.version): s for s in specs}
        for key, spec in old.items():
            if key not in replica.models and spec.ready and (key in self.closing or key in self.protected):
                self.retiring.setdefault(key, {})[replica.replica_id] = spec
        for key in replica.models:  # loaded again: it is served as usual
            held = self.retiring.get(key)
            if held is not None and held.pop(replica.replica_id, None) is not None and not held:
                del self.retiring[key]
        for s in specs:
            self.known[(s.name, s.version)] = s
        self._notify()

    # ---- retiring versions ---------------------------------------------------------------

    def guard(self, model: str) -> set[Key]:
        """A reload of ``model`` starts: versions it retires stay routable until released; returns them."""
        keys = {k for r in self.live() for k, s in r.models.items() if k[0] == model and s.ready}
        self.protected |= keys
        return keys

    def close(self, keys) -> None:
        """``keys`` take no new requests from now on (their queued and running batches still run)."""
        self.closing.update(keys)

    def release(self, keys) -> None:
        """Draining ``keys`` is over: forget the closing and retiring marks."""
        for key in keys:
            self.closing.discard(key)
            self.protected.discard(key)
            self.retiring.pop(key, None)
        self._notify()

    def draining(self, key: Key) -> bool:
        return key in self.closing or key in self.retiring

    def spec_on(self, replica: Replica, key: Key) -> ModelSpec | None:
        """The spec of ``key`` on ``replica``: advertised, or retiring there."""
        spec = replica.models.get(key)
        if spec is None:
            spec = self.retiring.get(key, {}).get(replica.replica_id)
        return spec

    def mark_down(self, replica: Replica, why: str) -> None:
        if replica.live:
            log.warning("replica %s marked down: %s", replica.replica_id, why)
        replica.live = False
        self._notify()

    def expire(self, timeout_s: float) -> list[str]:
        """Remove replicas whose last heartbeat is older than ``timeout_s``."""
        now = self._clock()
        gone = [r for r in self.replicas.values() if now - r.last_heartbeat_s > timeout_s]
        for replica in gone:
            log.warning(
                "replica %s removed: no heartbeat for %.1f s", replica.replica_id, now - replica.last_heartbeat_s
            )
            del self.replicas[replica.replica_id]
            self._close(replica)
        if gone:
            self._notify()
        return [r.replica_id for r in gone]

    def forget_model(self, name: str) -> None:
        for key in [k for k in self.known if k[0] == name]:
            del self.known[key]

    def _close(self, replica: Replica) -> None:
        close = getattr(replica.client, "close", None)
        if close is not None:
            asyncio.ensure_future(close())

    def _notify(self) -> None:
        async def notify():
            async with self.changed:
                self.changed.notify_all()

        try:
            asyncio.get_running_loop().create_task(notify())
        except RuntimeError:  # no loop (unit tests of pure logic)
            pass

    # ---- queries -------------------------------------------------------------------------

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.live]

    def holders(self, key: Key) -> list[Replica]:
        """Live replicas that can run ``key``'s batches: those that hold it, and those still retiring it."""
        retiring = self.retiring.get(key, ())
        return [r for r in self.replicas.values() if r.live and (r.holds(key) or r.replica_id in retiring)]

    def recovering(self, key: Key, exclude: frozenset[str] | set[str] = frozenset()) -> list[Replica]:
        """Replicas still registered (live, or marked down since their last heartbeat) whose ``key`` is
        coming back: requests for it wait in the queue instead of failing."""
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
            if any(k[0] == model for k in self.known):
                raise NotFound(f"model '{model}' has no version '{version}'")
            raise NotFound(f"unknown model '{model}'")
        candidates = live_specs or self._coming(model)
        if candidates:
            return candidates[max(candidates, key=lambda k: _version_order(k[1]))]
        if any(k[0] == model for k in self.closing):
            raise Unavailable(f"model '{model}' is being unloaded")
        if any(k[0] == model for k in self.known):
            raise Unavailable(f"model '{model}' has no live replica")
        raise NotFound(f"unknown model '{model}'")

    def _coming(self, model: str) -> dict[Key, ModelSpec]:
        """Versions of ``model`` coming back (their backend recovers): they take requests, which queue."""
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
        return sorted(found, key=_version_order)


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (-1, version)
