"""The runtime's data plane with real ONNX Runtime on tiny generated models."""

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import InvalidArgument, NotFound
from aiworks.core.inference import InferRequest
from aiworks.core.options import RequestOptions
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.repository import ModelRepository


def write_model(folder: Path, factor: float) -> None:
    """y = x * factor, x: float[N, 3]."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "k"], ["y"])],
        "scale",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[helper.make_tensor("k", TensorProto.FLOAT, [], [factor])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    folder.mkdir(parents=True)
    onnx.save(model, folder / "model.onnx")


@pytest.fixture
def repo(tmp_path) -> Path:
    for version, factor in ((1, 2.0), (2, 3.0), (3, 4.0)):
        write_model(tmp_path / "scale" / str(version), factor)
    # No inputs/outputs: completed from the ONNX graph, as Triton's auto-complete does.
    (tmp_path / "scale" / "config.pbtxt").write_text(
        'max_batch_size: 8\nversion_policy: { specific { versions: [1, 3] } }\n'
    )
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.pbtxt").write_text("max_batch_size: nonsense")
    return tmp_path


def x(rows: int) -> Tensor:
    return Tensor.from_numpy("x", np.arange(rows * 3, dtype=np.float32).reshape(rows, 3))


async def test_load_honours_version_policy_and_completes_the_config(repo):
    dp = RuntimeDataPlane(ModelRepository(repo))
    specs = await dp.load("scale")
    assert [s.version for s in specs] == ["1", "3"]
    assert specs[0].inputs[0].name == "x" and specs[0].inputs[0].dims == (3,)
    index = {(s.name, s.version): s.state.value for s in dp.index(ready_only=False)}
    assert index[("scale", "1")] == "READY" and index[("broken", "")] == "UNAVAILABLE"


async def test_execute_and_statistics(repo):
    dp = RuntimeDataPlane(ModelRepository(repo))
    await dp.load("scale")
    outputs, compute_ns = await dp.execute("scale", "3", [x(2)], [])
    np.testing.assert_array_equal(outputs[0].to_numpy(), np.arange(6, dtype=np.float32).reshape(2, 3) * 4)
    assert compute_ns > 0
    await dp.execute("scale", "", [x(3)], ["y"])  # latest version
    (stats,) = [s for s in dp.statistics("scale", "3")]
    assert (stats.inference_count, stats.execution_count, stats.success_count) == (5, 2, 2)


async def test_cheap_models_move_onto_the_event_loop(repo):
    dp = RuntimeDataPlane(ModelRepository(repo), inline_below_us=1_000_000)
    await dp.load("scale")
    loaded = dp._models["scale"]["1"]
    assert loaded.recent_compute_ns is None
    for _ in range(3):
        await dp.execute("scale", "1", [x(1)], [])
    assert loaded.recent_compute_ns is not None and loaded.recent_compute_ns < dp.inline_below_ns


async def test_errors_are_clear(repo):
    dp = RuntimeDataPlane(ModelRepository(repo))
    with pytest.raises(InvalidArgument, match="cannot load model 'broken'"):
        await dp.load("broken")
    with pytest.raises(NotFound, match="not in the model repository"):
        await dp.load("missing")
    await dp.load("scale")
    with pytest.raises(NotFound, match="Request for unknown model: 'scale' version 2 is not found"):
        await dp.execute("scale", "2", [x(1)], [])
    with pytest.raises(InvalidArgument, match="has no output 'z'"):  # checked once, when the request arrives
        await dp.queues.infer(InferRequest("scale", "1", [x(1)], ["z"]), RequestOptions())
    await dp.unload("scale")
    with pytest.raises(NotFound, match="'scale' has no available versions"):
        await dp.execute("scale", "1", [x(1)], [])
