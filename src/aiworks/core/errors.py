"""One exception type and one table that maps it to HTTP and gRPC.

Every service raises :class:`AIWorksError` (or a subclass). The gateway turns it
into an OIP ``{"error": ...}`` body with the HTTP status from :data:`STATUS_TABLE`,
and every gRPC servicer aborts with the gRPC code from the same row, so the two
transports can never disagree. A gRPC error coming back from a peer is turned
into the same exception by :func:`from_grpc_code`, which keeps the status intact
across hops.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc


@dataclass(frozen=True)
class _Row:
    http: int
    grpc: grpc.StatusCode


class Status(enum.Enum):
    """Error classes; each maps to exactly one HTTP status and one gRPC code."""

    INVALID_ARGUMENT = _Row(400, grpc.StatusCode.INVALID_ARGUMENT)
    UNAUTHENTICATED = _Row(401, grpc.StatusCode.UNAUTHENTICATED)
    PERMISSION_DENIED = _Row(403, grpc.StatusCode.PERMISSION_DENIED)
    NOT_FOUND = _Row(404, grpc.StatusCode.NOT_FOUND)
    ALREADY_EXISTS = _Row(409, grpc.StatusCode.ALREADY_EXISTS)
    FAILED_PRECONDITION = _Row(412, grpc.StatusCode.FAILED_PRECONDITION)
    PAYLOAD_TOO_LARGE = _Row(413, grpc.StatusCode.RESOURCE_EXHAUSTED)
    # HTTP-only refinements of INVALID_ARGUMENT (the control APIs: JSON bodies with a length).
    LENGTH_REQUIRED = _Row(411, grpc.StatusCode.INVALID_ARGUMENT)
    UNSUPPORTED_MEDIA_TYPE = _Row(415, grpc.StatusCode.INVALID_ARGUMENT)
    RESOURCE_EXHAUSTED = _Row(429, grpc.StatusCode.RESOURCE_EXHAUSTED)
    INTERNAL = _Row(500, grpc.StatusCode.INTERNAL)
    UNIMPLEMENTED = _Row(501, grpc.StatusCode.UNIMPLEMENTED)
    # "Not ready" is 503 / UNAVAILABLE so that retry policies act on it.
    UNAVAILABLE = _Row(503, grpc.StatusCode.UNAVAILABLE)
    DEADLINE_EXCEEDED = _Row(504, grpc.StatusCode.DEADLINE_EXCEEDED)

    @property
    def http(self) -> int:
        return self.value.http

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.value.grpc


STATUS_TABLE: dict[Status, _Row] = {s: s.value for s in Status}

# gRPC codes a peer may send that have no row of their own.
_GRPC_FALLBACK = {
    grpc.StatusCode.CANCELLED: Status.UNAVAILABLE,
    grpc.StatusCode.UNKNOWN: Status.INTERNAL,
    grpc.StatusCode.ABORTED: Status.UNAVAILABLE,
    grpc.StatusCode.OUT_OF_RANGE: Status.INVALID_ARGUMENT,
    grpc.StatusCode.DATA_LOSS: Status.INTERNAL,
}
# HTTP refinements whose gRPC code belongs to another row: a peer's code never comes back as these.
HTTP_REFINEMENTS = frozenset({Status.PAYLOAD_TOO_LARGE, Status.LENGTH_REQUIRED, Status.UNSUPPORTED_MEDIA_TYPE})
_BY_GRPC = {row.grpc: status for status, row in STATUS_TABLE.items() if status not in HTTP_REFINEMENTS}


class AIWorksError(Exception):
    """Base error: carries a :class:`Status` and a message meant for the client."""

    status: Status = Status.INTERNAL

    def __init__(self, message: str, status: Status | None = None, *, retry_after_s: float | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self.retry_after_s = retry_after_s

    def __str__(self) -> str:
        return self.message


class InvalidArgument(AIWorksError):
    status = Status.INVALID_ARGUMENT


class Unauthenticated(AIWorksError):
    """No credentials, or credentials that prove nothing (HTTP 401 with ``WWW-Authenticate: Bearer``)."""

    status = Status.UNAUTHENTICATED


class PermissionDenied(AIWorksError):
    """A known caller asking for something it may not do."""

    status = Status.PERMISSION_DENIED


class NotFound(AIWorksError):
    status = Status.NOT_FOUND


class Unavailable(AIWorksError):
    status = Status.UNAVAILABLE


class StreamLost(Unavailable):
    """The stream to a peer broke with this request on it: the peer is gone, not the request at fault."""


class PayloadTooLarge(AIWorksError):
    status = Status.PAYLOAD_TOO_LARGE


class ResourceExhausted(AIWorksError):
    """A limit reached (rate, concurrency, quota, queue); ``retry_after_s`` says when to try again."""

    status = Status.RESOURCE_EXHAUSTED


class DeadlineExceeded(AIWorksError):
    status = Status.DEADLINE_EXCEEDED


class Internal(AIWorksError):
    status = Status.INTERNAL


_CLASS_BY_STATUS: dict[Status, type[AIWorksError]] = {
    Status.INVALID_ARGUMENT: InvalidArgument,
    Status.UNAUTHENTICATED: Unauthenticated,
    Status.PERMISSION_DENIED: PermissionDenied,
    Status.NOT_FOUND: NotFound,
    Status.RESOURCE_EXHAUSTED: ResourceExhausted,
    Status.UNAVAILABLE: Unavailable,
    Status.DEADLINE_EXCEEDED: DeadlineExceeded,
    Status.INTERNAL: Internal,
}


def from_grpc_code(code: grpc.StatusCode, message: str) -> AIWorksError:
    """The error a peer's gRPC status stands for, as the matching exception class."""
    status = _BY_GRPC.get(code) or _GRPC_FALLBACK.get(code, Status.INTERNAL)
    return _CLASS_BY_STATUS.get(status, AIWorksError)(message, status)


