"""A request's options besides its tensors: its class of service, deadline, tenant and id.

They are read once, at the gateway, from the Open Inference Protocol's
parameters, the tenant and the headers (:func:`read_options`), and travel to
the runtime as typed fields of ``aiworks.runtime.v1.RequestOptions``
(:func:`to_wire`, :func:`from_wire`): no hop parses a parameter again.

Clients use Triton's conventions, so tritonclient works unchanged:

- ``priority``: an integer where a lower value is more urgent, 0 meaning the
  default. The suite has three classes: 1 is ``realtime``, 2 ``standard``,
  3 (and anything larger) ``batch``. The names are accepted as strings too.
- ``timeout``: the time the request may take, in microseconds (Triton's
  extension of the protocol); 0 means no timeout.
- ``sequence_id`` (a uint64, or a string; 0 and "" mean none),
  ``sequence_start`` and ``sequence_end`` (bools): the request's place in a
  sequence of a stateful model (:class:`SequenceRef`).

The deadline is kept as a point on this process's monotonic clock; on the
wire it is the time left, in microseconds, since clocks of different
processes (and hosts) do not agree.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass

from aiworks.core.errors import InvalidArgument

# Longest timeout accepted, in microseconds (a day): larger values are a client's mistake, not a deadline.
MAX_TIMEOUT_US = 86_400 * 10**6


class Priority(enum.IntEnum):
    """Classes of service, most urgent first (the value is the rank)."""

    REALTIME = 0
    STANDARD = 1
    BATCH = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @property
    def level(self) -> int:
        """Triton's priority level of the class: 1 realtime, 2 standard, 3 batch."""
        return int(self) + 1

    @classmethod
    def named(cls, name: str) -> Priority:
        return cls[name.upper()]

    @classmethod
    def from_level(cls, level: int) -> Priority:
        """The class of a Triton level as it travels (0: standard; 3 and above: batch)."""
        return _TRITON_LEVELS.get(level, Priority.BATCH) if level > 0 else Priority.STANDARD


# Triton's integer levels (1 is the highest) onto the suite's classes.
_TRITON_LEVELS = {1: Priority.REALTIME, 2: Priority.STANDARD, 3: Priority.BATCH}
_PRIORITY_HELP = "use 1/realtime, 2/standard or 3/batch"


def parse_priority(value) -> Priority | None:
    """The class a ``priority`` parameter names; None for 0 or absent (the default applies)."""
    if value is None or value == "" or value == 0:
        return None
    if isinstance(value, bool):
        raise InvalidArgument(f"parameter 'priority' must be an integer or a class name; {_PRIORITY_HELP}")
    if isinstance(value, str):
        text = value.strip().lower()
        if len(text) > 16:
            raise InvalidArgument(f"parameter 'priority' is too long ({len(text)} characters); {_PRIORITY_HELP}")
        if text.isascii() and text.isdigit():
            return parse_priority(int(text))
        try:
            return Priority.named(text)
        except KeyError:
            raise InvalidArgument(f"parameter 'priority' is {value!r}; {_PRIORITY_HELP}") from None
    if isinstance(value, int) and value > 0:
        return _TRITON_LEVELS.get(value, Priority.BATCH)
    raise InvalidArgument(f"parameter 'priority' is {str(value)[:32]!r}; {_PRIORITY_HELP}")


def parse_timeout_us(value) -> int:
    """Microseconds a ``timeout`` parameter allows; 0 for 0 or absent (no deadline)."""
    if value is None or value == "":
        return 0
    if isinstance(value, str):
        text = value.strip()
        if not (text.isascii() and text.isdigit()) or len(text) > 20:
            raise InvalidArgument(f"parameter 'timeout' is {value[:32]!r}; it is microseconds, a non-negative integer")
        value = int(text)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidArgument(
            f"parameter 'timeout' is {str(value)[:32]!r}; it is microseconds, a non-negative integer"
        )
    if value > MAX_TIMEOUT_US:
        raise InvalidArgument(f"parameter 'timeout' is {value} microseconds; the most accepted is {MAX_TIMEOUT_US}")
    return value


# OIP request parameters the gateway consumes; the others travel to the runtime for the model
# (aiworks.runtime.v1.InferRequest.parameters): sequence flags, sampling settings.
GATEWAY_PARAMETERS = frozenset(
    {"priority", "timeout", "binary_data_output", "sequence_id", "sequence_start", "sequence_end", "async"}
)
# Response parameter of a ``batch``-class answer (a bool): online requests were queued on the runtime's model
# version, or one arrived within its online window, when the answer's batch ended. A batch client (the runner's
# pacer, aiworks.batch.pacing) backs off on it; the gateway passes it through, and only it, to the caller.
ONLINE_LOAD = "online_load"
# Longest string correlation id accepted: ids are keys of per-replica tables, not payloads.
MAX_SEQUENCE_ID_CHARS = 256


