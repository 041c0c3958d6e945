"""Pathological bodies, each answered with a 4xx that names the problem (or a 200), quickly.

Deep nesting (under, at and past the parser's 1,024 levels), huge arrays, odd numbers (1e400, -0, NaN
and Infinity literals, integers past 64 bits), invalid UTF-8, duplicate keys, and bodies that are not
JSON at all. Also: requests without credentials are counted, not audited.
"""

from __future__ import annotations

import time

import orjson
import pytest
import requests

from fuzz.conftest import HEADERS, assert_responsive, gateway_metric


def _input(data: bytes, shape: str = "[1,4]", datatype: str = "FP32") -> bytes:
    return b'{"inputs":[{"name":"input","datatype":"%s","shape":%s,"data":%s}]}' % (
        datatype.encode(), shape.encode(), data
    )


CASES = [
    # (what, body, expected status, text the error names)
    ("nested 1,000 deep", _input(b"[" * 1000 + b"1" + b"]" * 1000), 400, "depth 1"),
    ("nested 1,024 deep", b"[" * 1024 + b"]" * 1024, 400, "must be a JSON object"),
    ("nested past the parser", _input(b"[" * 1100 + b"]" * 1100), 400, "deeper than 1024"),
    ("nested 100,000 deep", b"[" * 100_000, 400, "deeper than 1024"),
    ("deep, then wide", _input(b"[" * 500 + b"0" + b"]" * 499 + b",0" * 50_000 + b"]", "[50001]"), 400, "nests"),
    ("data nested less than the shape", _input(b"[[1,2],[3,4]]", "[1,2,2]"), 400, "depth"),
    ("ragged data", _input(b"[[1,2,3],[4]]", "[2,2]"), 400, "depth"),
    ("100k numbers for 4", _input(b"[" + b"0," * 99_999 + b"0]"), 400, "has 100000 elements"),
    ("a million values", _input(b"[" + b"0," * 1_100_000 + b"0]", "[1100001]"), 413, "max_listed_values"),
    ("1e400", _input(b"[1e400,0,0,0]"), 400, "malformed JSON"),
    ("NaN literal", _input(b"[NaN,0,0,0]"), 400, "malformed JSON"),
    ("Infinity literal", _input(b"[Infinity,0,0,0]"), 400, "malformed JSON"),
    ("-0", _input(b"[-0,-0.0,0,0]"), 200, ""),
    ("integer past 64 bits", _input(b"[123456789012345678901234567890,0,0,0]"), 200, ""),
    ("INT32 past its range", _input(b"[2147483648,0,0,0]", datatype="INT32"), 400, "INT32"),
    ("invalid UTF-8", b'{"inputs":[{"name":"\xff\xfe","datatype":"FP32","shape":[1,4],"data":[0,0,0,0]}]}', 400, "UTF-8"),
    ("lone surrogate", _input(b'["\\ud800",0,0,0]'), 400, "malformed JSON"),
    ("duplicate keys", b'{"inputs":[],"inputs":[{"name":"input","datatype":"FP32","shape":[1,4],"data":[1,2,3,4]}]}', 200, ""),
    ("BOM", b"\xef\xbb\xbf" + _input(b"[0,0,0,0]"), 400, "malformed JSON"),
    ("trailing garbage", _input(b"[0,0,0,0]") + b"}", 400, "malformed JSON"),
    ("empty body", b"", 400, "malformed JSON"),
    ("not JSON", b"\x00" * 64, 400, "malformed JSON"),
    ("a string", b'"inputs"', 400, "must be a JSON object"),
    ("shape of floats", _input(b"[0,0,0,0]", "[1.0,4]"), 400, "shape"),
    ("shape [0, 2^62]", _input(b"[]", "[0,4611686018427387904]"), 413, "max_tensor_elements"),
    ("shape past int64", _input(b"[]", "[0,9223372036854775808]"), 400, "bad dim"),
    ("5,000 dims", _input(b"[]", "[" + ",".join(["1"] * 5000) + "]"), 400, "dims"),
    ("parameters nested", b'{"parameters":{"x":[[[]]]},' + _input(b"[0,0,0,0]")[1:], 400, "string, number or boolean"),
    ("priority superscript", b'{"parameters":{"priority":"\xc2\xb2"},' + _input(b"[0,0,0,0]")[1:], 400, "priority"),
    ("priority of 5,000 digits", b'{"parameters":{"priority":"' + b"9" * 5000 + b'"},' + _input(b"[0,0,0,0]")[1:], 400, "priority"),
    ("two million empty strings", orjson.dumps({"inputs": [{"name": "input", "datatype": "BYTES", "shape": [2_000_000],
                                                            "data": [""] * 2_000_000}]}), 413, "max_listed_values"),
]  # fmt: skip


