"""Cache keys and policies: keys differ whenever the result may, and similar mode hits only where it should."""

from __future__ import annotations

import numpy as np
import pytest

from aiworks.cache.keys import normalize_text, request_key
from aiworks.cache.policy import CachePolicy, skip_reason
from aiworks.core.datatypes import Tensor

EXACT = CachePolicy(enabled=True)
SIMILAR = CachePolicy(enabled=True, mode="similar", round_decimals=2)


def fp32(values, name="x") -> Tensor:
    return Tensor.from_numpy(name, np.asarray(values, dtype=np.float32))


def text(*values, name="text") -> Tensor:
    return Tensor.from_numpy(name, np.array([[v] for v in values], dtype=np.object_))


def key(inputs, *, model="m", version="1", outputs=(), parameters=None, policy=EXACT) -> bytes:
    return request_key(model, version, list(inputs), list(outputs), parameters or {}, policy)


BASE = dict(inputs=[fp32([[1.0, 2.0]]), Tensor.from_numpy("mask", np.array([[1, 0]], dtype=np.int32))])


@pytest.mark.parametrize(
    "change",
    [
        dict(model="other"),
        dict(version="2"),
        dict(inputs=[fp32([[1.0, 2.0000002]]), BASE["inputs"][1]]),  # one bit of one float
        dict(inputs=[fp32([[1.0], [2.0]]), BASE["inputs"][1]]),  # same bytes, other shape
        dict(inputs=[Tensor("x", "INT32", (1, 2), fp32([[1.0, 2.0]]).raw), BASE["inputs"][1]]),  # same bytes
        dict(inputs=[fp32([[1.0, 2.0]], name="z"), BASE["inputs"][1]]),  # input name
        dict(inputs=[BASE["inputs"][0]]),  # an input less
        dict(outputs=["y"]),
        dict(parameters={"temperature": 0.5}),
        dict(policy=SIMILAR),
    ],
    ids=["model", "version", "bytes", "shape", "datatype", "name", "inputs", "outputs", "parameter", "mode"],
)
def test_keys_differ_when_anything_relevant_differs(change):
    assert key(**{**BASE, **change}) != key(**BASE)


def test_keys_ignore_what_cannot_change_the_result():
    base = key(**BASE)
    assert key(inputs=list(reversed(BASE["inputs"]))) == base  # input order
    neutral = {"binary_data_output": True, "priority": 1, "timeout": 5000, "cache": True}
    assert key(**BASE, parameters=neutral) == base
    # Parameter order does not matter, values do.
    assert key(**BASE, parameters={"a": 1, "b": 2}) == key(**BASE, parameters={"b": 2, "a": 1})
    assert key(**BASE, parameters={"a": 1}) != key(**BASE, parameters={"a": "1"})


def test_similar_mode_rounds_floats_and_only_within_the_rounding():
    k = key([fp32([[0.1234, -0.0001]])], policy=SIMILAR)
    assert key([fp32([[0.1203, 0.0004]])], policy=SIMILAR) == k  # both round to (0.12, 0.0); -0.0 is 0.0
    assert key([fp32([[0.1251, 0.0]])], policy=SIMILAR) != k  # 0.13
    assert key([fp32([[0.1234, 0.0]])]) != key([fp32([[0.1203, 0.0]])])  # exact mode: no
    ints = [Tensor.from_numpy("i", np.array([[1, 2]], dtype=np.int64))]
    assert key(ints, policy=SIMILAR) != key([Tensor.from_numpy("i", np.array([[1, 3]], dtype=np.int64))], policy=SIMILAR)


def test_similar_mode_normalizes_text_and_only_text():
    k = key([text("Hello World")], policy=SIMILAR)
    assert key([text("  hello   WORLD \n")], policy=SIMILAR) == k
    assert key([text("hello world!")], policy=SIMILAR) != k
    assert key([text("helloworld")], policy=SIMILAR) != k
    assert key([text("  hello   WORLD \n")]) != key([text("Hello World")])  # exact mode: no
    assert normalize_text(b"\xff\xfe A") == b"\xff\xfe A"  # not UTF-8: kept as it is
    assert normalize_text("\tÉTÉ  à\u00a0Paris ".encode()) == "été à paris".encode()


def test_policy_comes_from_the_config_and_is_off_by_default():
    assert not CachePolicy.from_parameters({}).enabled
    assert not CachePolicy.from_parameters({"cache_mode": "similar"}).enabled  # no response_cache
    p = CachePolicy.from_parameters(
        {"response_cache": "true", "cache_mode": "similar", "cache_round_decimals": "4", "cache_ttl_s": "60"}
    )
    assert (p.enabled, p.mode, p.round_decimals, p.ttl_s) == (True, "similar", 4, 60.0)
    assert p.tag == "similar:4" and EXACT.tag == "exact"
    for bad in ({"cache_mode": "fuzzy"}, {"cache_round_decimals": "x"}, {"cache_ttl_s": "-1"}):
        assert not CachePolicy.from_parameters({"response_cache": "true", **bad}).enabled


@pytest.mark.parametrize(
    "parameters, reason",
    [
        ({}, None),
        ({"cache": True, "priority": 2}, None),
        ({"cache": False}, "bypass"),
        ({"cache": "false"}, "bypass"),
        ({"cache_bypass": True}, "bypass"),
        ({"nondeterministic": True}, "nondeterministic"),
        ({"sequence_id": 7}, "sequence"),
        ({"sequence_id": 0}, None),
    ],
)
def test_requests_can_skip_the_cache(parameters, reason):
    assert skip_reason(parameters) == reason


def test_keys_are_per_tenant_unless_the_policy_shares_them():
    def tkey(tenant, policy=EXACT) -> bytes:
        return request_key("m", "1", BASE["inputs"], [], {}, policy, tenant=tenant)

    assert tkey("alice") != tkey("bob")
    assert tkey("alice") == tkey("alice")
    assert tkey("") != tkey("alice") and tkey("") != tkey(None)  # demo mode's anonymous tenant is a tenant too
    shared = CachePolicy(enabled=True, shared=True)
    assert tkey("alice", shared) == tkey("bob", shared) == tkey(None, shared)
    # Shared entries keep the keys the cache had before it knew tenants (no tenant, the same digest).
    assert tkey(None) == key(**BASE) == tkey("alice", shared)
    # A tenant name cannot be crafted to reach another key space: "alice" + model "m" is not tenant "" + "alicem".
    assert request_key("m", "1", [], [], {}, EXACT, tenant="alice") != request_key(
        "alicem", "1", [], [], {}, EXACT, tenant=""
    )
