"""Shadow traffic: a copy of live requests goes to a shadow version, whose answers are compared, then discarded.

A model's :class:`~aiworks.scheduler.traffic_state.ShadowPolicy` names the
shadow version, the share of requests mirrored and how answers compare.

- **The client never waits for the shadow.** The copy is queued next to the
  primary request (so it batches with other copies), on its own task; the
  primary's answer goes back as soon as it exists, and the comparison runs
  when both have answered. A request the primary fails is not compared.
- **Bounded.** At most ``max_inflight`` copies per shadow are outstanding;
  beyond that a copy is not made and counts as dropped. Copies queue in the
  batch class, so a full shadow queue sheds them before live requests of
  higher classes, and a copy its queue refuses or sheds counts as dropped too.
  A copy waits at most ``timeout_s``.
- **Sampling** is exact rather than random: with fraction *f* a credit of *f*
  accrues per request and a copy is made whenever it reaches 1, so 0.25
  mirrors every fourth request.

How answers compare (:func:`answers_agree`), per output, all of which must
agree for the request to count as agreed:

- integer, BOOL and BYTES outputs: the same shape and exactly the same bytes;
- floating-point outputs, ``allclose`` (default): the same shape and
  ``|shadow - primary| <= tolerance + tolerance * |primary|`` everywhere;
- floating-point outputs, ``argmax``: for outputs with a class axis (two or
  more dims), the same argmax over the last axis in every row (a classifier's
  decision, not its confidence); one-dim outputs fall back to ``allclose``.

The counts are kept per model, shadow version and comparison (agreement by
argmax and agreement within a tolerance are different measures, so switching
the comparison starts new counts) and shown by ``aiworks traffic show``,
``aiworks status`` and the ``aiworks_scheduler_shadow_*`` metrics.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace

import numpy as np

from aiworks.core.datatypes import Tensor, decode
from aiworks.core.errors import AIWorksError, Status
from aiworks.core.inference import InferRequest
from aiworks.scheduler.traffic_state import ShadowPolicy

log = logging.getLogger(__name__)

_FLOATS = frozenset({"FP16", "FP32", "FP64", "BF16"})

# (the copy, its policy, the time it may take) -> the shadow's outputs
ShadowRunner = Callable[[InferRequest, float], Awaitable[list[Tensor]]]


def answers_agree(primary: list[Tensor], shadow: list[Tensor], compare: str, tolerance: float) -> bool:
    """Whether the shadow's outputs agree with the primary's (see the module docstring)."""
    theirs = {t.name: t for t in shadow}
    if set(theirs) != {t.name for t in primary}:
        return False
    for ours in primary:
        other = theirs[ours.name]
        if ours.datatype != other.datatype or tuple(ours.shape) != tuple(other.shape):
            return False
        if ours.datatype not in _FLOATS:
            if bytes(ours.raw) != bytes(other.raw):
                return False
            continue
        a = decode(ours.raw, ours.datatype, ours.shape).astype(np.float64)
        b = decode(other.raw, other.datatype, other.shape).astype(np.float64)
        if compare == "argmax" and a.ndim >= 2 and a.shape[-1] > 0:
            if not np.array_equal(a.argmax(axis=-1), b.argmax(axis=-1)):
                return False
        elif not np.allclose(b, a, rtol=tolerance, atol=tolerance, equal_nan=True):
            return False
    return True


@dataclass
class ShadowCounts:
    """What happened to the copies sent to one shadow version."""

    model: str
    version: str
    compare: str = "allclose"
    mirrored: int = 0  # requests sampled for the shadow
    compared: int = 0  # both answered; compared
    agreed: int = 0
    errors: int = 0  # the shadow failed (or timed out)
    dropped: int = 0  # not run: the bound was reached, or the shadow's queue refused or shed it
    inflight: int = 0

    @property
    def agreement(self) -> float:
        return self.agreed / self.compared if self.compared else 0.0


@dataclass
class ShadowView:
    """One shadow's counts as ``aiworks status`` shows them."""

    model: str
    shadow_version: str
    active: bool
    mirrored: int
    compared: int
    agreed: int
    errors: int
    dropped: int
    agreement: float
    inflight: int
    compare: str


@dataclass(eq=False)
class ShadowCopy:
    """A copy on its way: the comparison happens once the primary's outputs are known too."""

    counts: ShadowCounts
    policy: ShadowPolicy
    task: asyncio.Task | None = None
    primary: list[Tensor] | None = None
    primary_done: bool = False
    shadow: list[Tensor] | None = None
    shadow_done: bool = False
    _settled: bool = field(default=False, repr=False)