@pytest.mark.parametrize(("what", "body", "status", "names"), CASES, ids=[c[0] for c in CASES])
def test_pathological_body(fuzz_suite, what, body, status, names):
    started = time.perf_counter()
    resp = requests.post(f"{fuzz_suite.base}/v2/models/iris/infer", data=body, headers=HEADERS, timeout=30)
    elapsed = time.perf_counter() - started
    assert resp.status_code == status, f"{what}: {resp.status_code} {resp.text[:300]}"
    if status >= 400:
        assert names in resp.json()["error"], resp.text[:300]
    assert elapsed < 2.0, f"{what} took {elapsed:.2f} s"


def test_usage_times_out_of_range_are_400(fuzz_suite):
    resp = requests.get(f"{fuzz_suite.base}/v2/usage?start=1e18&end=1.0000000000001e18", headers=HEADERS, timeout=10)
    assert resp.status_code == 400 and "not a time between 1970 and 9000" in resp.json()["error"]


def test_huge_headers_are_refused_before_authentication(fuzz_suite):
    resp = requests.get(f"{fuzz_suite.base}/v2/health/live", headers={"x-big": "a" * 200_000}, timeout=10)
    assert resp.status_code == 431 and "max_header_bytes" in resp.json()["error"]
    # Under /v1/ the request line was read first: OpenAI's error object, which the openai client reads.
    resp = requests.get(f"{fuzz_suite.base}/v1/models", headers={"x-big": "a" * 200_000}, timeout=10)
    assert resp.status_code == 431 and resp.json()["error"]["code"] == "request_header_fields_too_large"
    assert "max_header_bytes" in resp.json()["error"]["message"]
    assert requests.get(f"{fuzz_suite.base}/v2/health/live", timeout=5).status_code == 200


def test_strangers_cost_no_audit_line_and_no_log_line(fuzz_suite):
    before = gateway_metric(fuzz_suite, "aiworks_gateway_refused_requests_total", 'reason="unauthenticated"')
    body = _input(b"[0,0,0,0]")
    with requests.Session() as session:
        for i in range(100):
            headers = {"x-request-id": f"stranger-{i}"} | ({} if i % 2 else {"x-api-key": "aiw_not-a-key"})
            assert session.post(f"{fuzz_suite.base}/v2/models/iris/infer", data=body, headers=headers).status_code == 401
    after = gateway_metric(fuzz_suite, "aiworks_gateway_refused_requests_total", 'reason="unauthenticated"')
    assert after - before == 100
    marker = {"x-request-id": "after-the-strangers", **HEADERS}
    assert requests.post(f"{fuzz_suite.base}/v2/models/iris/infer", data=body, headers=marker, timeout=10).ok
    deadline = time.monotonic() + 10
    while b"after-the-strangers" not in fuzz_suite.audit_log.read_bytes():  # flushed every 50 ms
        assert time.monotonic() < deadline, "the authenticated request never reached the audit log"
        time.sleep(0.05)
    assert b"stranger-" not in fuzz_suite.audit_log.read_bytes()


def test_still_responsive_after_the_pathological_bodies(fuzz_suite):
    assert_responsive(fuzz_suite)