def from_rpc_error(err: grpc.RpcError, peer: str) -> AIWorksError:
    """Turn a failed call to ``peer`` into an :class:`AIWorksError`.

    Transport failures (the peer is down) become UNAVAILABLE naming the peer;
    errors the peer raised keep their code and message.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    if code == grpc.StatusCode.UNAVAILABLE and "failed to connect" in details.lower():
        return Unavailable(f"{peer} is unreachable: {details}")
    return from_grpc_code(code, details)


# ---- Triton's wording for a model or version that does not exist -----------------------------------------
# Triton's clients and scripts match on these texts, so they start exactly as Triton's do; our own detail may
# follow after "; ". Like Triton, a name the repository does not know at all is a bad argument (HTTP 400,
# INVALID_ARGUMENT), while a known model without the version asked for, or with no version ready, is NOT_FOUND.


def _with_detail(text: str, detail: str | None) -> str:
    return f"{text}; {detail}" if detail else text


class UnknownModel(InvalidArgument):
    """A model name the server does not know: 400 on Triton's APIs, 404 ``model_not_found`` on OpenAI's."""


def unknown_model(name: str, detail: str | None = None) -> InvalidArgument:
    """``Request for unknown model: 'NAME' is not found`` (HTTP 400 / INVALID_ARGUMENT, as Triton answers)."""
    return UnknownModel(_with_detail(f"Request for unknown model: '{name}' is not found", detail))


def unknown_version(name: str, version: str, detail: str | None = None) -> NotFound:
    """``Request for unknown model: 'NAME' version N is not found`` (HTTP 404 / NOT_FOUND, as Triton answers)."""
    return NotFound(_with_detail(f"Request for unknown model: '{name}' version {version} is not found", detail))


def no_available_version(name: str, detail: str | None = None) -> NotFound:
    """``Request for unknown model: 'NAME' has no available versions`` (HTTP 404 / NOT_FOUND)."""
    return NotFound(_with_detail(f"Request for unknown model: '{name}' has no available versions", detail))
