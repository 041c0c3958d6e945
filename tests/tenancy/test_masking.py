"""Output masking: built-in and custom patterns, both styles, per-output selection, and config errors."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor, serialize_bytes
from aiworks.core.errors import Internal, InvalidArgument
from aiworks.core.inference import InferResponse
from aiworks.gateway.masking import Masker, MaskingPolicies


def texts(*items: str, name: str = "echo") -> Tensor:
    return Tensor(name, "BYTES", (len(items), 1), serialize_bytes(np.array(items, dtype=object)))


def values(tensor: Tensor) -> list[str]:
    return [v.decode() for v in tensor.to_numpy().ravel()]


def mask(spec, *items: str, **params) -> list[str]:
    spec = replace(spec, parameters={**spec.parameters, **params})
    response = InferResponse("echo", "1", [texts(*items)])
    return values(MaskingPolicies().mask(spec, response).outputs[0])


@pytest.mark.parametrize(
    ("text", "masked"),
    [
        ("mail john.doe@example.com now", "mail jo****************om now"),
        ("call 13800138000", "call 13*******00"),
        ("call +86 138 0013 8000", "call +8*************00"),
        ("call (555) 123-4567", "call (5**********67"),
        ("call +44 20 7946 0958", "call +4************58"),
        ("id 11010519491231002X", "id 11**************2X"),
        ("ssn 078-05-1120", "ssn 07*******20"),
    ],
)
def test_builtin_patterns_partial(echo_spec, text, masked):
    assert mask(echo_spec, text) == [masked]


@pytest.mark.parametrize(
    "text",
    [
        "order 12345, total 99.50",
        "ticket 2024-01-15",
        "build 110105194912310021234",  # digits longer than an ID card
        "ssn-like 000-12-3456",  # area 000 is never issued
        "version 1.2.3 at noon",
    ],
)
def test_clean_text_is_untouched(echo_spec, text):
    assert mask(echo_spec, text) == [text]


def test_token_style(echo_spec):
    assert mask(echo_spec, "a@b.io or 13800138000", mask_style="token") == ["[EMAIL] or [PHONE]"]
    assert mask(echo_spec, "a@b.io", mask_style="token", mask_token="<hidden>") == ["<hidden>"]
    assert mask(echo_spec, "a@b.io", mask_style="token", mask_token=r"\1 \g<0>") == [r"\1 \g<0>"]  # not a template


def test_keep_prefix_and_suffix(echo_spec):
    assert mask(echo_spec, "13800138000", mask_keep="3,4") == ["138****8000"]
    assert mask(echo_spec, "13800138000", mask_keep="0,0") == ["***********"]


def test_custom_pattern(echo_spec):
    out = mask(echo_spec, "employee EMP-123456 wrote", mask_patterns="staff", **{"mask_pattern.staff": r"EMP-\d{6}"})
    assert out == ["employee EM******56 wrote"]


def test_only_selected_outputs_are_masked(echo_spec):
    spec = replace(
        echo_spec,
        outputs=(*echo_spec.outputs, replace(echo_spec.outputs[0], name="raw")),
        parameters={**echo_spec.parameters, "mask_outputs": "echo"},
    )
    response = InferResponse("echo", "1", [texts("a@b.io"), texts("a@b.io", name="raw")])
    MaskingPolicies().mask(spec, response)
    assert values(response.outputs[0]) == ["a@**io"]
    assert values(response.outputs[1]) == ["a@b.io"]


def test_unchanged_tensors_are_not_copied(echo_spec):
    tensor = texts("nothing to hide", "still nothing")
    masker = Masker.from_spec(echo_spec)
    assert masker.mask_tensor(tensor) is tensor
    response = InferResponse("echo", "1", [tensor, Tensor.from_numpy("score", np.ones((2, 1), np.float32))])
    masker.mask_response(response)
    assert response.outputs[0] is tensor


def test_masking_keeps_the_tensor_well_formed(echo_spec):
    tensor = texts("x@y.com", "", "中文 13800138000 结束")
    masked = Masker.from_spec(echo_spec).mask_tensor(tensor)
    assert masked.shape == tensor.shape and masked.name == tensor.name
    assert values(masked) == ["x@***om", "", "中文 13*******00 结束"]


def test_no_masking_without_the_parameter(echo_spec):
    spec = replace(echo_spec, parameters={})
    assert Masker.from_spec(spec) is None
    response = InferResponse("echo", "1", [texts("a@b.io")])
    assert values(MaskingPolicies().mask(spec, response).outputs[0]) == ["a@b.io"]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"mask_patterns": "email,nope"}, "names pattern 'nope', which is neither built in"),
        ({"mask_style": "blur"}, "'mask_style' is 'blur'"),
        ({"mask_keep": "two"}, "'mask_keep' is 'two'; use 'prefix,suffix'"),
        ({"mask_patterns": "x", "mask_pattern.x": "("}, "pattern 'x' is not a valid regular expression"),
        ({"mask_patterns": "x", "mask_pattern.x": "a*"}, "pattern 'x' matches the empty string"),
        ({"mask_outputs": "missing"}, "'mask_outputs' names 'missing', which is not a BYTES output"),
    ],
)
def test_config_errors_name_the_model_and_parameter(echo_spec, params, message):
    spec = replace(echo_spec, parameters={**echo_spec.parameters, **params})
    with pytest.raises(InvalidArgument, match="model 'echo' config") as info:
        Masker.from_spec(spec)
    assert message in info.value.message


def test_a_misconfigured_model_is_a_server_error(echo_spec):
    spec = replace(echo_spec, parameters={"mask_patterns": "nope"})
    with pytest.raises(Internal, match="output masking is misconfigured: model 'echo' config"):
        MaskingPolicies().mask(spec, InferResponse("echo", "1", [texts("a@b.io")]))


def test_policies_compile_once_per_config(echo_spec, monkeypatch):
    policies = MaskingPolicies()
    built = []
    real = Masker.from_spec.__func__
    monkeypatch.setattr(Masker, "from_spec", classmethod(lambda cls, spec: built.append(spec) or real(cls, spec)))
    for _ in range(3):
        policies.mask(echo_spec, InferResponse("echo", "1", [texts("a@b.io")]))
    assert len(built) == 1
    policies.mask(
        replace(echo_spec, parameters={**echo_spec.parameters, "mask_style": "token"}), InferResponse("echo", "1", [])
    )
    assert len(built) == 2  # a reloaded model with new parameters gets a new masker
