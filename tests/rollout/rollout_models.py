"""The rollout tests' model repository: one model, four versions that differ only in how they behave.

``ranker`` takes ``x`` FP32 ``[4]`` per row and answers ``y = x @ W`` (``[4]``).

- version 1 and version 4: that, and nothing else (4 is the "new" version
  that is in fact the same graph: a healthy canary).
- version 2 fails for about 20% of requests. A graph cannot fail at random,
  so it fails on demand: when any input element equals ``TRIGGER`` (999), the
  output is reshaped to ``[-1, 5]``, which 4 values per row cannot fill, and
  ONNX Runtime refuses to run the Reshape. The load generator puts the
  trigger into a random 20% of its requests; versions 1, 3 and 4 ignore it.
  The config has no ``dynamic_batching``, so the scheduler runs every
  request on its own and a trigger fails only its own request.
- version 3 is healthy but slow: the same answer plus ``SLOW_MATMULS``
  products of a ``[K, K]`` matrix built from the input (so ONNX Runtime cannot
  fold it away at load) with an orthogonal ``[K, K]`` weight, multiplied by 0
  and added to ``y``: about 34 ms of one core a request on the faster VM
  used here (70 ms on the slower), against 2-10 ms end to end for version 1,
  so its p99 clears both the test policy's 2.5x ratio and its 25 ms floor.
  (96 products, 13 ms on the faster VM, stayed under the floor there.)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MODEL = "ranker"
TRIGGER = 999.0
SLOW_K = 256
SLOW_MATMULS = 240

CONFIG = f"""\
name: "{MODEL}"
platform: "onnxruntime_onnx"
max_batch_size: 8
version_policy: {{ all {{ }} }}
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
parameters {{ key: "intra_op_thread_count" value: {{ string_value: "1" }} }}
"""


def _const(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array, name)


def _graph(kind: str) -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    weights = rng.normal(size=(4, 4)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"])]
    inits = [_const("W", weights)]
    out = "xw"
    if kind == "failing":
        nodes += [
            helper.make_node("Equal", ["x", "trigger"], ["hit"]),
            helper.make_node("Cast", ["hit"], ["hit_f"], to=TensorProto.FLOAT),
            helper.make_node("ReduceMax", ["hit_f"], ["any_hit"], keepdims=0),
            helper.make_node("Cast", ["any_hit"], ["extra"], to=TensorProto.INT64),
            helper.make_node("Reshape", ["extra", "one"], ["extra_1"]),
            helper.make_node("Add", ["four", "extra_1"], ["cols"]),
            helper.make_node("Concat", ["minus_one", "cols"], ["shape"], axis=0),
            helper.make_node("Reshape", [out, "shape"], ["y"]),
        ]
        inits += [
            _const("trigger", np.array(TRIGGER, np.float32)),
            _const("one", np.array([1], np.int64)),
            _const("four", np.array([4], np.int64)),
            _const("minus_one", np.array([-1], np.int64)),
        ]
    elif kind == "slow":
        q, _ = np.linalg.qr(rng.normal(size=(SLOW_K, SLOW_K)))
        nodes += [
            helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
            helper.make_node("Expand", ["total", "square"], ["h0"]),
        ]
        for i in range(SLOW_MATMULS):
            nodes.append(helper.make_node("MatMul", [f"h{i}", "Q"], [f"h{i + 1}"]))
        nodes += [
            helper.make_node("ReduceSum", [f"h{SLOW_MATMULS}"], ["work"], keepdims=0),
            helper.make_node("Mul", ["work", "zero"], ["nothing"]),
            helper.make_node("Add", [out, "nothing"], ["y"]),
        ]
        inits += [
            _const("Q", q.astype(np.float32)),
            _const("square", np.array([SLOW_K, SLOW_K], np.int64)),
            _const("zero", np.array(0.0, np.float32)),
        ]
    else:
        nodes.append(helper.make_node("Identity", [out], ["y"]))
    graph = helper.make_graph(
        nodes,
        f"{MODEL}_{kind}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


VERSIONS = {"1": "healthy", "2": "failing", "3": "slow", "4": "healthy"}


def build_repository(root: Path) -> Path:
    """``root/ranker/{config.pbtxt, 1..4/model.onnx}``; returns ``root``."""
    folder = root / MODEL
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(CONFIG)
    for version, kind in VERSIONS.items():
        (folder / version).mkdir(exist_ok=True)
        onnx.save(_graph(kind), folder / version / "model.onnx")
    return root
