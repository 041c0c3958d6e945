"""Input filters: each rule refuses its case with a 4xx naming the rule, and lets a clean request through."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor, serialize_bytes
from aiworks.core.errors import AIWorksError, InvalidArgument, PayloadTooLarge, Status
from aiworks.core.inference import InferRequest
from aiworks.gateway.filters import InputFilter, check_body_size, compile_deny_list


def floats(rows: int = 2, value: float = 1.0, name: str = "x") -> Tensor:
    return Tensor.from_numpy(name, np.full((rows, 4), value, dtype=np.float32))


def texts(*items: str, name: str = "text") -> Tensor:
    return Tensor(name, "BYTES", (len(items), 1), serialize_bytes(np.array(items, dtype=object)))


def refused(call) -> AIWorksError:
    with pytest.raises(AIWorksError) as info:
        call()
    return info.value


def test_body_size():
    check_body_size(1000, 1000, "acme")
    err = refused(lambda: check_body_size(1001, 1000, "acme"))
    assert isinstance(err, PayloadTooLarge) and err.status.http == 413
    assert (
        err.message
        == "request body of 1001 bytes exceeds the limit of 1000 bytes for tenant 'acme' (rule max_request_bytes)"
    )
    assert refused(lambda: check_body_size(5, 4)).message.endswith("limit of 4 bytes (rule max_request_bytes)")


def test_max_tensor_elements(scale_spec):
    rules = InputFilter(max_tensor_elements=8)
    assert rules.check(InferRequest("scale", inputs=[floats(2)]), scale_spec) == 2
    err = refused(lambda: rules.check(InferRequest("scale", inputs=[floats(3)]), scale_spec))
    assert err.status is Status.PAYLOAD_TOO_LARGE
    assert err.message == "input 'x' has 12 elements, more than the limit of 8 (rule max_tensor_elements)"


def test_max_string_bytes(echo_spec):
    rules = InputFilter(max_string_bytes=10)
    assert rules.check(InferRequest("echo", inputs=[texts("short", "exactly10!")]), echo_spec) == 2
    err = refused(lambda: rules.check(InferRequest("echo", inputs=[texts("ok", "ok", "this is too long")]), echo_spec))
    assert err.status is Status.PAYLOAD_TOO_LARGE
    assert (
        err.message == "input 'text' element 2 is 16 bytes, longer than the limit of 10 bytes (rule max_string_bytes)"
    )


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        (Tensor.from_numpy("x", np.ones((2, 4), dtype=np.float64)), "has datatype FP64, model 'scale' expects FP32"),
        (Tensor.from_numpy("x", np.ones((2, 3), dtype=np.float32)), "has shape [2, 3], model 'scale' expects [-1, 4]"),
        (Tensor.from_numpy("y", np.ones((2, 4), dtype=np.float32)), "unexpected input 'y'"),
        (Tensor("x", "FP32", (2, 4), b"\0" * 12), "12 bytes of data, but shape [2, 4] of FP32 needs 32"),
    ],
)
def test_datatype_and_shape_against_the_metadata(scale_spec, tensor, message):
    err = refused(lambda: InputFilter().check(InferRequest("scale", inputs=[tensor]), scale_spec))
    assert isinstance(err, InvalidArgument) and message in err.message


@pytest.mark.parametrize(("value", "kind"), [(np.nan, "NaN"), (np.inf, "+Inf"), (-np.inf, "-Inf")])
def test_nonfinite_values_when_the_model_says_so(scale_spec, value, kind):
    data = np.ones((2, 4), dtype=np.float32)
    data[1, 2] = value
    request = InferRequest("scale", inputs=[Tensor.from_numpy("x", data)])
    err = refused(lambda: InputFilter().check(request, scale_spec))
    assert isinstance(err, InvalidArgument)
    assert (
        err.message == f"input 'x' element 6 is {kind}; model 'scale' rejects non-finite values (rule reject_nonfinite)"
    )
    # A model that does not ask for it gets the value.
    lenient = replace(scale_spec, parameters={})
    assert InputFilter().check(request, lenient) == 2


def test_nonfinite_check_reads_the_request_bytes_in_place(scale_spec, monkeypatch):
    """The check works on a view of the received buffer (as the HTTP codec hands it over): no copy."""
    body = bytearray(np.ones((2, 4), dtype=np.float32).tobytes())
    request = InferRequest("scale", inputs=[Tensor("x", "FP32", (2, 4), memoryview(body))])
    seen = []
    real = np.frombuffer
    monkeypatch.setattr(np, "frombuffer", lambda raw, **kw: seen.append(real(raw, **kw)) or seen[-1])
    InputFilter().check(request, scale_spec)
    assert seen and np.shares_memory(seen[0], np.frombuffer(body, dtype=np.uint8))


def test_deny_list(echo_spec):
    rules = InputFilter(deny_patterns=compile_deny_list({"ssn": r"\b\d{3}-\d{2}-\d{4}\b", "id_card": None}))
    clean = InferRequest("echo", inputs=[texts("call me at noon", "order 123-456")])
    assert rules.check(clean, echo_spec) == 2
    err = refused(
        lambda: rules.check(InferRequest("echo", inputs=[texts("a", "b", "c", "my ssn is 078-05-1120")]), echo_spec)
    )
    assert isinstance(err, InvalidArgument)
    assert err.message == "input 'text' element 3 matches deny-list pattern 'ssn'"
    err = refused(lambda: rules.check(InferRequest("echo", inputs=[texts("id 11010519491231002X")]), echo_spec))
    assert err.message == "input 'text' element 0 matches deny-list pattern 'id_card'"


def test_deny_list_matches_non_ascii_text_literally(echo_spec):
    rules = InputFilter(deny_patterns=compile_deny_list({"secret": "机密"}))
    assert rules.check(InferRequest("echo", inputs=[texts("公开资料")]), echo_spec) == 1
    err = refused(lambda: rules.check(InferRequest("echo", inputs=[texts("这是机密文件")]), echo_spec))
    assert err.message == "input 'text' element 0 matches deny-list pattern 'secret'"


def test_size_rules_run_before_the_model_check(scale_spec):
    """A huge tensor is refused by its shape alone, before its data is walked or compared."""
    huge = Tensor("x", "FP32", (1_000_000, 4), b"")
    err = refused(lambda: InputFilter(max_tensor_elements=1000).check(InferRequest("scale", inputs=[huge]), scale_spec))
    assert err.status is Status.PAYLOAD_TOO_LARGE


def test_without_the_metadata_check_the_other_rules_still_apply(scale_spec):
    """Demo mode: shape and datatype are the scheduler's to refuse, the model's NaN rule still holds."""
    rules = InputFilter()
    wrong_shape = InferRequest("scale", inputs=[Tensor.from_numpy("x", np.ones((3, 5), dtype=np.float32))])
    assert rules.check(wrong_shape, scale_spec, against_metadata=False) == 3
    assert refused(lambda: rules.check(wrong_shape, scale_spec)).status is Status.INVALID_ARGUMENT
    torn = InferRequest("scale", inputs=[Tensor("x", "FP32", (1, 4), b"\x00" * 15)])  # not whole floats
    assert rules.check(torn, scale_spec, against_metadata=False) == 1
    nan = InferRequest("scale", inputs=[floats(1, float("nan"))])
    assert "(rule reject_nonfinite)" in refused(lambda: rules.check(nan, scale_spec, against_metadata=False)).message
