"""Which sequences of one stateful model version this replica holds, and where: pure state, an injectable clock.

Triton's sequence batcher, as its docs/user_guide/architecture.md describes it:

- Each instance of the model has *slots*: ``max_batch_size`` of them (at
  least one) with the ``direct`` strategy, ``max_candidate_sequences`` with
  ``oldest``. A request that starts a sequence takes a free slot (on the
  instance with the fewest sequences, its lowest free slot); when none is
  free the sequence waits in the *backlog* until one is, and when the
  backlog is full too the request is refused (429: more live sequences than
  the model allows here).
- Every request of a sequence goes to its slot, in arrival order. A request
  that is not a start for a sequence this table does not know is refused
  with Triton's words ("must specify the START flag on the first request of
  the sequence"). A start for a sequence already live restarts it in place.
- A request with the end flag makes the id free for a new sequence at once;
  the slot is freed once that request has run, and given to the oldest
  sequence of the backlog.
- A sequence with no request for ``idle_s`` (``max_sequence_idle_microseconds``)
  and none waiting or running is released, its state with it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from aiworks.core.errors import AIWorksError, ResourceExhausted, Status
from aiworks.core.options import SequenceRef


def not_started(sequence_id, model: str) -> AIWorksError:
    """A request that is not a start, for a sequence this replica does not hold.

    FAILED_PRECONDITION between the services: the gateway may find the
    sequence on another replica, and tells its client 400 (Triton's answer)
    when none holds it.
    """
    return AIWorksError(
        f"inference request for sequence {sequence_id} to model '{model}' must specify the START flag on the first "
        "request of the sequence",
        Status.FAILED_PRECONDITION,
    )


@dataclass(eq=False, slots=True)
class Sequence:
    """One live sequence: where it runs, its requests waiting in order, and its implicit state."""

    id: int | str
    instance: int | None = None  # None while in the backlog
    slot: int | None = None
    queue: deque = field(default_factory=deque)  # its requests not yet run, oldest first
    running: bool = False  # one of its requests is in a batch now
    ended: bool = False  # its end request arrived: the id belongs to no one now
    state: dict = field(default_factory=dict)  # implicit state by input name, after its last request
    last_s: float = 0.0

    @property
    def ready(self) -> bool:
        return self.slot is not None and bool(self.queue) and not self.running


class SequenceTable:
    """The live sequences of one model version on this replica; see the module docstring."""

    def __init__(self, model: str, instances: int, slots_per_instance: int, *, max_backlog: int, idle_s: float,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.model = model
        self.max_backlog = max_backlog
        self.idle_s = idle_s
        self._clock = clock
        self.live: dict[int | str, Sequence] = {}
        self.slots: list[list[Sequence | None]] = [[None] * slots_per_instance for _ in range(max(1, instances))]
        self.backlog: deque[Sequence] = deque()
        self.started = self.ended = self.idled = self.refused = 0

    @property
    def capacity(self) -> int:
        return sum(len(s) for s in self.slots)

    @property
    def count(self) -> int:
        """Sequences holding a slot or waiting for one (ended ones still finishing included)."""
        return sum(1 for row in self.slots for s in row if s is not None) + len(self.backlog)

    def admit(self, ref: SequenceRef) -> Sequence:
        """The sequence a request of ``ref`` joins (its caller queues the request on it); raises the refusal."""
        now = self._clock()
        sequence = self.live.get(ref.id)
        if sequence is None:
            if not ref.start:
                raise not_started(ref.id, self.model)
            sequence = Sequence(ref.id)
            if not self._place(sequence):
                if len(self.backlog) >= self.max_backlog:
                    self.refused += 1
                    raise ResourceExhausted(
                        f"model '{self.model}' holds as many sequences as it allows on this replica "
                        f"({self.capacity} in its slots, {self.max_backlog} waiting); end a sequence or retry later",
                        retry_after_s=1.0,
                    )
                self.backlog.append(sequence)
            self.live[ref.id] = sequence
            self.started += 1
        sequence.last_s = now
        if ref.end:
            sequence.ended = True
            del self.live[ref.id]
            self.ended += 1
        return sequence

    def _place(self, sequence: Sequence) -> bool:
        """Give ``sequence`` a free slot: on the instance with the fewest sequences, its lowest free one."""
        best = None
        for instance, row in enumerate(self.slots):
            free = [i for i, s in enumerate(row) if s is None]
            if free and (best is None or len(free) > best[2]):
                best = (instance, free[0], len(free))
        if best is None:
            return False
        sequence.instance, sequence.slot = best[0], best[1]
        self.slots[best[0]][best[1]] = sequence
        return True

    def done(self, sequence: Sequence) -> list[Sequence]:
        """After one of its requests ran (or left its queue): free an ended, drained sequence's slot.

        Returns the sequences of the backlog that got a slot now (their callers wake their instance).
        """
        if not sequence.ended or sequence.queue or sequence.running:
            return []
        return self._release(sequence)

    def _release(self, sequence: Sequence) -> list[Sequence]:
        if self.live.get(sequence.id) is sequence:
            del self.live[sequence.id]
        sequence.state = {}
        if sequence.slot is None:
            if sequence in self.backlog:
                self.backlog.remove(sequence)
            return []
        self.slots[sequence.instance][sequence.slot] = None
        sequence.slot = None
        placed = []
        while self.backlog:
            waiting = self.backlog[0]
            if not self._place(waiting):
                break
            self.backlog.popleft()
            placed.append(waiting)
        return placed

    def expire_idle(self) -> tuple[list[Sequence], list[Sequence]]:
        """Release sequences idle for ``idle_s`` with nothing queued or running: (released, newly placed)."""
        cutoff = self._clock() - self.idle_s
        released, placed = [], []
        candidates = [s for row in self.slots for s in row if s is not None] + list(self.backlog)
        for sequence in candidates:
            if sequence.last_s <= cutoff and not sequence.queue and not sequence.running:
                self.idled += not sequence.ended
                released.append(sequence)
                placed.extend(self._release(sequence))
        return released, [s for s in placed if s not in released]

    def on_instance(self, instance: int) -> list[Sequence]:
        """The sequences holding a slot of ``instance``, by slot."""
        return [s for s in self.slots[instance] if s is not None]

    def highest_slot(self, instance: int) -> int:
        """The highest occupied slot of ``instance`` (-1 when none): a direct batch has that many rows plus one."""
        row = self.slots[instance]
        return max((i for i, s in enumerate(row) if s is not None), default=-1)