class ShadowMirror:
    """Starts copies for the shadows in force, bounds them, and keeps their counts."""

    def __init__(self, run: ShadowRunner, *, max_inflight: int = 64, timeout_s: float = 10.0):
        self._run = run
        self.max_inflight = max_inflight
        self.timeout_s = timeout_s
        self.counts: dict[tuple[str, str, str], ShadowCounts] = {}  # (model, version, compare)
        self._credit: dict[str, float] = {}

    def _counts(self, model: str, policy: ShadowPolicy) -> ShadowCounts:
        key = (model, policy.version, policy.compare)
        counts = self.counts.get(key)
        if counts is None:
            counts = self.counts[key] = ShadowCounts(model, policy.version, policy.compare)
        return counts

    def _sampled(self, model: str, fraction: float) -> bool:
        if fraction >= 1.0:
            return True
        credit = self._credit.get(model, 0.0) + fraction
        if credit >= 1.0 - 1e-9:
            self._credit[model] = credit - 1.0
            return True
        self._credit[model] = credit
        return False

    def begin(self, policy: ShadowPolicy | None, request: InferRequest, primary_version: str) -> ShadowCopy | None:
        """Mirror ``request`` if a shadow applies and is sampled; None when no copy is made."""
        if policy is None or policy.version == primary_version:
            return None
        if not self._sampled(request.model, policy.fraction):
            return None
        counts = self._counts(request.model, policy)
        counts.mirrored += 1
        if counts.inflight >= self.max_inflight:
            counts.dropped += 1
            return None
        counts.inflight += 1
        copy = ShadowCopy(counts, policy)
        shadow_request = replace(request, version=policy.version, id=f"{request.id}~shadow" if request.id else "")
        # A fresh context: the copy belongs to no client's trace.
        copy.task = asyncio.get_running_loop().create_task(
            self._run(shadow_request, self.timeout_s), context=contextvars.Context()
        )
        copy.task.add_done_callback(lambda task, c=copy: self._shadow_done(c, task))
        return copy

    def finish(self, copy: ShadowCopy | None, primary: list[Tensor] | None) -> None:
        """The primary answered (``primary``), or failed (None): compare when the shadow is done too."""
        if copy is None:
            return
        copy.primary, copy.primary_done = primary, True
        self._settle(copy)

    def _shadow_done(self, copy: ShadowCopy, task: asyncio.Task) -> None:
        counts = copy.counts
        counts.inflight -= 1
        copy.shadow_done = True
        if task.cancelled():
            counts.errors += 1
        else:
            exc = task.exception()
            if exc is None:
                copy.shadow = task.result()
            elif isinstance(exc, AIWorksError) and exc.status is Status.RESOURCE_EXHAUSTED:
                counts.dropped += 1
            else:
                counts.errors += 1
                log.debug("shadow %s/%s failed: %s", counts.model, counts.version, exc)
        self._settle(copy)

    def _settle(self, copy: ShadowCopy) -> None:
        if copy._settled or not (copy.primary_done and copy.shadow_done):
            return
        copy._settled = True
        if copy.primary is None or copy.shadow is None:
            return
        counts = copy.counts
        counts.compared += 1
        try:
            agreed = answers_agree(copy.primary, copy.shadow, copy.policy.compare, copy.policy.tolerance)
        except Exception as exc:  # undecodable output: a disagreement, not a crash of the callback
            log.warning("shadow comparison of %s/%s failed: %s", counts.model, counts.version, exc)
            agreed = False
        if agreed:
            counts.agreed += 1

    def views(self, active: dict[str, ShadowPolicy]) -> list[ShadowView]:
        """Every shadow with counts, and those in force (``active``: model -> policy) even before their first copy."""
        keys = set(self.counts) | {(m, p.version, p.compare) for m, p in active.items()}
        out = []
        for model, version, compare in sorted(keys):
            c = self.counts.get((model, version, compare)) or ShadowCounts(model, version, compare)
            policy = active.get(model)
            out.append(
                ShadowView(
                    model=model,
                    shadow_version=version,
                    active=policy is not None and policy.version == version and policy.compare == compare,
                    mirrored=c.mirrored,
                    compared=c.compared,
                    agreed=c.agreed,
                    errors=c.errors,
                    dropped=c.dropped,
                    agreement=c.agreement,
                    inflight=c.inflight,
                    compare=c.compare,
                )
            )
        return out
