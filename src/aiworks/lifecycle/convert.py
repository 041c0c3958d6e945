"""Convert PyTorch, scikit-learn, TensorFlow/Keras and ONNX models to a Triton-layout ONNX model folder.

Each adapter returns an ``onnx.ModelProto``; :func:`convert` then checks it
(``onnx.checker`` and shape inference), compares its outputs with the source
framework's on a sample input where it can, checks its operators against the
target backend, and writes ``<out>/<name>/config.pbtxt`` and
``<out>/<name>/1/model.onnx``. Framework packages are imported inside the
adapters, so the core install needs none of them.
"""

from __future__ import annotations

import io
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from aiworks.lifecycle.layout import DEFAULT_MAX_BATCH_SIZE, make_config, write_model_folder
from aiworks.lifecycle.opcheck import OpReport, check_ops
from aiworks.lifecycle.sessions import open_session, sample_feeds

DEFAULT_OPSET = 17
FRAMEWORKS = ("pytorch", "sklearn", "tensorflow", "onnx")
_SUFFIXES = {
    ".onnx": "onnx",
    ".pt": "pytorch",
    ".pth": "pytorch",
    ".ts": "pytorch",
    ".pkl": "sklearn",
    ".pickle": "sklearn",
    ".joblib": "sklearn",
    ".keras": "tensorflow",
    ".h5": "tensorflow",
}


