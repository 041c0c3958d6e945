"""Distributed tracing for every service: OpenTelemetry set-up, W3C trace context in and out, spans.

One request's trace: the gateway's server span (a child of the client's
``traceparent`` when it sends one), a child span for the result-cache lookup,
a "queue" span per request in the scheduler (from enqueue until its batch is
sent), one "batch" span per batch, and the runtime's "execute" span as the
batch span's child. A batch serves several requests, and a span has one
parent: the batch span belongs to the trace of its oldest request and links
to every request's queue span, as OpenTelemetry advises for batch processing.

Context travels as W3C ``traceparent``/``tracestate``: HTTP headers and gRPC
metadata at the gateway, then the ``trace_context`` map fields of the
internal messages, since messages on a multiplexed stream have no metadata
of their own.

Cost when off. Nothing is exported unless ``otlp_endpoint`` or
``trace_file`` is set; then no tracer exists and no span object is made. An
incoming ``traceparent`` is still parsed and made current (a non-recording
span context), so the next hop receives it and log lines carry its trace id;
a request without one costs a header lookup and returns the shared no-op
scope. Export runs in the SDK's batch processor thread, never on the event
loop.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from pathlib import Path

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
_HEADERS = (TRACEPARENT, TRACESTATE)
_PROPAGATOR = TraceContextTextMapPropagator()
_EXPORT_DELAY_MS = 500
# An unreachable collector must not hold up a service's stop (the supervisor kills after 10 s).
_OTLP_TIMEOUT_S = 2.0

_tracer: trace.Tracer | None = None
_provider = None  # the SDK's TracerProvider, while tracing is on


def enabled() -> bool:
    """Whether this process records spans (an exporter is configured)."""
    return _tracer is not None


def otel_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """OpenTelemetry's standard variables that apply to traces, as the OTel SDKs read them.

    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT``
    turn export on (a service's own ``otlp_endpoint`` setting wins);
    ``OTEL_SDK_DISABLED=true`` turns tracing off; ``OTEL_SERVICE_NAME``,
    ``OTEL_RESOURCE_ATTRIBUTES`` and ``OTEL_TRACES_SAMPLER`` (+ ``_ARG``) name
    the service, describe it and sample, over the suite's defaults.
    """
    env = os.environ if environ is None else environ
    names = ("OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
             "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")  # fmt: skip
    return {name: env[name] for name in names if env.get(name)}


def setup_tracing(service: str, settings, *, instance: str = "", environ: Mapping[str, str] | None = None) -> bool:
    """Record and export spans when ``settings`` (or OTel's variables) name an OTLP endpoint or a trace file.

    ``settings`` is the service's :class:`~aiworks.core.settings.ServiceSettings`;
    OpenTelemetry's standard variables apply where the settings say nothing
    (:func:`otel_environment`). The SDK is imported only here, and only when
    something exports. Returns True when spans are recorded.
    """
    global _tracer, _provider
    shutdown_tracing()
    otel = otel_environment(environ)
    SAMPLING.start(getattr(settings, "trace_sample_ratio", 1.0), adjustable=not otel.get("OTEL_TRACES_SAMPLER"))
    if otel.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    endpoint = (
        settings.otlp_endpoint or otel.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or otel.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )
    path = settings.trace_file
    if not endpoint and not path:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    attributes = {"service.name": f"aiworks-{service}", "service.namespace": "aiworks"}
    if instance:
        attributes["service.instance.id"] = instance
    # The suite's attributes, with the environment's over them (OTEL_RESOURCE_ATTRIBUTES, then OTEL_SERVICE_NAME).
    for pair in filter(None, otel.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")):
        key, _, value = pair.partition("=")
        if key.strip() and value.strip():
            attributes[key.strip()] = value.strip()
    if otel.get("OTEL_SERVICE_NAME"):
        attributes["service.name"] = otel["OTEL_SERVICE_NAME"]
    sampler = _sampler(otel.get("OTEL_TRACES_SAMPLER"), otel.get("OTEL_TRACES_SAMPLER_ARG"), settings.trace_sample_ratio)
    provider = TracerProvider(resource=Resource.create(attributes), sampler=sampler)
    if endpoint:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # A bare host:port would parse as a URL scheme; plain text unless https:// is asked for.
        url = endpoint if "://" in endpoint else f"http://{endpoint}"
        provider.add_span_processor(
            BatchSpanProcessor(
                OTLPSpanExporter(endpoint=url, timeout=_OTLP_TIMEOUT_S), schedule_delay_millis=_EXPORT_DELAY_MS
            )
        )
    if path:
        provider.add_span_processor(
            BatchSpanProcessor(JsonLinesExporter(Path(path)), schedule_delay_millis=_EXPORT_DELAY_MS)
        )
    _provider = provider
    _tracer = provider.get_tracer("aiworks")
    log.info("tracing on: %s", ", ".join(filter(None, [endpoint and f"OTLP {endpoint}", path and f"file {path}"])))
    return True


def _sampler(name: str | None, arg: str | None, default_ratio: float):
    """OTEL_TRACES_SAMPLER's sampler (the specification's names), else the service's ratio; callers' decisions kept.

    The service's ratio is :data:`SAMPLING`'s, which may change while the
    process runs (the gateway's trace settings API); a fixed sampler from the
    environment may not.
    """
    from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, ParentBased, TraceIdRatioBased

    if not name:
        return ParentBased(_AdjustableRatio())
    ratio = float(arg) if arg else 1.0
    known = {
        "always_on": lambda: ALWAYS_ON, "always_off": lambda: ALWAYS_OFF,
        "traceidratio": lambda: TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: ParentBased(ALWAYS_ON), "parentbased_always_off": lambda: ParentBased(ALWAYS_OFF),
        "parentbased_traceidratio": lambda: ParentBased(TraceIdRatioBased(ratio)),
    }  # fmt: skip
    if name.lower() not in known:
        log.warning("OTEL_TRACES_SAMPLER=%s is not one this service knows (%s); sampling at %s", name,
                    ", ".join(known), default_ratio)  # fmt: skip
        return ParentBased(TraceIdRatioBased(default_ratio))
    return known[name.lower()]()


class Sampling:
    """The share of new traces recorded: one ratio for all, and ratios per model (the span's ``aiworks.model``).

    Read by the sampler at each root span; changed by the gateway's trace
    settings API. Only traces that start here are sampled by it: a caller's
    ``traceparent`` keeps the caller's decision.
    """

    def __init__(self) -> None:
        self.initial = 1.0
        self.ratio = 1.0
        self.models: dict[str, float] = {}
        self.adjustable = True

    def start(self, ratio: float, *, adjustable: bool) -> None:
        self.initial = self.ratio = ratio
        self.models = {}
        self.adjustable = adjustable

    def for_model(self, model: str | None) -> float:
        return self.models.get(model, self.ratio) if model else self.ratio


SAMPLING = Sampling()
MODEL_ATTRIBUTE = "aiworks.model"


def _ratio_sampler_class():
    from opentelemetry.sdk.trace.sampling import Sampler, TraceIdRatioBased

    class AdjustableRatio(Sampler):
        """TraceIdRatioBased at :data:`SAMPLING`'s ratio of the moment, for the span's model."""

        def __init__(self) -> None:
            self._by_ratio: dict[float, TraceIdRatioBased] = {}

        def should_sample(
            self, parent_context, trace_id, name, kind=None, attributes=None, links=None, trace_state=None
        ):
            ratio = SAMPLING.for_model(attributes.get(MODEL_ATTRIBUTE) if attributes else None)
            sampler = self._by_ratio.get(ratio)
            if sampler is None:
                if len(self._by_ratio) >= 64:  # ratios come from an API: keep the cache bounded
                    self._by_ratio.clear()
                sampler = self._by_ratio[ratio] = TraceIdRatioBased(ratio)
            return sampler.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

        def get_description(self) -> str:
            return "AIWorksAdjustableRatio"

    return AdjustableRatio


def _AdjustableRatio():  # noqa: N802 - the SDK is imported only when something exports
    return _ratio_sampler_class()()


def shutdown_tracing() -> None:
    """Export what is pending and stop recording (also safe when tracing is off)."""
    global _tracer, _provider
    provider, _provider, _tracer = _provider, None, None
    if provider is not None:
        provider.shutdown()


# ---- context in and out --------------------------------------------------------------------------


def carrier_from_metadata(metadata: Iterable[tuple[str, str]] | None) -> dict[str, str] | None:
    """The W3C trace headers among gRPC metadata (keys arrive lower-case); None when there are none."""
    if not metadata:
        return None
    found = None
    for key, value in metadata:
        if key in _HEADERS:
            if found is None:
                found = {}
            found[key] = value
    return found


def extract(carrier: Mapping[str, str] | None) -> otel_context.Context | None:
    """The context a W3C ``traceparent`` in ``carrier`` names; None when there is none or it is malformed."""
    if not carrier or TRACEPARENT not in carrier:
        return None
    ctx = _PROPAGATOR.extract(carrier)
    return ctx if trace.get_current_span(ctx).get_span_context().is_valid else None


def inject(carrier: MutableMapping[str, str]) -> None:
    """Write the current span's context into ``carrier``; nothing when no trace is current."""
    if trace.get_current_span().get_span_context().is_valid:
        _PROPAGATOR.inject(carrier)


def current_span_context() -> SpanContext | None:
    """The current span's context (recording or only propagated), or None."""
    span_context = trace.get_current_span().get_span_context()
    return span_context if span_context.is_valid else None


def current_trace_id() -> str | None:
    """The current trace id as 32 hex digits, or None."""
    span_context = current_span_context()
    return None if span_context is None else trace.format_trace_id(span_context.trace_id)


# ---- spans ---------------------------------------------------------------------------------------


class Scope:
    """A span and/or a context made current for a ``with`` block.

    ``span`` is None when nothing records (only a propagated context is
    current then). On leaving, the span ends; an error of the server's making
    (5xx-like, or not an AIWorks error) marks it failed, a client's error
    (4xx-like) is only recorded as the ``aiworks.status`` attribute.
    """

    __slots__ = ("span", "_context", "_token")

    def __init__(self, span, ctx: otel_context.Context | None):
        self.span = span
        self._context = ctx
        self._token = None

    def __enter__(self) -> Scope:
        if self._context is not None:
            self._token = otel_context.attach(self._context)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if self._token is not None:
            otel_context.detach(self._token)
            self._token = None
        if self.span is not None:
            if exc is not None:
                fail(self.span, exc)
            self.span.end()
        return False

    def set(self, key: str, value) -> None:
        if self.span is not None:
            self.span.set_attribute(key, value)

    def fail(self, exc: BaseException) -> None:
        """Record an error the block handled itself (see :func:`fail`)."""
        if self.span is not None:
            fail(self.span, exc)


_NOOP = Scope(None, None)


def _with_parent(parent: SpanContext | otel_context.Context | None) -> otel_context.Context | None:
    if parent is None or isinstance(parent, otel_context.Context):
        return parent
    return trace.set_span_in_context(NonRecordingSpan(parent))


_ROOT = otel_context.Context()  # no current span: a span started in it begins a new trace


def server_span(name: str, carrier: Mapping[str, str] | None, attributes: Mapping | None = None) -> Scope:
    """A SERVER span whose parent is the caller's context in ``carrier``, made current.

    Off: the caller's context alone is made current (propagation), or nothing.
    """
    parent = extract(carrier)
    if _tracer is None:
        return _NOOP if parent is None else Scope(None, parent)
    span = _tracer.start_span(name, context=parent, kind=SpanKind.SERVER, attributes=attributes)
    return Scope(span, trace.set_span_in_context(span, parent))


def remote_scope(carrier: Mapping[str, str] | None) -> Scope:
    """Make the caller's context in ``carrier`` current, without a span of its own."""
    parent = extract(carrier)
    return _NOOP if parent is None else Scope(None, parent)


def child_span(name: str, attributes: Mapping | None = None) -> Scope:
    """An INTERNAL span under the current one, made current; the no-op scope when off or outside a trace."""
    if _tracer is None:
        return _NOOP
    span = _tracer.start_span(name, attributes=attributes)
    return Scope(span, trace.set_span_in_context(span))


def start_span(
    name: str,
    parent: SpanContext | otel_context.Context | None = None,
    attributes: Mapping | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
):
    """A span that is not made current (its caller ends it, e.g. a request's wait in a queue); None when off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=_with_parent(parent), kind=kind, attributes=attributes)


def batch_scope(
    name: str,
    parent: SpanContext | None,
    links: Sequence[SpanContext],
    attributes: Mapping | None = None,
) -> Scope:
    """The span of work done for many requests: child of ``parent`` (the oldest request's), linked to all.

    Off: ``parent`` alone is made current when the batch serves one request,
    so a downstream service that records still joins that request's trace.
    """
    if _tracer is None:
        if parent is None or len(links) > 1:
            return _NOOP
        return Scope(None, _with_parent(parent))
    span = _tracer.start_span(
        name,
        context=_with_parent(parent) if parent is not None else _ROOT,
        kind=SpanKind.INTERNAL,
        attributes=attributes,
        links=[Link(link) for link in links],
    )
    return Scope(span, trace.set_span_in_context(span))


def fail(span, exc: BaseException) -> None:
    """Record ``exc``'s status on ``span``; only server-side errors mark the span failed."""
    status = getattr(exc, "status", None)
    span.set_attribute("aiworks.status", status.name.lower() if status is not None else type(exc).__name__)
    if status is None or status.http >= 500:
        span.set_status(Status(StatusCode.ERROR, str(exc) or type(exc).__name__))


# ---- the trace file ------------------------------------------------------------------------------


def span_record(span) -> dict:
    """One finished SDK span as a flat JSON-able dict (ids as W3C hex strings)."""
    ctx = span.get_span_context()
    return {
        "service": span.resource.attributes.get("service.name", ""),
        "name": span.name,
        "trace_id": trace.format_trace_id(ctx.trace_id),
        "span_id": trace.format_span_id(ctx.span_id),
        "parent_span_id": trace.format_span_id(span.parent.span_id) if span.parent is not None else None,
        "kind": span.kind.name,
        "start_unix_ns": span.start_time,
        "end_unix_ns": span.end_time,
        "status": span.status.status_code.name,
        "attributes": dict(span.attributes or {}),
        "links": [
            {
                "trace_id": trace.format_trace_id(link.context.trace_id),
                "span_id": trace.format_span_id(link.context.span_id),
                "attributes": dict(link.attributes or {}),
            }
            for link in span.links
        ],
    }


class JsonLinesExporter:
    """Appends each finished span to a file as one JSON line; the SDK's SpanExporter interface.

    It runs in the batch processor's thread, so file writes never block the event loop.
    """

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in shutdown()
        self._lock = threading.Lock()

    def export(self, spans):
        import orjson
        from opentelemetry.sdk.trace.export import SpanExportResult

        text = "".join(orjson.dumps(span_record(s)).decode() + "\n" for s in spans)
        with self._lock:
            if self._file.closed:
                return SpanExportResult.FAILURE
            self._file.write(text)  # one write per batch: lines of processes sharing the file stay whole
            self._file.flush()
        return SpanExportResult.SUCCESS

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        return True

    def shutdown(self) -> None:
        with self._lock:
            self._file.close()
