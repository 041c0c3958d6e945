"""Input bounds without processes: the one-pass JSON walk, caps before decoding, linear masking, RE2 for
custom patterns, the loop-lag probe, and the 400s of finding 10 (issue 15)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import numpy as np
import orjson
import pytest
from tritonclient.grpc import service_pb2 as pb

from aiworks.core import metrics
from aiworks.core.datatypes import Tensor, serialize_bytes
from aiworks.core.errors import AIWorksError, InvalidArgument, PayloadTooLarge
from aiworks.core.inference import InferResponse
from aiworks.core.looplag import LoopLagProbe, offload
from aiworks.core.model_config import ModelSpec, TensorSpec
from aiworks.core.options import parse_priority, parse_timeout_us
from aiworks.gateway.converters import to_infer_request, to_infer_request_header
from aiworks.gateway.filters import InputLimits, compile_deny_list
from aiworks.gateway.http_codec import parse_infer_header, parse_infer_request
from aiworks.gateway.masking import Masker, MaskingPolicies, MaskRule, builtin_pattern, compile_pattern
from aiworks.gateway.metering import parse_time


def body(data, shape, datatype="FP32") -> bytes:
    return orjson.dumps({"inputs": [{"name": "x", "datatype": datatype, "shape": shape, "data": data}]})


def decoded(data, shape, datatype="FP32") -> np.ndarray:
    request, _ = parse_infer_request(body(data, shape, datatype), None, "m", "")
    return request.inputs[0].to_numpy()


# ---- JSON tensor data: one pass, flat or nested as the shape is --------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12],  # flat
        [[[1, 2], [3, 4], [5, 6]], [[7, 8], [9, 10], [11, 12]]],  # nested as the shape
        [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]],  # nested along the leading dim only (Triton accepts it)
        [[[1, 2], [3, 4], [5, 6]], [7, 8, 9, 10, 11, 12]][:1] + [[[7, 8], [9, 10], [11, 12]]],
    ],
)
def test_flat_and_nested_data_decode_alike(data):
    np.testing.assert_array_equal(decoded(data, [2, 3, 2]), np.arange(1, 13).reshape(2, 3, 2))


@pytest.mark.parametrize(
    ("data", "shape", "message"),
    [
        ([[1, 2], [3]], [2, 2], "a list of 1 at depth 1"),
        ([[1, 2], 3], [2, 2], "nests 1 levels deep"),
        ([[[1]], [[2]]], [2, 1], "nests deeper than shape"),
        ([[1, 2]], [2], "a list of 1 at depth 0"),
        ([[1]], [], "nests deeper than shape"),
        ([1, 2, 3], [2, 2], "has 3 elements, but the shape needs 4"),
        ([[1, 2], ["a", 4]], [2, 2], "does not hold FP32 values"),
        ([1, "a"], [2], "BYTES data must be strings"),
        ([True, 1], [2], "BOOL data must be true or false"),
    ],
)
def test_data_that_does_not_fit_the_shape_is_named(data, shape, message):
    datatype = "BYTES" if message.startswith("BYTES") else "BOOL" if message.startswith("BOOL") else "FP32"
    with pytest.raises(InvalidArgument, match=message):
        decoded(data, shape, datatype)


def test_zero_dims_and_scalars():
    assert decoded([], [2, 0, 3]).shape == (2, 0, 3)
    assert decoded([[], []], [2, 0]).shape == (2, 0)
    assert decoded([7], []).shape == ()


def test_deep_then_wide_costs_one_pass():
    data = b"[" * 1000 + b"0" + b"]" * 999 + b",0" * 200_000 + b"]"
    raw = b'{"inputs":[{"name":"x","datatype":"FP32","shape":[200001],"data":' + data + b"}]}"
    started = time.perf_counter()
    with pytest.raises(InvalidArgument, match="nests deeper than shape"):
        parse_infer_request(raw, None, "m", "")
    assert time.perf_counter() - started < 0.5  # 18 s on the old codec, which flattened once per level


def test_caps_are_checked_on_the_header_before_any_data_is_decoded():
    raw = body([], [1 << 30])
    request, _, pending = parse_infer_header(raw, None, "m", "")
    with pytest.raises(PayloadTooLarge, match=r"has 1073741824 elements, more than the limit of 67108864"):
        InputLimits().check_shapes(request)
    with pytest.raises(PayloadTooLarge, match="sized as 4611686018427387904 elements"):
        parse_infer_request(body([], [0, 1 << 62]), None, "m", "")
    with pytest.raises(PayloadTooLarge, match="rule max_string_elements"):
        parse_infer_request(body([""] * 3, [3], "BYTES"), None, "m", "", InputLimits(max_string_elements=2))
    with pytest.raises(PayloadTooLarge, match="rule max_request_tensors"):
        parse_infer_header(orjson.dumps({"inputs": [{"name": "x"}] * 5}), None, "m", "", InputLimits(max_request_tensors=4))


def test_a_json_body_with_too_many_values_is_refused_before_it_is_parsed():
    limits = InputLimits(max_listed_values=1000)
    with pytest.raises(PayloadTooLarge, match=r"the request's JSON holds \d+ values.*rule max_listed_values"):
        parse_infer_header(body([0] * 5000, [5000]), None, "m", "", limits)
    parse_infer_header(body([0] * 100, [100]), None, "m", "", limits)


def test_json_deeper_than_the_parser_allows():
    with pytest.raises(InvalidArgument, match="nests deeper than 1024 levels"):
        parse_infer_header(b"[" * 2000 + b"]" * 2000, None, "m", "")


def test_grpc_contents_are_counted_before_they_are_built():
    tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="BYTES", shape=[1])
    tensor.contents.bytes_contents.extend([b""] * 2_000_000)
    message = pb.ModelInferRequest(model_name="m", inputs=[tensor])
    started = time.perf_counter()
    with pytest.raises(PayloadTooLarge, match="holds 2000000 values.*rule max_listed_values"):
        to_infer_request_header(message)
    assert time.perf_counter() - started < 0.05
    tensor = pb.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[2, 2])
    tensor.contents.fp32_contents.extend([1, 2, 3, 4])
    request = to_infer_request(pb.ModelInferRequest(model_name="m", inputs=[tensor]))
    np.testing.assert_array_equal(request.inputs[0].to_numpy(), [[1, 2], [3, 4]])


# ---- masking and deny-list patterns: linear, capped, off the loop when large ---------------------------------


def echo_spec(**params) -> ModelSpec:
    return ModelSpec(
        name="echo", version="1", max_batch_size=8,
        inputs=(TensorSpec("text", "BYTES", (1,)),), outputs=(TensorSpec("echo", "BYTES", (1,)),),
        parameters={"mask_patterns": "email,phone,id_card", **params},
    )  # fmt: skip


def texts(*items: bytes) -> InferResponse:
    return InferResponse("echo", "1", [Tensor("echo", "BYTES", (len(items), 1), serialize_bytes(np.array(items, object)))])


def _mask_time(masker: Masker, text: bytes) -> float:
    started = time.perf_counter()
    masker.mask_element(text)
    return time.perf_counter() - started


@pytest.mark.parametrize("filler", [b"a", b"1", b"a@", b"1 ", b"+1 ", b"a@b.", b"1-"])
def test_masking_is_linear(filler):
    """Ten times the text costs about ten times the time (a quadratic pattern: a hundred); a ratio, so load cancels."""
    masker = Masker([MaskRule(n, builtin_pattern(n), b"[X]") for n in ("email", "phone", "id_card")])
    small = filler * (100_000 // len(filler))
    small_s = min(_mask_time(masker, small) for _ in range(3))
    ratio = _mask_time(masker, small * 10) / max(small_s, 1e-3)
    assert ratio < 30, f"{filler!r}: 10x the text took {ratio:.0f}x the time"


def test_forty_kilobytes_and_a_megabyte_of_a_mask_in_milliseconds():
    masker = Masker([MaskRule(n, builtin_pattern(n), b"[X]") for n in ("email", "phone", "id_card")])
    assert _mask_time(masker, b"a" * 40_000) < 0.1  # 6.5 s with the old e-mail pattern
    assert _mask_time(masker, b"a" * 1_000_000) < 1.0


def test_builtin_patterns_still_find_what_they_should():
    masked = MaskingPolicies().mask(
        echo_spec(mask_style="token"),
        texts(b"write to john.doe@mail.example.com. or call (555) 123-4567, id 11010519491231002X"),
    )
    assert masked.outputs[0].to_numpy()[0, 0] == b"write to [EMAIL]. or call [PHONE], id [ID_CARD]"


def test_custom_patterns_run_on_re2_so_none_is_catastrophic():
    pattern = compile_pattern("evil", r"(a+)+$", "test")
    started = time.perf_counter()
    assert pattern.search(b"a" * 100_000 + b"b") is None
    assert time.perf_counter() - started < 0.1
    with pytest.raises(InvalidArgument, match="not a valid regular expression for RE2.*look-arounds"):
        compile_pattern("lookbehind", r"(?<!\d)\d{4}", "test")
    with pytest.raises(InvalidArgument, match="RE2"):
        compile_deny_list({"backref": r"(a)\1"})
    deny = compile_deny_list({"secret": "机密", "id_card": None})
    assert deny["secret"].search("这是机密文件".encode()) is not None


def test_masking_refuses_more_than_it_may_scan():
    policies = MaskingPolicies(max_scan_bytes=1000)
    with pytest.raises(PayloadTooLarge, match="setting mask_max_scan_bytes"):
        policies.mask(echo_spec(), texts(b"x" * 2000))
    assert policies.mask(echo_spec(), texts(b"x" * 100)).outputs[0].to_numpy()[0, 0] == b"x" * 100


async def test_large_masking_leaves_the_loop_free():
    policies = MaskingPolicies(max_scan_bytes=None)
    response = texts(*([b"call 13800138000 " * 200] * 400))  # 1.3 MB
    ticks = []

    async def ticker():
        while True:
            ticks.append(time.perf_counter())
            await asyncio.sleep(0.005)

    task = asyncio.create_task(ticker())
    masked = await policies.mask_async(echo_spec(), response)
    task.cancel()
    assert b"13*******00" in masked.outputs[0].to_numpy()[0, 0]
    gaps = np.diff(ticks) if len(ticks) > 1 else np.array([0.0])
    assert len(ticks) > 3 and gaps.max() < 0.1


# ---- the loop-lag probe ---------------------------------------------------------------------------------------


async def test_loop_lag_probe_sees_a_blocked_loop():
    probe = LoopLagProbe("test-probe", interval_s=0.01).start()
    await asyncio.sleep(0.05)
    time.sleep(0.15)  # noqa: ASYNC251 - the stall under test
    await asyncio.sleep(0.05)
    probe.stop()
    assert probe.max_s >= 0.1 and probe.stall_max_s > 0.0
    sample = metrics.EVENT_LOOP_LAG_MAX.labels("test-probe")._value.get()
    assert sample == pytest.approx(probe.max_s)


def test_cpu_wait_is_not_counted_as_a_stall():
    probe = LoopLagProbe("test-wait")
    probe.record(0.3, waited_s=0.28)
    assert probe.max_s == 0.3 and probe.stall_max_s == pytest.approx(0.02)


async def test_offload_runs_small_work_inline_and_large_work_in_a_thread():
    import threading

    here = threading.get_ident()
    assert await offload(threading.get_ident, large=False) == here
    assert await offload(threading.get_ident, large=True) != here


# ---- 400s where 500s were (finding 10) ------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["²", "9" * 5000, "٣", "-1", 1.5, True])
def test_bad_priorities_are_400(value):
    with pytest.raises(InvalidArgument, match="parameter 'priority'"):
        parse_priority(value)
    assert parse_priority("3") is not None and parse_priority(0) is None


@pytest.mark.parametrize("value", ["²", "9" * 5000, float("nan"), float("inf"), 1e300, -1, 2**64])
def test_bad_timeouts_are_400(value):
    with pytest.raises(InvalidArgument, match="parameter 'timeout'"):
        parse_timeout_us(value)
    assert parse_timeout_us("1500000") == 1_500_000


@pytest.mark.parametrize("text", ["1e18", "-1", "nan", "inf", "9999-12-31T23:59:59Z"])
def test_usage_times_out_of_range_are_400(text):
    with pytest.raises(InvalidArgument, match="not a time between 1970 and 9000"):
        parse_time(text, "start")


def test_all_refusals_are_aiworks_errors():
    for call in (lambda: parse_time("1e18"), lambda: parse_priority("²")):
        with pytest.raises(AIWorksError) as info:
            call()
        assert info.value.status.http < 500


def test_spec_replace_keeps_masking_params():
    assert replace(echo_spec(), version="2").parameters["mask_patterns"] == "email,phone,id_card"
