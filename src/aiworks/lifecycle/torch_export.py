"""Export a PyTorch module to a Triton-layout model folder the runtime's ``pytorch`` backend serves.

Writes ``<out>/<name>/config.pbtxt`` (``platform: "pytorch_libtorch"``) and
``<out>/<name>/<version>/model.pt``, which is either

- ``torchscript``: ``torch.jit.trace`` of the module (what Triton's own
  pytorch backend loads), or
- ``torch-export``: a ``torch.export`` program (``torch.export.save``), with
  the batch dim (and any other dims named dynamic) symbolic.

The config names the inputs after ``forward``'s arguments, so they map by
name (docs/torch.md, "Tensor names"). The written file is loaded back and run
on the example inputs, and its largest difference from the module is
reported, as ``aiworks convert`` does for ONNX.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from aiworks.lifecycle.layout import check_config

FORMATS = ("torchscript", "torch-export")
PRECISIONS = ("fp32", "fp16", "bf16")
MODEL_FILE = "model.pt"

_TRITON_TYPES = {
    "torch.bool": mc.TYPE_BOOL, "torch.uint8": mc.TYPE_UINT8, "torch.int8": mc.TYPE_INT8,
    "torch.int16": mc.TYPE_INT16, "torch.int32": mc.TYPE_INT32, "torch.int64": mc.TYPE_INT64,
    "torch.float16": mc.TYPE_FP16, "torch.float32": mc.TYPE_FP32, "torch.float64": mc.TYPE_FP64,
}  # fmt: skip


@dataclass(frozen=True)
class TorchExport:
    """What :func:`export_model` wrote."""

    folder: Path
    model_path: Path
    format: str
    config: str
    max_abs_diff: float

    def summary(self) -> str:
        return (
            f"exported ({self.format}) -> {self.model_path}\nconfig -> {self.folder / 'config.pbtxt'}\n"
            f"max |reloaded - module| on the example inputs: {self.max_abs_diff:.3g}"
        )


def _forward_names(module, count: int) -> list[str]:
    import inspect

    params = [p for p in inspect.signature(module.forward).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
    names = [p.name for p in params][:count]
    return names if len(names) == count else [f"INPUT__{i}" for i in range(count)]


def _outputs(result) -> list:
    return list(result) if isinstance(result, (tuple, list)) else [result]


def config_text(
    name: str,
    inputs: list[tuple[str, object]],
    outputs: list[tuple[str, object]],
    *,
    max_batch_size: int,
    dynamic: dict[str, set[int]],
    queue_delay_us: int = 0,
    precision: str = "fp32",
    cuda_graph_dims: dict[str, list[int]] | None = None,
    preferred_batch_sizes: list[int] | None = None,
    instances: int = 0,
) -> str:
    """``config.pbtxt`` for named example tensors (``(name, tensor)``); ``dynamic`` names variable dims per input."""
    cfg = mc.ModelConfig(name=name, platform="pytorch_libtorch", max_batch_size=max_batch_size)
    if instances:  # no kind: Triton's auto, the GPU where there is one
        cfg.instance_group.add(count=instances)
    batching = max_batch_size > 0

    def add(entry, tensor_name: str, tensor, variable: set[int]) -> None:
        entry.name = tensor_name
        try:
            entry.data_type = _TRITON_TYPES[str(tensor.dtype)]
        except KeyError:
            raise ValueError(
                f"tensor '{tensor_name}' has type {tensor.dtype}, which a Triton config cannot declare"
            ) from None
        shape = list(tensor.shape)
        dims = [-1 if i in variable else d for i, d in enumerate(shape)]
        entry.dims.extend(dims[1:] if batching else dims)
        if not list(entry.dims):
            entry.dims.append(1)
            entry.reshape.SetInParent()

    for tensor_name, tensor in inputs:
        add(cfg.input.add(), tensor_name, tensor, dynamic.get(tensor_name, set()) | ({0} if batching else set()))
    for tensor_name, tensor in outputs:
        add(cfg.output.add(), tensor_name, tensor, {0} if batching else set())
    if batching:
        cfg.dynamic_batching.SetInParent()
        cfg.dynamic_batching.max_queue_delay_microseconds = queue_delay_us
        cfg.dynamic_batching.preferred_batch_size.extend(preferred_batch_sizes or [])
    if precision != "fp32":
        cfg.parameters["precision"].string_value = precision
    if cuda_graph_dims is not None and batching:
        cfg.optimization.cuda.graphs = True
        sizes = preferred_batch_sizes or _powers_of_two(max_batch_size)
        for size in sizes:
            spec = cfg.optimization.cuda.graph_spec.add()
            spec.batch_size = size
            for input_name, dims in cuda_graph_dims.items():
                spec.input[input_name].dim.extend(dims)
    return text_format.MessageToString(cfg)


def _powers_of_two(limit: int) -> list[int]:
    sizes, size = [], 1
    while size < limit:
        sizes.append(size)
        size *= 2
    return [*sizes, limit]


def export_model(
    module,
    example_inputs: tuple,
    out: Path,
    name: str,
    *,
    format: str = "torchscript",
    output_names: list[str] | None = None,
    max_batch_size: int = 64,
    dynamic: dict[str, set[int]] | None = None,
    queue_delay_us: int = 0,
    precision: str = "fp32",
    cuda_graph_dims: dict[str, list[int]] | None = None,
    preferred_batch_sizes: list[int] | None = None,
    instances: int = 0,
    version: int = 1,
    device: str = "cpu",
) -> TorchExport:
    """Trace or export ``module`` on ``example_inputs`` (batch first) and write the model folder.

    ``dynamic`` maps an input (by ``forward`` argument name) to its variable
    dims besides the batch dim, e.g. ``{"input_ids": {1}}`` for a sequence.
    ``cuda_graph_dims`` turns CUDA graphs on, for inputs of those non-batch
    dims (``{"input_ids": [128], ...}``), at the preferred batch sizes or
    powers of two. ``instances`` sets ``instance_group.count`` (concurrent batches; on a GPU, CUDA streams).
    ``device``: where to trace. A TorchScript trace keeps the device of tensors the module makes as it
    runs (transformers' attention-mask constant is one), so a trace made on the CPU fails on a GPU:
    trace on the device the model will serve on (``"cuda:0"``); the module is copied, not moved.
    """
    import copy

    import torch

    if format not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, not {format!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    module = module.eval()
    if device != "cpu":
        module = copy.deepcopy(module).to(device)
        example_inputs = tuple(x.to(device) for x in example_inputs)
    names = _forward_names(module, len(example_inputs))
    dynamic = {k: set(v) for k, v in (dynamic or {}).items()}
    unknown = set(dynamic) - set(names)
    if unknown:
        raise ValueError(f"dynamic dims name inputs forward() does not take: {sorted(unknown)}")
    with torch.inference_mode():
        expected = _outputs(module(*example_inputs))
    output_names = output_names or [f"OUTPUT__{i}" for i in range(len(expected))]
    if len(output_names) != len(expected):
        raise ValueError(f"the module returns {len(expected)} output(s), {len(output_names)} name(s) given")
    folder = Path(out) / name
    model_path = folder / str(version) / MODEL_FILE
    model_path.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # The tracer's chatter about Python values it records as constants, and TorchScript's
        # deprecation in PyTorch 2.13 (Triton's pytorch_libtorch still loads TorchScript).
        warnings.simplefilter("ignore")
        if format == "torchscript":
            torch.jit.trace(module, example_inputs, strict=False, check_trace=False).save(str(model_path))
            reloaded = torch.jit.load(str(model_path))
        else:
            # AUTO: export works out the ranges and the relations between dims (equal sequence lengths).
            shapes = []
            for arg in names:
                variable = dynamic.get(arg, set()) | ({0} if max_batch_size > 0 else set())
                shapes.append({d: torch.export.Dim.AUTO for d in sorted(variable)} or None)
            program = torch.export.export(module, tuple(example_inputs), dynamic_shapes=tuple(shapes))
            with open(model_path, "wb") as f:  # a file object: the .pt name is Triton's, not export's .pt2
                torch.export.save(program, f)
            with open(model_path, "rb") as f:
                reloaded = torch.export.load(f).module()
    with torch.inference_mode():
        got = _outputs(reloaded(*example_inputs))
    diff = max(float((g.float() - e.float()).abs().max()) if g.numel() else 0.0 for g, e in zip(got, expected))
    text = config_text(
        name,
        list(zip(names, example_inputs)),
        list(zip(output_names, expected)),
        max_batch_size=max_batch_size,
        dynamic=dynamic,
        queue_delay_us=queue_delay_us,
        precision=precision,
        cuda_graph_dims=cuda_graph_dims,
        preferred_batch_sizes=preferred_batch_sizes,
        instances=instances,
    )
    check_config(text, name)
    (folder / "config.pbtxt").write_text(text)
    return TorchExport(folder, model_path, format, text, diff)
