"""Metrics and the server span of each inference request at the gateway, for both front ends.

The HTTP route and the gRPC ``ModelInfer`` wrap their whole handling (parse,
data plane, answer) in :meth:`GatewayTelemetry.infer`, so a request the
codec refuses counts as well as one the scheduler fails, and the duration
runs from receipt to answer. Labels follow :mod:`aiworks.core.metrics`.

A server-side failure is logged here, inside the request's trace, so the
line carries its trace id (a successful request, at DEBUG only). With an
audit log configured, every inference, answered or refused, is appended to it
here as well: tenant, model, version, status, latency and request id, never
the payload. A generation's line (a decoupled model's stream, on any front
end) also has, in ``details``, its prompt and completion tokens, its finish
reason (``stop`` or ``length`` as the model said, ``cancelled`` when the
client left or cancelled, ``error``), its time to first token, how many
responses it sent and the sampling it asked for (numbers and flags, and how
many stop strings: :func:`sampling_asked`); never the prompt, the stop
strings or the text. Requests without valid
credentials are not audited (nor logged one by one): anyone can send them,
so they would let anyone grow the audit log; they are counted in
``aiworks_gateway_refused_requests_total``.

Label values stay bounded whatever clients send: a model name (and a
version) becomes a label only once this gateway has answered with it;
requests for anything else (unknown names or versions, typos, garbage) count
under ``model=""`` (or ``version=""``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from typing import Protocol

import orjson

from aiworks.core import metrics, tracing
from aiworks.core.errors import AIWorksError
from aiworks.core.inference import InferRequest, InferResponse
from aiworks.security.audit import AuditLog

log = logging.getLogger(__name__)

PROTOCOLS = ("http", "grpc")
REQUEST_ID_HEADER = "x-request-id"  # set by Envoy and most proxies; else the OIP request's "id"
_MAX_MODEL_VERSIONS = 4096
_AUDIT_TEXT = 256


def short(text: str, limit: int = _AUDIT_TEXT) -> str:
    """``text`` cut to ``limit`` characters: client-chosen strings stay bounded in logs and the audit log."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Counted(Protocol):
    """A generation's token counts as the data plane keeps them (:class:`aiworks.gateway.token_budget.TokenCount`)."""

    prompt: int
    completion: int


# What a generation's audit line records of the sampling asked for: numbers and flags, never text.
_AUDITED_SAMPLING = ("max_tokens", "temperature", "top_k", "top_p", "seed", "ignore_eos", "logprobs",
                     "prompt_logprobs")  # fmt: skip
_INT_BOUND = 1 << 63


def sampling_asked(parameters: dict) -> dict:
    """The sampling parameters a generation asked for, as its audit line keeps them: the numbers and flags
    (a value of another type, or a number too large to be one the runtime takes, as its type's name), and of
    the stop strings only how many there were (they are text)."""
    out: dict = {}
    for name in _AUDITED_SAMPLING:
        if name in parameters:
            value = parameters[name]
            fits = isinstance(value, bool) or (isinstance(value, int) and -_INT_BOUND < value < _INT_BOUND) or (
                isinstance(value, float) and math.isfinite(value))  # fmt: skip
            out[name] = value if fits else type(value).__name__
    stop = parameters.get("stop")
    if isinstance(stop, str) and stop.startswith("["):  # a list, as the front ends pass it (JSON text)
        try:
            stop = orjson.loads(stop)
        except orjson.JSONDecodeError:
            pass
    if stop:
        out["stop_strings"] = len(stop) if isinstance(stop, list) else 1
    return out


def finish_reason(said: str, error: BaseException | None) -> str:
    """How a generation ended: the model's reason (``said``), ``cancelled`` (the client left or cancelled), or
    ``error``."""
    if error is None:
        return said or "stop"
    if isinstance(error, asyncio.CancelledError):  # the client left or cancelled: its task was cancelled
        return "cancelled"
    return "error"