@dataclass(frozen=True, slots=True)
class InputSpec:
    """One model input for tracing: its name, an example shape (batch first) and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def sample(self, rng: np.random.Generator) -> np.ndarray:
        if np.issubdtype(np.dtype(self.dtype), np.integer):
            return rng.integers(0, 10, self.shape).astype(self.dtype)
        return rng.standard_normal(self.shape).astype(self.dtype)


@dataclass(slots=True)
class ConvertResult:
    """What :func:`convert` wrote, and what it found."""

    framework: str
    folder: Path
    model_path: Path
    config: str
    report: OpReport
    # Largest absolute difference between ONNX Runtime's and the framework's outputs on a sample.
    max_abs_diff: float | None = None
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        lines = [f"converted ({self.framework}) -> {self.model_path}", f"config -> {self.folder / 'config.pbtxt'}"]
        if self.max_abs_diff is not None:
            lines.append(f"max |onnxruntime - {self.framework}| on a sample input: {self.max_abs_diff:.3g}")
        lines += self.notes
        lines.append(self.report.format())
        return "\n".join(lines)


def detect_framework(source: Path) -> str:
    """The framework a file or folder holds, from its suffix (a SavedModel folder is TensorFlow)."""
    source = Path(source)
    if source.is_dir():
        if (source / "saved_model.pb").is_file():
            return "tensorflow"
        raise ValueError(f"{source} is a folder without saved_model.pb; pass --framework")
    try:
        return _SUFFIXES[source.suffix.lower()]
    except KeyError:
        raise ValueError(
            f"cannot tell the framework of '{source.name}' from its suffix; pass --framework {'|'.join(FRAMEWORKS)}"
        ) from None


def parse_input_spec(text: str, index: int = 0) -> InputSpec:
    """``[NAME:]SHAPE[:DTYPE]`` with SHAPE like ``1x3x224x224``, e.g. ``input:1x64:float32``."""
    parts = text.split(":")
    name = f"input_{index}" if index else "input"
    dtype = "float32"
    if len(parts) == 3:
        name, shape_text, dtype = parts
    elif len(parts) == 2:
        if parts[0].replace("x", "").replace(",", "").isdigit():
            shape_text, dtype = parts
        else:
            name, shape_text = parts
    else:
        (shape_text,) = parts
    try:
        shape = tuple(int(d) for d in shape_text.replace(",", "x").split("x"))
        np.dtype(dtype)
    except (ValueError, TypeError):
        raise ValueError(f"bad input spec '{text}': use [NAME:]SHAPE[:DTYPE], e.g. input:1x64:float32") from None
    return InputSpec(name, shape, dtype)


# ---- adapters --------------------------------------------------------------------------------


def _load_torch_module(source):
    import torch

    if isinstance(source, torch.nn.Module):
        return source
    try:
        return torch.jit.load(str(source), map_location="cpu")
    except RuntimeError:
        pass  # not TorchScript: a pickled nn.Module
    module = torch.load(str(source), map_location="cpu", weights_only=False)
    if not isinstance(module, torch.nn.Module):
        raise ValueError(
            f"{source} holds a {type(module).__name__}, not a module: a state dict has no architecture. "
            "Save the whole module (torch.save(model)) or TorchScript (torch.jit.save)."
        )
    return module


def from_pytorch(
    source, inputs: list[InputSpec], *, output_names: list[str] | None = None, opset: int = DEFAULT_OPSET
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[np.ndarray]]:
    """Export with ``torch.onnx.export`` (TorchScript exporter, ``dynamo=False``), batch dim dynamic.

    Returns the model, the sample feeds used and PyTorch's outputs on them.
    """
    import torch

    if not inputs:
        raise ValueError("PyTorch models need an example input shape: --input 1x64 (or NAME:SHAPE:DTYPE)")
    module = _load_torch_module(source).eval()
    rng = np.random.default_rng(0)
    feeds = {spec.name: spec.sample(rng) for spec in inputs}
    args = tuple(torch.from_numpy(feeds[spec.name]) for spec in inputs)
    with torch.no_grad():
        result = module(*args)
    flat = list(result) if isinstance(result, (tuple, list)) else [result]
    expected = [t.detach().numpy() for t in flat]
    if not output_names:
        output_names = ["output"] if len(flat) == 1 else [f"output_{i}" for i in range(len(flat))]
    dynamic = {n: {0: "batch"} for n in [s.name for s in inputs] + list(output_names)}
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer chatter
        torch.onnx.export(
            module,
            args,
            buffer,
            dynamo=False,
            opset_version=opset,
            input_names=[s.name for s in inputs],
            output_names=list(output_names),
            dynamic_axes=dynamic,
        )
    return onnx.load_from_string(buffer.getvalue()), feeds, expected


def from_sklearn(
    source, *, opset: int = DEFAULT_OPSET, inputs: list[InputSpec] | None = None
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[np.ndarray]]:
    """Convert a pickled/joblib estimator or pipeline with skl2onnx (probabilities as a tensor, no ZipMap)."""
    import joblib
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.base import is_classifier

    model = joblib.load(source) if isinstance(source, (str, Path)) else source
    n_features = getattr(model, "n_features_in_", None)
    if n_features is None:
        if not inputs:
            raise ValueError("the estimator does not say its feature count: pass --input 1xN")
        n_features = inputs[0].shape[-1]
    name = inputs[0].name if inputs else "input"
    final = model.steps[-1][1] if hasattr(model, "steps") else model
    options = {id(final): {"zipmap": False}} if is_classifier(model) else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onx = to_onnx(
            model,
            initial_types=[(name, FloatTensorType([None, n_features]))],
            options=options,
            target_opset={"": opset, "ai.onnx.ml": 3},
        )
    x = np.random.default_rng(0).standard_normal((16, n_features)).astype(np.float32)
    expected = [np.asarray(model.predict(x))]
    return onx, {name: x}, expected


def from_tensorflow(
    source: Path, *, opset: int = DEFAULT_OPSET, inputs: list[InputSpec] | None = None
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], list[np.ndarray]]:
    """Convert a Keras file (``.keras``/``.h5``) or a SavedModel folder with tf2onnx."""
    try:
        import tensorflow as tf
        import tf2onnx
    except ImportError as exc:
        raise RuntimeError(
            "TensorFlow conversion is an optional extra: pip install tensorflow-cpu==2.21.0 tf2onnx==1.17.0"
        ) from exc
    source = Path(source)
    if source.is_dir():
        # tf2onnx's SavedModel path is its command line; run it as a child process.
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "model.onnx"
            cmd = [sys.executable, "-m", "tf2onnx.convert", "--saved-model", str(source)]
            subprocess.run(cmd + ["--output", str(out), "--opset", str(opset)], check=True, capture_output=True)
            return onnx.load(str(out)), {}, []
    model = tf.keras.models.load_model(str(source))
    if inputs:
        specs = [tf.TensorSpec((None, *s.shape[1:]), s.dtype, name=s.name) for s in inputs]
    else:
        specs = [tf.TensorSpec((None, *model.inputs[0].shape[1:]), model.inputs[0].dtype, name="input")]

    # tf2onnx's from_keras does not follow Keras 3's tensor names; a tf.function around the model does.
    @tf.function(input_signature=specs)
    def serve(*args):
        return model(*args)

    onx, _ = tf2onnx.convert.from_function(serve, input_signature=specs, opset=opset)
    rng = np.random.default_rng(0)
    feeds = {s.name: rng.standard_normal((4, *s.shape[1:])).astype(s.dtype.as_numpy_dtype) for s in specs}
    result = model(*[feeds[s.name] for s in specs])
    flat = list(result) if isinstance(result, (tuple, list)) else [result]
    return onx, feeds, [np.asarray(t) for t in flat]


def from_onnx(source) -> onnx.ModelProto:
    return onnx.load(str(source)) if isinstance(source, (str, Path)) else source


def check_and_infer(model: onnx.ModelProto) -> onnx.ModelProto:
    """``onnx.checker`` plus shape inference; types and shapes land in ``value_info``."""
    onnx.checker.check_model(model)
    return onnx.shape_inference.infer_shapes(model, check_type=True)


# ---- the command -----------------------------------------------------------------------------


def _compare(model_path: Path, feeds: dict[str, np.ndarray], expected: list[np.ndarray]) -> float | None:
    session = open_session(model_path)
    if not feeds or not expected:
        session.run(None, sample_feeds(session))  # at least it loads and runs
        return None
    got = session.run(None, feeds)
    diffs = []
    for e, g in zip(expected, got):
        e, g = np.asarray(e), np.asarray(g)
        if e.shape != g.shape:
            g = g.reshape(e.shape) if g.size == e.size else g
        if e.dtype.kind in "fc" or g.dtype.kind in "fc":
            diffs.append(float(np.max(np.abs(e.astype(np.float64) - g.astype(np.float64)))) if e.size else 0.0)
        else:
            diffs.append(0.0 if np.array_equal(e.astype(g.dtype), g) else float("inf"))
    return max(diffs) if diffs else None


CONVERT_STEPS = 5  # load/export, check, operators, write, compare


def convert(
    source,
    out: Path,
    *,
    name: str | None = None,
    framework: str = "auto",
    inputs: list[InputSpec] | None = None,
    output_names: list[str] | None = None,
    opset: int = DEFAULT_OPSET,
    target: str = "onnxruntime-cpu",
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    progress: Callable[[str], None] | None = None,
) -> ConvertResult:
    """Convert ``source`` and write a Triton-layout model folder under ``out``.

    ``progress`` is told each of the :data:`CONVERT_STEPS` steps as it starts (the command line prints them).
    """
    step = progress or (lambda text: None)
    if framework == "auto":
        framework = detect_framework(Path(source))
    if framework not in FRAMEWORKS:
        raise ValueError(f"unknown framework '{framework}'; choose one of {', '.join(FRAMEWORKS)}")
    if name is None:
        if not isinstance(source, (str, Path)):
            raise ValueError("pass name= when converting an in-memory model")
        name = Path(source).stem
    feeds: dict[str, np.ndarray] = {}
    expected: list[np.ndarray] = []
    notes: list[str] = []
    step(f"loading the {framework} model" + ("" if framework == "onnx" else " and exporting it to ONNX"))
    if framework == "pytorch":
        model, feeds, expected = from_pytorch(source, inputs or [], output_names=output_names, opset=opset)
    elif framework == "sklearn":
        model, feeds, expected = from_sklearn(source, opset=opset, inputs=inputs)
        # The estimator's predict() is compared with the first ONNX output (label or value).
        notes.append(f"compared predict() with ONNX output '{model.graph.output[0].name}'")
    elif framework == "tensorflow":
        model, feeds, expected = from_tensorflow(Path(source), opset=opset, inputs=inputs)
    else:
        model = from_onnx(source)
    step("checking the graph and inferring shapes")
    model = check_and_infer(model)
    step(f"checking operators against {target}")
    report = check_ops(model, target)
    step(f"writing {Path(out) / name}")
    config = make_config(name, model, max_batch_size=max_batch_size, tensorrt=target == "tensorrt")
    folder = write_model_folder(Path(out), name, model, config)
    model_path = folder / "1" / "model.onnx"
    step("running the converted model in onnxruntime" + (" and comparing it with the source" if feeds else ""))
    try:
        diff = _compare(model_path, feeds, expected)
        if diff is None:
            notes.append("ran a random sample batch in onnxruntime: ok")
    except Exception as exc:  # the report above says why, when it is an operator problem
        diff = None
        notes.append(f"could not run the converted model in onnxruntime: {exc}")
    return ConvertResult(framework, folder, model_path, config, report, diff, notes)
