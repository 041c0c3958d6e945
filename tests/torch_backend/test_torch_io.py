"""Triton's pytorch naming rules and the CUDA-graph plan, as plain functions (no model loads)."""

from __future__ import annotations

import pytest

from aiworks.core.errors import InvalidArgument
from aiworks.core.model_config import parse_config
from aiworks.runtime.torch_io import graph_plan, padded_size, plan_inputs, plan_outputs, select_outputs


def test_inputs_named_after_forward_arguments_map_by_name_whatever_their_order():
    plan = plan_inputs("m", ["attention_mask", "input_ids"], ["input_ids", "attention_mask"])
    assert plan.convention == "forward argument names"
    assert plan.arguments(["MASK", "IDS"]) == ["IDS", "MASK"]


def test_indexed_names_map_by_their_index():
    plan = plan_inputs("m", ["b__1", "a__0"], ["x", "y"])
    assert plan.convention == "<name>__<index>"
    assert plan.arguments(["B", "A"]) == ["A", "B"]
    with pytest.raises(InvalidArgument, match="indices"):
        plan_inputs("m", ["INPUT__0", "INPUT__2"], None)


def test_other_names_map_by_config_order_and_counts_must_agree():
    plan = plan_inputs("m", ["first", "second"], ["x", "y"])
    assert plan.convention == "config order" and plan.arguments([1, 2]) == [1, 2]
    with pytest.raises(InvalidArgument, match="takes 3 input"):
        plan_inputs("m", ["first", "second"], ["x", "y", "z"])
    with pytest.raises(InvalidArgument, match="also takes"):
        plan_inputs("m", ["x"], ["x", "y"])


def test_a_dict_forward_takes_the_inputs_by_name():
    assert plan_inputs("m", ["a", "b"], ["inputs"], dict_input=True).dict_input


def test_outputs_by_index_or_config_order_or_dict_key():
    assert plan_outputs(["OUTPUT__1", "OUTPUT__0"]) == (1, 0)
    assert plan_outputs(["embedding", "logits"]) == (0, 1)
    assert select_outputs("m", ("p", "l"), ["OUTPUT__1", "OUTPUT__0"], (1, 0)) == ["l", "p"]
    assert select_outputs("m", "only", ["OUTPUT__0"], (0,)) == ["only"]
    assert select_outputs("m", {"a": 1, "b": 2}, ["b"], (0,)) == [2]
    with pytest.raises(InvalidArgument, match="returned 2 output"):
        select_outputs("m", ("p", "l"), ["OUTPUT__2"], (2,))
    with pytest.raises(InvalidArgument, match="no output"):
        select_outputs("m", {"a": 1}, ["b"], (0,))


BASE = """
name: "m"
platform: "pytorch_libtorch"
max_batch_size: 64
input [ { name: "ids" data_type: TYPE_INT64 dims: [ -1 ] }, { name: "mask" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "out" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def config(extra: str, base: str = BASE):
    return parse_config(base + extra, fmt="pbtxt", model_name="m")


def test_graph_plan_from_graph_spec_with_the_variable_dims():
    plan = graph_plan(
        config("""
        optimization { cuda { graphs: true
          graph_spec [ { batch_size: 8 input { key: "ids" value { dim: [ 32 ] } } input { key: "mask" value { dim: [ 32 ] } } },
                       { batch_size: 2 input { key: "ids" value { dim: [ 32 ] } } input { key: "mask" value { dim: [ 32 ] } } },
                       { batch_size: 4 input { key: "ids" value { dim: [ 16 ] } } input { key: "mask" value { dim: [ 16 ] } } } ] } }
    """)
    )
    assert plan == {((32,), (32,)): (2, 8), ((16,), (16,)): (4,)}


def test_graph_plan_errors_name_the_problem():
    with pytest.raises(InvalidArgument, match="fixed input dims"):
        graph_plan(config("optimization { cuda { graphs: true } }"))
    with pytest.raises(InvalidArgument, match="batch_size 128"):
        graph_plan(config("optimization { cuda { graphs: true graph_spec [ { batch_size: 128 } ] } }"))
    with pytest.raises(InvalidArgument, match="unknown inputs"):
        graph_plan(
            config(
                'optimization { cuda { graphs: true graph_spec [ { batch_size: 1 input { key: "x" value { dim: [ 1 ] } } } ] } }'
            )
        )
    with pytest.raises(InvalidArgument, match="do not fit"):
        graph_plan(
            config(
                'optimization { cuda { graphs: true graph_spec [ { batch_size: 1 input { key: "ids" value { dim: [ 2, 3 ] } } } ] } }'
            )
        )


def test_graph_plan_for_fixed_dims_uses_preferred_sizes_or_powers_of_two():
    fixed = BASE.replace("dims: [ -1 ]", "dims: [ 16 ]")
    assert graph_plan(config("optimization { cuda { graphs: true } }", fixed)) == {
        ((16,), (16,)): (1, 2, 4, 8, 16, 32, 64)
    }
    preferred = "dynamic_batching { preferred_batch_size: [ 8, 32 ] } optimization { cuda { graphs: true } }"
    assert graph_plan(config(preferred, fixed)) == {((16,), (16,)): (8, 32)}
    assert graph_plan(config("", fixed)) == {}  # graphs off


def test_a_batch_is_padded_to_the_next_captured_size():
    sizes = (1, 2, 4, 8)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
