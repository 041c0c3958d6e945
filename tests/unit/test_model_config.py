import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import InvalidArgument
from aiworks.core.model_config import ModelSpec, TensorSpec, VersionPolicy, check_inputs, parse_config, reshaped

CONFIG = """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: { latest { num_versions: 2 } }
input [ { name: "x" data_type: TYPE_FP32 dims: [ -1, 3 ] } ]
output [ { name: "y" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 500 }
instance_group [ { count: 2 kind: KIND_CPU } ]
optimization { graph { level: 1 } }
parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
"""


def test_triton_config_fields_are_read():
    c = parse_config(CONFIG, fmt="pbtxt", model_name="m")
    assert c.max_batch_size == 8
    assert c.inputs == (TensorSpec("x", "FP32", (-1, 3)),)
    # As in Triton: dims is what clients see, reshape what the model makes.
    assert c.outputs == (TensorSpec("y", "INT64", (1,), ()),)
    assert c.batching.enabled and c.batching.max_queue_delay_us == 500 and c.batching.preferred_batch_sizes == (4, 8)
    assert c.instance_count == 2 and c.graph_optimization_level == 1
    assert c.parameters == {"intra_op_thread_count": "2"}
    assert c.version_policy.select([1, 2, 3]) == [2, 3]


def test_json_config_and_name_mismatch():
    c = parse_config('{"max_batch_size": 4}', fmt="json", model_name="m")
    assert c.max_batch_size == 4 and not c.batching.enabled
    with pytest.raises(InvalidArgument, match="does not match its folder"):
        parse_config('name: "other"', fmt="pbtxt", model_name="m")


def test_bad_config_is_a_clear_error():
    with pytest.raises(InvalidArgument, match="model 'm' config"):
        parse_config("max_batch_size: 'eight'", fmt="pbtxt", model_name="m")


@pytest.mark.parametrize(
    "policy,available,expected",
    [(VersionPolicy("all"), [3, 1, 2], [1, 2, 3]), (VersionPolicy("specific", versions=(1, 3)), [1, 2, 3], [1, 3]),
     (VersionPolicy("latest", num_versions=1), [1, 2], [2])],
)
def test_version_policy(policy, available, expected):
    assert policy.select(available) == expected


SPEC = ModelSpec(
    "m", "1", max_batch_size=4, inputs=(TensorSpec("x", "FP32", (-1, 3)),), outputs=(TensorSpec("y", "INT64", ()),)
)


def fp32(shape, n=None):
    count = 1
    for d in shape:
        count *= d
    return Tensor("x", "FP32", shape, b"\0" * (4 * (count if n is None else n)))


def test_check_inputs_counts_rows():
    assert check_inputs(SPEC, [fp32((3, 5, 3))]) == 3


@pytest.mark.parametrize(
    "tensors,message",
    [
        ([Tensor("z", "FP32", (1, 1, 3), b"\0" * 12)], "unexpected input 'z'"),
        ([Tensor("x", "INT32", (1, 1, 3), b"\0" * 12)], "datatype INT32, model 'm' expects FP32"),
        ([fp32((1, 3))], "expects \\[-1, -1, 3\\]"),
        ([fp32((1, 2, 4))], "expects \\[-1, -1, 3\\]"),
        ([fp32((5, 1, 3))], "batch size 5, model 'm' accepts 1..4"),
        ([fp32((1, 1, 3), n=2)], "8 bytes of data"),
        ([], "missing input"),
    ],
)
def test_check_inputs_names_the_problem(tensors, message):
    with pytest.raises(InvalidArgument, match=message):
        check_inputs(SPEC, tensors)


def test_reshape_keeps_triton_meaning_dims_for_clients_reshape_for_the_model():
    c = parse_config(
        """
        max_batch_size: 0
        input [ { name: "data_0" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] reshape: { shape: [ 1, 3, 224, 224 ] } } ]
        output [ { name: "fc6_1" data_type: TYPE_FP32 dims: [ 1000 ] reshape: { shape: [ 1, 1000, 1, 1 ] } } ]
        """,
        fmt="pbtxt",
        model_name="densenet_onnx",
    )
    [data], [fc] = c.inputs, c.outputs
    assert data.dims == (3, 224, 224) and data.reshape == (1, 3, 224, 224)
    assert c.spec("1").full_shape(data) == [3, 224, 224]
    assert c.spec("1").full_shape(fc) == [1000]
    assert reshaped((3, 224, 224), False, data.dims, data.reshape) == (1, 3, 224, 224)
    assert reshaped((1, 1000, 1, 1), False, fc.reshape, fc.dims) == (1000,)


def test_reshape_with_a_batch_dim_and_variable_dims():
    assert reshaped((5, 1), True, (1,), ()) == (5,)  # a scalar per row, shown as [1]
    assert reshaped((5,), True, (), (1,)) == (5, 1)
    assert reshaped((2, 7, 4), True, (-1, 4), (-1, 2, 2)) == (2, 7, 2, 2)  # variable dims carried in order
    assert reshaped((2, 12), True, (-1,), (3, -1)) == (2, 3, 4)  # one variable dim: sizes agree
    with pytest.raises(InvalidArgument, match="of different sizes"):
        parse_config(
            'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] reshape: { shape: [ 3 ] } } ]',
            fmt="pbtxt",
            model_name="m",
        )
