"""Metrics and the server span of each inference request at the gateway, for both front ends.

The HTTP route and the gRPC ``ModelInfer`` wrap their whole handling (parse,
data plane, answer) in :meth:`GatewayTelemetry.infer`, so a request the
codec refuses counts as well as one the scheduler fails, and the duration
runs from receipt to answer. Labels follow :mod:`aiworks.core.metrics`.

A server-side failure is logged here, inside the request's trace, so the
line carries its trace id (a successful request, at DEBUG only).

Label values stay bounded whatever clients send: a model name (and a
version) becomes a label only once this gateway has answered with it;
requests for anything else (unknown names or versions, typos, garbage) count
under ``model=""`` (or ``version=""``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping

from aiworks.core import metrics, tracing
from aiworks.core.inference import InferRequest, InferResponse

log = logging.getLogger(__name__)

PROTOCOLS = ("http", "grpc")
_MAX_MODEL_VERSIONS = 4096


class GatewayTelemetry:
    """Per-request metrics of one gateway; the label children are cached."""

    def __init__(self):
        self._requests = metrics.Children(metrics.GATEWAY_REQUESTS)
        self._duration = metrics.Children(metrics.GATEWAY_REQUEST_DURATION)
        self._inflight = {p: metrics.GATEWAY_INFLIGHT.labels(p) for p in PROTOCOLS}
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
        else:
            model, version = self._labels(call.model, call.version, False)
        tenant = request.tenant if request is not None else ""
        self._requests(model, version, tenant, call.protocol, status).inc()
        self._duration(model, version, tenant, call.protocol).observe(elapsed_s)
        self._inflight[call.protocol].dec()
        return status


class InferCall:
    """One request in flight: set ``request`` once parsed and ``response`` once answered."""

    __slots__ = ("_owner", "protocol", "model", "version", "request", "response", "_started", "_scope")

    def __init__(
        self, owner: GatewayTelemetry, protocol: str, model: str, version: str, carrier: Mapping[str, str] | None
    ):
        self._owner = owner
        self.protocol = protocol
        self.model = model
        self.version = version  # as the client asked; the served one once answered
        self.request: InferRequest | None = None
        self.response: InferResponse | None = None
        attributes = {"aiworks.model": model, "aiworks.protocol": protocol} if tracing.enabled() else None
        self._scope = tracing.server_span("gateway infer", carrier, attributes)

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
            if self.request is not None and self.request.tenant:
                scope.set("aiworks.tenant", self.request.tenant)
            scope.set("aiworks.status", status)
        return scope.__exit__(exc_type, exc, tb)


def _server_fault(exc: BaseException) -> bool:
    """A 5xx-like error (or a bug); client errors, and a client that went away, are the client's to log."""
    status = getattr(exc, "status", None)
    if status is None:
        return not isinstance(exc, asyncio.CancelledError)
    return status.http >= 500
