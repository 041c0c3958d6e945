"""Triton-layout model folders and the ``config.pbtxt`` generated for an ONNX graph.

The config is built as Triton's own ``ModelConfig`` message (from tritonclient)
and printed in text format, then read back with the suite's parser, so a
config this module writes is one the runtime accepts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from aiworks.core.model_config import ModelConfig, parse_config
from aiworks.lifecycle.sessions import EXTENSIONS_PARAMETER, uses_extensions

DEFAULT_MAX_BATCH_SIZE = 64

# ONNX element types -> Triton data types.
_TRITON_TYPES = {
    onnx.TensorProto.BOOL: mc.TYPE_BOOL,
    onnx.TensorProto.UINT8: mc.TYPE_UINT8,
    onnx.TensorProto.UINT16: mc.TYPE_UINT16,
    onnx.TensorProto.UINT32: mc.TYPE_UINT32,
    onnx.TensorProto.UINT64: mc.TYPE_UINT64,
    onnx.TensorProto.INT8: mc.TYPE_INT8,
    onnx.TensorProto.INT16: mc.TYPE_INT16,
    onnx.TensorProto.INT32: mc.TYPE_INT32,
    onnx.TensorProto.INT64: mc.TYPE_INT64,
    onnx.TensorProto.FLOAT16: mc.TYPE_FP16,
    onnx.TensorProto.FLOAT: mc.TYPE_FP32,
    onnx.TensorProto.DOUBLE: mc.TYPE_FP64,
    onnx.TensorProto.STRING: mc.TYPE_STRING,
}


@dataclass(frozen=True, slots=True)
class GraphTensor:
    """A graph input or output: ``shape`` uses -1 for symbolic or unknown dims."""

    name: str
    elem_type: int
    shape: tuple[int, ...]
    batch_dim: bool  # the first dim is symbolic, so it can carry the batch


def graph_tensors(values) -> list[GraphTensor]:
    """Names, types and shapes of ``graph.input`` / ``graph.output`` entries."""
    out = []
    for v in values:
        tt = v.type.tensor_type
        dims = list(tt.shape.dim) if tt.HasField("shape") else []
        shape = tuple(d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1 for d in dims)
        out.append(GraphTensor(v.name, tt.elem_type, shape, bool(shape) and shape[0] == -1))
    return out


def graph_io(model: onnx.ModelProto) -> tuple[list[GraphTensor], list[GraphTensor]]:
    """The model's real inputs (initializers excluded) and outputs."""
    inits = {i.name for i in model.graph.initializer}
    inputs = [v for v in model.graph.input if v.name not in inits]
    return graph_tensors(inputs), graph_tensors(model.graph.output)


def add_tensor(entry, t: GraphTensor, batching: bool) -> None:
    try:
        entry.data_type = _TRITON_TYPES[t.elem_type]
    except KeyError:
        name = onnx.TensorProto.DataType.Name(t.elem_type)
        raise ValueError(f"tensor '{t.name}' has ONNX type {name}, which Triton configs cannot declare") from None
    entry.name = t.name
    dims = list(t.shape[1:] if batching else t.shape)
    if not dims:
        # Triton needs at least one dim; a per-row scalar is declared [1] and reshaped to [].
        entry.dims.append(1)
        entry.reshape.SetInParent()
    else:
        entry.dims.extend(dims)


def make_config(
    name: str,
    model: onnx.ModelProto,
    *,
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    dynamic_batching: bool = True,
    queue_delay_us: int = 0,
    parameters: dict[str, str] | None = None,
    version_policy_all: bool = False,
    tensorrt: bool = False,
) -> str:
    """A Triton ``config.pbtxt`` for ``model``.

    The model batches (``max_batch_size`` > 0, dims without the batch dim) when
    every input and output has a symbolic first dim; otherwise dims are the
    full shapes and ``max_batch_size`` is 0. ``tensorrt`` asks Triton's
    onnxruntime backend to run the graph through its TensorRT accelerator on GPUs.
    A graph with onnxruntime-extensions ops gets the parameter that asks the
    runtime to register their library.
    """
    inputs, outputs = graph_io(model)
    batching = max_batch_size > 0 and all(t.batch_dim for t in inputs + outputs)
    cfg = mc.ModelConfig(name=name, platform="onnxruntime_onnx", max_batch_size=max_batch_size if batching else 0)
    for t in inputs:
        add_tensor(cfg.input.add(), t, batching)
    for t in outputs:
        add_tensor(cfg.output.add(), t, batching)
    if batching and dynamic_batching:
        cfg.dynamic_batching.SetInParent()
        cfg.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
    group = cfg.instance_group.add()
    group.count = 1
    group.kind = mc.ModelInstanceGroup.KIND_GPU if tensorrt else mc.ModelInstanceGroup.KIND_CPU
    if tensorrt:
        accel = cfg.optimization.execution_accelerators.gpu_execution_accelerator.add()
        accel.name = "tensorrt"
    if version_policy_all:
        cfg.version_policy.all.SetInParent()
    params = dict(parameters or {})
    if uses_extensions(model):
        params.setdefault(EXTENSIONS_PARAMETER, "true")
    for key, value in params.items():
        cfg.parameters[key].string_value = value
    return text_format.MessageToString(cfg)


def write_model_folder(
    out: Path, name: str, model: onnx.ModelProto | bytes, config_text: str, *, version: int = 1
) -> Path:
    """Write ``<out>/<name>/config.pbtxt`` and ``<out>/<name>/<version>/model.onnx``; returns the folder.

    The config is parsed with the suite's own parser first, so a bad config
    never reaches disk.
    """
    check_config(config_text, name)
    folder = Path(out) / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    data = model if isinstance(model, bytes) else model.SerializeToString()
    (folder / str(version) / "model.onnx").write_bytes(data)
    (folder / "config.pbtxt").write_text(config_text)
    return folder


def check_config(config_text: str, name: str) -> ModelConfig:
    """Parse a config as the runtime will; raises ``InvalidArgument`` if it would reject it."""
    return parse_config(config_text, fmt="pbtxt", model_name=name)


def find_onnx(path: Path) -> Path:
    """An ONNX file from a path: the file itself, or a model folder's latest version."""
    path = Path(path)
    if path.is_file():
        return path
    direct = path / "model.onnx"
    if direct.is_file():
        return direct
    versions = sorted((p for p in path.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    for v in reversed(versions):
        if (v / "model.onnx").is_file():
            return v / "model.onnx"
    raise FileNotFoundError(f"no model.onnx in {path} or its version folders")
