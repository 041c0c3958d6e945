"""Hypothesis over Open Inference Protocol requests: JSON bodies, binary tensor bodies, gRPC messages.

Zero 5xx over HTTP; over gRPC, no INTERNAL, UNKNOWN or UNAVAILABLE. Then the gateway's loop lag and log
are checked (:func:`fuzz.conftest.assert_responsive`).
"""

from __future__ import annotations

import grpc
import pytest
import requests
from hypothesis import HealthCheck, given, settings
from tritonclient.grpc import service_pb2_grpc

from fuzz.conftest import HEADERS, assert_responsive
from fuzz.strategies import binary_requests, grpc_requests, json_requests

FUZZ = settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
SERVER_FAULTS = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE,
                 grpc.StatusCode.DATA_LOSS}  # fmt: skip


@pytest.fixture(scope="module")
def http(fuzz_suite):
    with requests.Session() as session:
        session.headers.update(HEADERS)
        yield session


@pytest.fixture(scope="module")
def stub(fuzz_suite):
    with grpc.insecure_channel(fuzz_suite.grpc_url) as channel:
        yield service_pb2_grpc.GRPCInferenceServiceStub(channel)


def test_json_bodies(fuzz_suite, http):
    @FUZZ
    @given(json_requests())
    def run(request):
        model, body = request
        resp = http.post(f"{fuzz_suite.base}/v2/models/{model}/infer", data=body, timeout=30)
        assert resp.status_code < 500, resp.text
        if resp.status_code >= 400:
            assert resp.json()["error"]

    run()
    assert_responsive(fuzz_suite)


def test_binary_bodies(fuzz_suite, http):
    @FUZZ
    @given(binary_requests())
    def run(request):
        model, body, headers = request
        resp = http.post(f"{fuzz_suite.base}/v2/models/{model}/infer", data=body, headers=headers, timeout=30)
        assert resp.status_code < 500, resp.text

    run()
    assert_responsive(fuzz_suite)


def test_grpc_messages(fuzz_suite, stub):
    metadata = tuple((k, v) for k, v in HEADERS.items())

    @FUZZ
    @given(grpc_requests())
    def run(message):
        try:
            stub.ModelInfer(message, metadata=metadata, timeout=30)
        except grpc.RpcError as err:
            assert err.code() not in SERVER_FAULTS, f"{err.code()}: {err.details()}"

    run()
    assert_responsive(fuzz_suite)