class GatewayTelemetry:
    """Per-request metrics of one gateway; the label children are cached."""

    def __init__(self, audit: AuditLog | None = None):
        self.audit = audit
        self._requests = metrics.Children(metrics.GATEWAY_REQUESTS)
        self._duration = metrics.Children(metrics.GATEWAY_REQUEST_DURATION)
        self._inflight = {p: metrics.GATEWAY_INFLIGHT.labels(p) for p in PROTOCOLS}
        self._stream_responses = metrics.Children(metrics.GATEWAY_STREAM_RESPONSES)
        self._first_response = metrics.Children(metrics.GATEWAY_FIRST_RESPONSE_DURATION)
        # Model versions this gateway has answered with: the only label values clients can reach.
        self.served: set[tuple[str, str]] = set()
        self.served_models: set[str] = set()

    def infer(self, protocol: str, model: str, version: str, carrier: Mapping[str, str] | None) -> InferCall:
        """A ``with`` block around one inference request; ``carrier`` holds its W3C trace headers."""
        return InferCall(self, protocol, model, version, carrier)

    def _labels(self, model: str, version: str, ok: bool) -> tuple[str, str]:
        """(model, version) as labels: as served, or as asked only when that was served before, else ""."""
        if (model, version) in self.served:
            return model, version
        if ok and len(self.served) < _MAX_MODEL_VERSIONS:
            self.served.add((model, version))
            self.served_models.add(model)
            return model, version
        return (model, "") if model in self.served_models else ("", "")

    def _record(self, call: InferCall, error: BaseException | None, elapsed_s: float) -> str:
        status = metrics.status_label(error)
        request, response = call.request, call.response
        if response is not None:
            model, version = self._labels(response.model, response.version, error is None)
        elif request is not None and request.resolved:  # a version routing chose: a known one, safe as a label
            model, version = self._labels(request.model, request.version, True)
        else:
            model, version = self._labels(call.model, call.version, False)
        if call.tenant is None and request is not None:
            call.tenant = request.tenant  # the data plane sets it on the request (tenant-less callers of infer)
        tenant = call.tenant or ""
        self._requests(model, version, tenant, call.protocol, status).inc()
        self._duration(model, version, tenant, call.protocol).observe(elapsed_s)
        self._inflight[call.protocol].dec()
        # A caller that never proved who it is costs no audit line (each is written and fsynced): it is
        # counted in aiworks_gateway_refused_requests_total{reason="unauthenticated"} instead.
        if self.audit is not None and call.tenant is not None:
            self._audit(call, status, elapsed_s, error)
        return status

    def _audit(self, call: InferCall, status: str, elapsed_s: float, error: BaseException | None) -> None:
        request, response = call.request, call.response
        request_id = call.request_id or (request.id if request is not None else "")
        details = None
        if call.tokens is not None:  # a generation: what it cost and how it ended, never its text
            tokens = call.tokens
            details = {
                "prompt_tokens": tokens.prompt, "completion_tokens": tokens.completion,
                "finish_reason": finish_reason(call.finish_reason, error), "responses": call.responses,
                "ttft_ms": None if call.first_s is None else round(call.first_s * 1e3, 3),
            }  # fmt: skip
            if request is not None and request.parameters:
                details.update(sampling_asked(request.parameters))  # the audit keeps flat scalars
        try:
            self.audit.inference(
                tenant=call.tenant,
                model=short(response.model if response is not None else call.model),
                version=short(response.version if response is not None else call.version) or None,
                status=status,
                latency_ms=elapsed_s * 1e3,
                request_id=short(request_id) if request_id else None,
                details=details,
            )
        except AIWorksError as exc:  # the log is closed (shutting down) or refused a field: the answer stands
            log.warning("audit of a %s inference of %s failed: %s", call.protocol, short(call.model, 64), exc)


class InferCall:
    """One request in flight: set ``tenant`` once authenticated, ``request`` once parsed, ``response`` once answered.

    ``tenant`` stays None while the caller is unknown (no or bad credentials);
    it is ``""`` in demo mode. A front end that runs a generation (a decoupled
    model's stream) calls :meth:`generation` first: its audit line then carries
    the tokens, finish reason and time to first token.
    """

    __slots__ = (
        "_owner", "protocol", "model", "version", "tenant", "request_id", "request", "response", "_started", "_scope",
        "responses", "tokens", "first_s", "finish_reason",
    )  # fmt: skip

    def __init__(
        self, owner: GatewayTelemetry, protocol: str, model: str, version: str, carrier: Mapping[str, str] | None
    ):
        self._owner = owner
        self.protocol = protocol
        self.model = model
        self.version = version  # as the client asked; the served one once answered
        self.tenant: str | None = None
        self.request_id = ""
        self.request: InferRequest | None = None
        self.response: InferResponse | None = None
        self.responses = 0  # sent on a stream so far
        self.tokens: Counted | None = None  # a generation's counts (see generation())
        self.first_s: float | None = None  # seconds from receipt to the first response sent
        self.finish_reason = ""  # a generation's, as the model said it
        attributes = {"aiworks.model": model, "aiworks.protocol": protocol} if tracing.enabled() else None
        self._scope = tracing.server_span("gateway infer", carrier, attributes)

    def generation(self, tokens: Counted) -> None:
        """This request is a generation whose tokens ``tokens`` counts (the data plane's counter, shared)."""
        self.tokens = tokens

    def streamed(self, response: InferResponse) -> None:
        """One response of this request left on a stream (``ModelStreamInfer``): counted, the first one timed."""
        self.response = response
        owner = self._owner
        model, version = owner._labels(response.model, response.version, True)
        tenant = self.tenant or ""
        owner._stream_responses(model, version, tenant).inc()
        if not self.responses:
            self.first_s = time.perf_counter() - self._started
            owner._first_response(model, version, tenant).observe(self.first_s)
        self.responses += 1
        if self.tokens is not None and "finish_reason" in response.parameters:
            self.finish_reason = short(str(response.parameters["finish_reason"]), 32)

    def __enter__(self) -> InferCall:
        self._started = time.perf_counter()
        self._owner._inflight[self.protocol].inc()
        self._scope.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        elapsed_s = time.perf_counter() - self._started
        status = self._owner._record(self, exc, elapsed_s)
        # Logged while the request's trace is still current, so the line carries its trace id.
        if exc is not None and _server_fault(exc):
            log.warning("%s infer %s -> %s in %.1f ms: %s", self.protocol, self.model, status, elapsed_s * 1e3, exc)
        elif log.isEnabledFor(logging.DEBUG):
            log.debug("%s infer %s -> %s in %.1f ms", self.protocol, self.model, status, elapsed_s * 1e3)
        scope = self._scope
        if scope.span is not None:
            if self.response is not None:
                scope.set("aiworks.version", self.response.version)
            if self.tenant:
                scope.set("aiworks.tenant", self.tenant)
            scope.set("aiworks.status", status)
        return scope.__exit__(exc_type, exc, tb)


def _server_fault(exc: BaseException) -> bool:
    """A 5xx-like error (or a bug); client errors, and a client that went away, are the client's to log."""
    status = getattr(exc, "status", None)
    if status is None:
        return not isinstance(exc, asyncio.CancelledError)
    return status.http >= 500
