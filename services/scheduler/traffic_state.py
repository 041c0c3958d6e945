"""Version weights per model (canary releases), applied to requests that name no version.

:class:`TrafficPolicy` is the value a canary controller writes: a model and a
weight per version. :class:`TrafficState` holds the policies in force and picks
a version per request by smooth weighted round robin (as nginx does), so the
split is exact over every window of ``sum(weights)`` requests, not only on
average, and the versions interleave instead of arriving in runs. Versions
without a live replica are left out and the others share their part; with no
weighted version available the caller falls back to the latest version.

A policy may also name a **shadow** version (:class:`ShadowPolicy`): it gets
a copy of live requests, whose answers are compared with the primary's and
discarded (:mod:`aiworks.scheduler.shadow`). Weights and shadow are set
independently: a canary controller that writes weights leaves the shadow an
operator set alone.

Locally the scheduler applies the policy itself; in a mesh the same object is
what gets rendered to VirtualService weights (and a shadow to Istio's
``mirror`` with ``mirrorPercentage``).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from aiworks.core.errors import InvalidArgument

COMPARE_MODES = ("allclose", "argmax")
DEFAULT_TOLERANCE = 1e-4


@dataclass(frozen=True)
class ShadowPolicy:
    """A version that gets a copy of ``fraction`` of the live requests, compared with the primary by ``compare``."""

    version: str
    fraction: float = 1.0
    compare: str = "allclose"
    tolerance: float = DEFAULT_TOLERANCE

    def __post_init__(self):
        if not self.version:
            raise InvalidArgument("a shadow policy needs a version")
        if not (0.0 < self.fraction <= 1.0):
            raise InvalidArgument(f"shadow fraction is {self.fraction}; use a share in (0, 1]")
        if self.compare not in COMPARE_MODES:
            raise InvalidArgument(f"shadow comparison '{self.compare}' is not one of {', '.join(COMPARE_MODES)}")
        if not (self.tolerance >= 0.0 and self.tolerance < float("inf")):
            raise InvalidArgument(f"shadow tolerance is {self.tolerance}; use a finite number, 0 or more")


@dataclass(frozen=True)
class TrafficPolicy:
    """A model's version weights and shadow; neither means "no policy" (the latest version serves)."""

    model: str
    weights: Mapping[str, int] = field(default_factory=dict)
    shadow: ShadowPolicy | None = None

    @property
    def empty(self) -> bool:
        return not self.weights and self.shadow is None

    def __post_init__(self):
        if not self.model:
            raise InvalidArgument("a traffic policy needs a model name")
        for version, weight in self.weights.items():
            if not version:
                raise InvalidArgument("a traffic policy's version must not be empty")
            if isinstance(weight, bool) or not isinstance(weight, int) or weight < 0:
                raise InvalidArgument(f"weight of version {version} is {weight!r}; use a non-negative integer")
        if self.weights and not any(self.weights.values()):
            raise InvalidArgument("at least one version needs a positive weight")
        object.__setattr__(self, "weights", dict(self.weights))

    @classmethod
    def parse(cls, model: str, terms: list[str]) -> TrafficPolicy:
        """From ``["1=90", "2=10"]``, as the command line takes them."""
        weights = {}
        for term in terms:
            version, sep, weight = term.partition("=")
            if not sep or not weight.strip().isdigit():
                raise InvalidArgument(f"'{term}' is not VERSION=WEIGHT (for example 1=90)")
            weights[version.strip()] = int(weight)
        return cls(model, weights)

    def share(self, version: str) -> float:
        """Fraction of the model's requests this version gets when every version is live."""
        total = sum(self.weights.values())
        return self.weights.get(version, 0) / total if total else 0.0


class TrafficState:
    """The traffic policies in force and the round-robin state that applies them."""

    def __init__(self):
        self._policies: dict[str, TrafficPolicy] = {}
        self._current: dict[str, dict[str, int]] = {}

    def set(self, policy: TrafficPolicy) -> TrafficPolicy:
        """Put ``policy`` in force (no weights and no shadow clear the model's policy)."""
        if policy.empty:
            self.clear(policy.model)
            return policy
        old = self._policies.get(policy.model)
        self._policies[policy.model] = policy
        if old is None or dict(old.weights) != dict(policy.weights):
            self._current[policy.model] = {v: 0 for v in policy.weights}
        return policy

    def clear(self, model: str) -> None:
        self._policies.pop(model, None)
        self._current.pop(model, None)

    def get(self, model: str) -> TrafficPolicy | None:
        return self._policies.get(model)

    def shadow(self, model: str) -> ShadowPolicy | None:
        policy = self._policies.get(model)
        return policy.shadow if policy is not None else None

    def policies(self) -> list[TrafficPolicy]:
        return [self._policies[m] for m in sorted(self._policies)]

    def choose(self, model: str, ready: Collection[str]) -> str | None:
        """The version for the next request that names none, among ``ready``; None: no policy applies."""
        policy = self._policies.get(model)
        if policy is None or not policy.weights:
            return None
        current = self._current[model]
        chosen, total = None, 0
        for version, weight in policy.weights.items():
            if weight <= 0 or version not in ready:
                continue
            current[version] += weight
            total += weight
            if chosen is None or current[version] > current[chosen]:
                chosen = version
        if chosen is not None:
            current[chosen] -= total
        return chosen
