import grpc

from aiworks.core.errors import HTTP_REFINEMENTS, STATUS_TABLE, Status, from_grpc_code


def test_every_status_has_one_http_and_one_grpc_code():
    assert set(STATUS_TABLE) == set(Status)
    assert Status.UNAVAILABLE.http == 503 and Status.UNAVAILABLE.grpc_code == grpc.StatusCode.UNAVAILABLE
    assert Status.INVALID_ARGUMENT.http == 400 and Status.NOT_FOUND.http == 404


def test_grpc_codes_round_trip_through_the_table():
    for status in Status:
        if status in HTTP_REFINEMENTS:  # 413 shares RESOURCE_EXHAUSTED with 429; 411 and 415 INVALID_ARGUMENT
            continue
        assert from_grpc_code(status.grpc_code, "x").status is status


def test_unknown_grpc_codes_fall_back():
    assert from_grpc_code(grpc.StatusCode.UNKNOWN, "boom").status is Status.INTERNAL
    assert from_grpc_code(grpc.StatusCode.CANCELLED, "gone").status is Status.UNAVAILABLE
