"""Models with the names and signatures of Triton's example and QA models, built here (no download).

Triton's client examples (triton-inference-server/client, ``src/python/examples``) expect these models;
their names, data types and dims follow Triton's ``docs/examples/model_repository``. The graphs are our own,
made with ``onnx.helper``:

- ``simple``: INT32 ``INPUT0``, ``INPUT1`` of dims [16], ``max_batch_size: 8``;
  ``OUTPUT0 = INPUT0 + INPUT1``, ``OUTPUT1 = INPUT0 - INPUT1``.
- ``simple_int8``: the same in INT8.
- ``simple_string``: the same over ``TYPE_STRING`` tensors holding decimal numbers: each input is cast to
  INT32, and the sum and difference are cast back to strings.
- ``simple_identity``: ``TYPE_STRING`` ``INPUT0`` of dims [-1] answered as ``OUTPUT0``.
- ``densenet_onnx``: DenseNet-121's signature as Triton's example declares it: input ``data_0`` FP32
  dims [3, 224, 224] with ``reshape [1, 3, 224, 224]``, output ``fc6_1`` dims [1000] with
  ``reshape [1, 1000, 1, 1]``, ``max_batch_size: 0``, and a ``densenet_labels.txt``. The network is a small
  convolutional one with fixed, seeded weights: it has the real model's shapes, not its accuracy.

:func:`build_triton_qa_models` writes them in Triton's layout (``aiworks demo-models --qa``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from aiworks.demo.qa_streaming import _graph, build_models
from aiworks.demo.qa_streaming import _write as write_model

SEED = 0


def _simple_config(name: str, triton_type: str) -> str:
    def tensors(prefix: str) -> str:
        return ",\n".join(f'  {{ name: "{prefix}{i}" data_type: {triton_type} dims: [ 16 ] }}' for i in (0, 1))

    return f"""\
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
{tensors("INPUT")}
]
output [
{tensors("OUTPUT")}
]
"""


SIMPLE_IDENTITY_CONFIG = """\
name: "simple_identity"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_STRING dims: [ -1 ] } ]
"""

DENSENET_CONFIG = """\
name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size: 0
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape { shape: [ 1, 3, 224, 224 ] }
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    reshape { shape: [ 1, 1000, 1, 1 ] }
    label_filename: "densenet_labels.txt"
  }
]
"""

DENSENET_CLASSES = 1000


def simple_onnx(onnx_type: str = "INT32") -> bytes:
    """``OUTPUT0 = INPUT0 + INPUT1``, ``OUTPUT1 = INPUT0 - INPUT1`` over [N, 16] tensors of ``onnx_type``."""
    from onnx import TensorProto, helper

    elem = getattr(TensorProto, onnx_type)
    inputs = [helper.make_tensor_value_info(n, elem, [None, 16]) for n in ("INPUT0", "INPUT1")]
    outputs = [helper.make_tensor_value_info(n, elem, [None, 16]) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [
        helper.make_node("Add", ["INPUT0", "INPUT1"], ["OUTPUT0"]),
        helper.make_node("Sub", ["INPUT0", "INPUT1"], ["OUTPUT1"]),
    ]
    return _graph(f"simple_{onnx_type.lower()}", inputs, outputs, nodes)


def simple_string_onnx() -> bytes:
    """The sum and difference of two [N, 16] string tensors of decimal numbers, as strings."""
    from onnx import TensorProto, helper

    string = TensorProto.STRING
    inputs = [helper.make_tensor_value_info(n, string, [None, 16]) for n in ("INPUT0", "INPUT1")]
    outputs = [helper.make_tensor_value_info(n, string, [None, 16]) for n in ("OUTPUT0", "OUTPUT1")]
    nodes = [
        helper.make_node("Cast", ["INPUT0"], ["a"], to=TensorProto.INT32),
        helper.make_node("Cast", ["INPUT1"], ["b"], to=TensorProto.INT32),
        helper.make_node("Add", ["a", "b"], ["sum"]),
        helper.make_node("Sub", ["a", "b"], ["difference"]),
        helper.make_node("Cast", ["sum"], ["OUTPUT0"], to=string),
        helper.make_node("Cast", ["difference"], ["OUTPUT1"], to=string),
    ]
    return _graph("simple_string", inputs, outputs, nodes)


def simple_identity_onnx() -> bytes:
    from onnx import TensorProto, helper

    inputs = [helper.make_tensor_value_info("INPUT0", TensorProto.STRING, [None, None])]
    outputs = [helper.make_tensor_value_info("OUTPUT0", TensorProto.STRING, [None, None])]
    return _graph("simple_identity", inputs, outputs, [helper.make_node("Identity", ["INPUT0"], ["OUTPUT0"])])


def densenet_onnx() -> bytes:
    """[1, 3, 224, 224] -> [1, 1000, 1, 1]: a strided conv, ReLU, global average pool, a 1x1 conv, softmax."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(SEED)
    features = 16
    weights = [
        numpy_helper.from_array((rng.standard_normal((features, 3, 8, 8)) * 0.1).astype(np.float32), "w1"),
        numpy_helper.from_array(np.zeros(features, np.float32), "b1"),
        numpy_helper.from_array(
            rng.standard_normal((DENSENET_CLASSES, features, 1, 1)).astype(np.float32), "w2"
        ),
        numpy_helper.from_array((rng.standard_normal(DENSENET_CLASSES) * 0.1).astype(np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Conv", ["data_0", "w1", "b1"], ["c1"], kernel_shape=[8, 8], strides=[8, 8]),
        helper.make_node("Relu", ["c1"], ["r1"]),
        helper.make_node("GlobalAveragePool", ["r1"], ["pooled"]),
        helper.make_node("Conv", ["pooled", "w2", "b2"], ["logits"], kernel_shape=[1, 1]),
        helper.make_node("Softmax", ["logits"], ["fc6_1"], axis=1),
    ]
    inputs = [helper.make_tensor_value_info("data_0", TensorProto.FLOAT, [1, 3, 224, 224])]
    outputs = [helper.make_tensor_value_info("fc6_1", TensorProto.FLOAT, [1, DENSENET_CLASSES, 1, 1])]
    return _graph("densenet_onnx", inputs, outputs, nodes, weights)


def densenet_labels() -> str:
    """One label a line, a line per class (our own names: the network is not trained on any data set)."""
    return "".join(f"CLASS_{i:03d}\n" for i in range(DENSENET_CLASSES))


def _write(target: Path, name: str, config: str, model: bytes, extra: dict[str, str] | None = None) -> None:
    write_model(target, name, config, {"model.onnx": model}, extra)


BUILDERS = {
    "simple": lambda t: _write(t, "simple", _simple_config("simple", "TYPE_INT32"), simple_onnx("INT32")),
    "simple_int8": lambda t: _write(t, "simple_int8", _simple_config("simple_int8", "TYPE_INT8"), simple_onnx("INT8")),
    "simple_string": lambda t: _write(t, "simple_string", _simple_config("simple_string", "TYPE_STRING"),
                                      simple_string_onnx()),
    "simple_identity": lambda t: _write(t, "simple_identity", SIMPLE_IDENTITY_CONFIG, simple_identity_onnx()),
    "densenet_onnx": lambda t: _write(t, "densenet_onnx", DENSENET_CONFIG, densenet_onnx(),
                                      {"densenet_labels.txt": densenet_labels()}),
}  # fmt: skip
TRITON_QA_MODELS = tuple(BUILDERS)


def build_triton_qa_models(target: Path, names=TRITON_QA_MODELS) -> list[Path]:
    """Write the models ``names`` into the repository at ``target``; returns their folders."""
    return build_models(BUILDERS, target, names)
