"""A request's class of service: its priority and its deadline, read from OIP parameters.

Clients use Triton's conventions, so tritonclient works unchanged:

- ``priority``: an integer where a lower value is more urgent, 0 meaning the
  default. The suite has three classes: 1 is ``realtime``, 2 ``standard``,
  3 (and anything larger) ``batch``. The names are accepted as strings too.
- ``timeout``: the time the request may take, in microseconds (Triton's
  extension of the protocol); 0 means no timeout.

A request that names no class gets its tenant's default once tenancy exists
(:class:`ClassResolver`'s ``tenant_default`` seam), else the scheduler's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from aiworks.core.errors import InvalidArgument
from aiworks.core.inference import InferRequest


class Priority(enum.IntEnum):
    """Classes of service, most urgent first (the value is the rank)."""

    REALTIME = 0
    STANDARD = 1
    BATCH = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def named(cls, name: str) -> Priority:
        return cls[name.upper()]


# Triton's integer levels (1 is the highest) onto the suite's classes.
_TRITON_LEVELS = {1: Priority.REALTIME, 2: Priority.STANDARD, 3: Priority.BATCH}


def parse_priority(value) -> Priority | None:
    """The class a ``priority`` parameter names; None for 0 or absent (the default applies)."""
    if value is None or value == "" or value == 0:
        return None
    if isinstance(value, bool):
        raise InvalidArgument("parameter 'priority' must be an integer or realtime, standard or batch")
    if isinstance(value, str):
        text = value.strip().lower()
        if _is_small_integer(text):
            return parse_priority(int(text))
        try:
            return Priority.named(text)
        except KeyError:
            raise InvalidArgument(
                f"parameter 'priority' is {value[:40]!r}; use 1/realtime, 2/standard or 3/batch"
            ) from None
    if isinstance(value, int) and value > 0:
        return _TRITON_LEVELS.get(value, Priority.BATCH)
    raise InvalidArgument(f"parameter 'priority' is {str(value)[:40]!r}; use 1/realtime, 2/standard or 3/batch")


MAX_TIMEOUT_US = 2**64 - 1  # Triton's timeout is a uint64 of microseconds


def _is_small_integer(text: str) -> bool:
    """ASCII digits only (``str.isdigit`` also takes ``"²"``, which ``int`` refuses), and few enough for ``int``."""
    return text.isascii() and text.isdigit() and len(text) <= 20


def parse_timeout_s(value) -> float | None:
    """Seconds a ``timeout`` parameter (microseconds) allows; None for 0 or absent."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and _is_small_integer(value.strip()):
        value = int(value)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not 0 <= value <= MAX_TIMEOUT_US  # NaN fails this too
    ):
        raise InvalidArgument(
            f"parameter 'timeout' is {str(value)[:40]!r}; it is microseconds, an integer from 0 to 2^64-1"
        )
    return value / 1e6 if value else None


class ClassResolver:
    """Decides a request's class: its own ``priority``, else its tenant's default, else the scheduler's.

    ``tenant_default`` is the seam for the tenancy layer: a function from the
    request to its tenant's default class, or None when it has none.
    """

    def __init__(self, default: Priority, tenant_default: Callable[[InferRequest], Priority | None] | None = None):
        self.default = default
        self.tenant_default = tenant_default

    def priority(self, request: InferRequest) -> Priority:
        named = parse_priority(request.parameters.get("priority"))
        if named is not None:
            return named
        if self.tenant_default is not None:
            tenant = self.tenant_default(request)
            if tenant is not None:
                return tenant
        return self.default