@dataclass(frozen=True, slots=True)
class SequenceRef:
    """A request's sequence: its correlation id (an int in 1..2**64-1, or a non-empty string) and flags."""

    id: int | str
    start: bool = False
    end: bool = False


def _flag(parameters: dict, name: str) -> bool:
    value = parameters.get(name, False)
    if not isinstance(value, bool):
        raise InvalidArgument(f"invalid value type for '{name}' parameter, expected bool_param.")
    return value


def parse_sequence(parameters: dict) -> SequenceRef | None:
    """The sequence ``sequence_id``/``sequence_start``/``sequence_end`` name; None without an id (0 or "").

    An int64 id below 0 is the uint64 of the same bits, as Triton reads it.
    """
    value = parameters.get("sequence_id")
    if value is None or value == 0 or value == "":
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument("invalid value type for 'sequence_id' parameter, expected int64_param or string_param.")
    if isinstance(value, int):
        if -(2**63) <= value < 0:
            value += 2**64
        elif value >= 2**64 or value < 0:
            raise InvalidArgument(f"parameter 'sequence_id' is {str(value)[:32]}; a correlation id is a uint64")
    elif len(value) > MAX_SEQUENCE_ID_CHARS:
        raise InvalidArgument(
            f"parameter 'sequence_id' is a string of {len(value)} characters; at most {MAX_SEQUENCE_ID_CHARS} "
            "are accepted"
        )
    return SequenceRef(value, _flag(parameters, "sequence_start"), _flag(parameters, "sequence_end"))


@dataclass(slots=True)
class RequestOptions:
    """What the services need of a request besides its tensors; see the module docstring."""

    priority: Priority = Priority.STANDARD
    # On this process's monotonic clock; None: no deadline.
    deadline_s: float | None = None
    tenant: str = ""
    request_id: str = ""
    # The class asked for was more urgent than the tenant's ceiling, which applies instead.
    clamped: bool = False
    # The request's place in a sequence (a stateful model's); None outside one.
    sequence: SequenceRef | None = None

    def remaining_s(self, now_s: float | None = None) -> float | None:
        """Seconds left until the deadline (may be negative); None without one."""
        if self.deadline_s is None:
            return None
        return self.deadline_s - (time.monotonic() if now_s is None else now_s)

    def timeout_us(self, now_s: float | None = None) -> int:
        """The time left as it travels: whole microseconds, at least 1 while a deadline exists; 0 without one."""
        left = self.remaining_s(now_s)
        if left is None:
            return 0
        return max(1, round(left * 1e6))


def read_options(
    parameters: dict, *, default: Priority, ceiling: Priority | None = None, tenant: str = "", request_id: str = "",
    transport_deadline_s: float | None = None, now_s: float | None = None,
) -> RequestOptions:  # fmt: skip
    """Options from OIP ``parameters``: the class (or ``default``), capped at ``ceiling``, and the deadline.

    ``ceiling`` is the most urgent class the tenant may use: a request asking
    for more is served at the ceiling (``clamped``). ``transport_deadline_s`` is a gRPC
    deadline's time left; the earlier of it and ``timeout`` wins. Bad values
    are INVALID_ARGUMENT naming the parameter.
    """
    if parameters and parameters.get("async") is True:
        # The HTTP infer route takes the flag out and queues the request (aiworks.nearline.body); here it
        # came some other way (gRPC, generate): refused rather than answered synchronously without a word.
        raise InvalidArgument(
            "parameter 'async' asks for an asynchronous request; only POST /v2/models/{model}/infer queues them"
        )
    asked = parse_priority(parameters.get("priority")) if parameters else None
    priority = default if asked is None else asked
    clamped = False
    if ceiling is not None and priority < ceiling:
        priority = ceiling
        clamped = asked is not None  # the client is told only when the class it named was lowered
    timeout_us = parse_timeout_us(parameters.get("timeout")) if parameters else 0
    now = time.monotonic() if now_s is None else now_s
    lefts = [t for t in (timeout_us / 1e6 if timeout_us else None, transport_deadline_s) if t is not None]
    deadline = now + min(lefts) if lefts else None
    sequence = parse_sequence(parameters) if parameters and "sequence_id" in parameters else None
    return RequestOptions(priority, deadline, tenant, request_id, clamped, sequence)
