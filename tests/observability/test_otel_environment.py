"""OpenTelemetry's standard variables configure the suite's tracing, as a cluster's conventions expect:
OTEL_EXPORTER_OTLP_ENDPOINT turns export on, OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES describe
the service, OTEL_TRACES_SAMPLER samples. Spans go to a real OTLP/gRPC receiver (the protocol's own
service stubs) on a free loopback port."""

from __future__ import annotations

import threading
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from aiworks.core import tracing
from aiworks.gateway.settings import GatewaySettings


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.got = threading.Event()

    def Export(self, request, context):
        self.requests.append(request)
        self.got.set()
        return trace_service_pb2.ExportTraceServiceResponse()


@pytest.fixture
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(0)
        tracing.shutdown_tracing()


def attributes(resource) -> dict[str, str]:
    return {a.key: a.value.string_value for a in resource.attributes}


def test_standard_variables_turn_tracing_on_and_name_the_service(receiver) -> None:
    servicer, port = receiver
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}",
        "OTEL_SERVICE_NAME": "aiworks-gateway-eu",
        "OTEL_RESOURCE_ATTRIBUTES": "service.namespace=prod,k8s.namespace.name=ml",
        "OTEL_TRACES_SAMPLER": "parentbased_always_on",
    }
    settings = GatewaySettings(scheduler_address="127.0.0.1:1")
    assert settings.otlp_endpoint is None, "nothing set in the suite's own settings"
    assert tracing.setup_tracing("gateway", settings, instance="gw-0", environ=env)
    with tracing.server_span("infer", None):
        pass
    tracing.shutdown_tracing()
    assert servicer.got.wait(10)
    [spans] = servicer.requests[0].resource_spans
    expected = {
        "service.name": "aiworks-gateway-eu", "service.namespace": "prod", "k8s.namespace.name": "ml",
        "service.instance.id": "gw-0",
    }  # fmt: skip
    assert expected.items() <= attributes(spans.resource).items()
    assert spans.scope_spans[0].spans[0].name == "infer"


def test_sampler_and_off_switch_come_from_the_environment(receiver) -> None:
    servicer, port = receiver
    settings = GatewaySettings(scheduler_address="127.0.0.1:1")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_TRACES_SAMPLER": "always_off"}
    assert tracing.setup_tracing("gateway", settings, environ=env)
    with tracing.server_span("dropped", None) as scope:
        assert scope.span is None or not scope.span.is_recording()
    tracing.shutdown_tracing()
    assert not servicer.got.wait(1)
    assert not tracing.setup_tracing("gateway", settings, environ={**env, "OTEL_SDK_DISABLED": "true"})
    assert not tracing.setup_tracing("gateway", settings, environ={}), "no endpoint, no file: off"
