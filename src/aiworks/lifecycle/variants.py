"""The optimized variants of an ONNX model: ORT graph optimization, INT8 (dynamic, static) and FP16.

Each builder reads the original ``.onnx`` file and writes one variant file;
nothing is changed in place.
"""

from __future__ import annotations

import contextlib
import tempfile
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from aiworks.lifecycle.sessions import session_options, uses_extensions

VARIANTS = ("optimized", "int8-dynamic", "int8-static", "fp16")


def _op_counts(model: onnx.ModelProto) -> Counter:
    return Counter(n.op_type for n in model.graph.node)


def _op_diff(before: onnx.ModelProto, after: onnx.ModelProto) -> str:
    """A short account of what changed, e.g. ``-MatMul 3, -Add 3, +Gemm 3``."""
    a, b = _op_counts(before), _op_counts(after)
    gone = [f"-{op} {a[op] - b[op]}" for op in sorted(a) if a[op] > b[op]]
    new = [f"+{op} {b[op] - a[op]}" for op in sorted(b) if b[op] > a[op]]
    return ", ".join(gone + new) or "no operator changes"


def graph_optimized(src: Path, dst: Path) -> str:
    """Offline ONNX Runtime graph optimization (extended level: fusions, no hardware-specific layouts).

    Extended, not "all": the "all" level adds layout transforms tied to the
    CPU that ran it, which ONNX Runtime warns against saving.
    """
    model = onnx.load(str(src))
    options = session_options(extensions=uses_extensions(model))
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = str(dst)
    ort.InferenceSession(str(src), options, providers=["CPUExecutionProvider"])
    return _op_diff(model, onnx.load(str(dst)))


def _preprocessed(src: Path, tmp: Path) -> Path:
    """ONNX Runtime's recommended pre-quantization pass (shape inference, cleanup), when it applies."""
    from onnxruntime.quantization.shape_inference import quant_pre_process

    out = tmp / "preprocessed.onnx"
    src = Path(src).resolve()
    # Symbolic shape inference does not know every op (ai.onnx.ml, some traced graphs): retry without it.
    # When it fails it saves its partial model (and external data) in the working directory: use tmp.
    with contextlib.chdir(tmp):
        for skip_symbolic in (False, True):
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    quant_pre_process(str(src), str(out), skip_symbolic_shape=skip_symbolic)
                return out
            except Exception:
                continue
    return src


def int8_dynamic(src: Path, dst: Path, *, per_channel: bool = True, nodes_to_exclude: list[str] | None = None) -> str:
    """Dynamic INT8: weights quantized ahead of time, activations per batch at run time."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        source = _preprocessed(src, Path(tmp))
        quantize_dynamic(
            str(source),
            str(dst),
            per_channel=per_channel,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=nodes_to_exclude or [],
        )
    return f"weights int8 {'per channel' if per_channel else 'per tensor'}, activations quantized per batch"


class _Reader:
    """Feeds calibration batches to the static quantizer."""

    def __init__(self, batches: Iterable[dict[str, np.ndarray]]):
        self._it: Iterator = iter(batches)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):  # pragma: no cover - the quantizer calls it only for some methods
        pass


def calibration_batches(feeds: dict[str, np.ndarray], batch: int = 32) -> list[dict[str, np.ndarray]]:
    rows = len(next(iter(feeds.values())))
    return [{k: v[i : i + batch] for k, v in feeds.items()} for i in range(0, rows, batch)]


def int8_static(src: Path, dst: Path, calibration: dict[str, np.ndarray], *, progress=None) -> str:
    """Static INT8 in QDQ form: activation ranges measured on calibration data (MinMax)."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    batches = calibration_batches(calibration)

    def counted():
        for b in batches:
            yield b
            if progress is not None:
                progress.update(1)

    with tempfile.TemporaryDirectory() as tmp:
        source = _preprocessed(src, Path(tmp))
        quantize_static(
            str(source),
            str(dst),
            _Reader(counted()),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            # ONNX Runtime's bias-scale adjustment fails on per-channel Gemm weights; the
            # int32 bias range it guards is ample for these scales.
            extra_options={"QDQDisableWeightAdjustForInt32Bias": True},
        )
    rows = len(next(iter(calibration.values())))
    return f"QDQ, weights int8 per channel, activations uint8 calibrated on {rows} rows"


def _drop_noop_casts(model: onnx.ModelProto) -> onnx.ModelProto:
    """Remove Casts whose input already has the target type (skl2onnx adds one on float inputs).

    The FP16 converter leaves a ``Cast(to=float)`` in place, which would feed
    float into a half-precision MatMul.
    """
    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in list(inferred.graph.input) + list(inferred.graph.value_info)}
    outputs = {o.name for o in model.graph.output}
    rename: dict[str, str] = {}
    keep = []
    for node in model.graph.node:
        to = next((a.i for a in node.attribute if a.name == "to"), None)
        if node.op_type == "Cast" and types.get(node.input[0]) == to and node.output[0] not in outputs:
            rename[node.output[0]] = rename.get(node.input[0], node.input[0])
            continue
        keep.append(node)
    for node in keep:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    return model


def _raw_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """Store initializers as raw bytes: the FP16 converter handles ``float_data`` (skl2onnx's form) element by element."""
    for i, init in enumerate(model.graph.initializer):
        if init.data_type == onnx.TensorProto.FLOAT and not init.raw_data:
            model.graph.initializer[i].CopyFrom(
                onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(init), init.name)
            )
    return model


def _retarget_casts(model: onnx.ModelProto) -> onnx.ModelProto:
    """Casts to float whose output the converter typed float16 (an int mask made float) now cast to float16."""
    half = {
        v.name
        for v in model.graph.value_info
        if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    }
    for node in model.graph.node:
        if node.op_type == "Cast" and node.output[0] in half:
            for attr in node.attribute:
                if attr.name == "to" and attr.i == onnx.TensorProto.FLOAT:
                    attr.i = onnx.TensorProto.FLOAT16
    return model


def fp16(src: Path, dst: Path) -> str:
    """FP16 weights and compute with float32 inputs and outputs (``keep_io_types``)."""
    from onnxconverter_common import float16

    model = _raw_initializers(_drop_noop_casts(onnx.load(str(src))))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # values clamped to the float16 range, one warning each
        half = float16.convert_float_to_float16(model, keep_io_types=True)
    onnx.save(_retarget_casts(half), str(dst))
    return "float16 weights and compute, float32 inputs and outputs"
