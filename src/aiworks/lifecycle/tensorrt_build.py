"""Build TensorRT engines from ONNX models, for Triton's ``tensorrt_plan`` platform.

This is what ``optimize --tensorrt`` runs. It needs the ``tensorrt`` Python
package and an NVIDIA GPU: TensorRT times kernels on the GPU it builds on, so
an engine is built on the same GPU model, with the same TensorRT version, as
the tritonserver that will serve it (an engine from another version does not
load). Neither comes with the suite's requirements; install the ``tensorrt``
wheel that matches your Triton release on the GPU machine. See docs/triton.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

PRECISIONS = ("fp32", "tf32", "fp16", "bf16", "int8")
"""``int8`` is for explicitly quantized models (QuantizeLinear/DequantizeLinear in the graph): no calibration here."""

Shape = Sequence[int]
Profile = Mapping[str, tuple[Shape, Shape, Shape]]
"""One optimization profile: input name -> (min, opt, max) shape, batch dim included."""


class TensorRTUnavailable(RuntimeError):
    """TensorRT, or a GPU for it to build on, is not available on this machine."""


def _import_tensorrt():
    try:
        import tensorrt
    except ImportError as exc:
        raise TensorRTUnavailable(
            "building a TensorRT engine needs the 'tensorrt' Python package and an NVIDIA GPU; "
            f"import tensorrt failed here ({exc}). Build on the GPU machine, with the tensorrt "
            "wheel that matches the tritonserver's TensorRT version."
        ) from None
    return tensorrt


def _check(precision: str, profiles: Sequence[Profile]) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    for i, profile in enumerate(profiles):
        for name, shapes in profile.items():
            if len(shapes) != 3:
                raise ValueError(f"profile {i}, input '{name}': give (min, opt, max) shapes")
            low, opt, high = (tuple(int(d) for d in s) for s in shapes)
            if not len(low) == len(opt) == len(high):
                raise ValueError(f"profile {i}, input '{name}': min, opt and max shapes differ in rank")
            if any(not 0 < a <= b <= c for a, b, c in zip(low, opt, high)):
                raise ValueError(f"profile {i}, input '{name}': need 0 < min <= opt <= max in every dim")


def build_engine(
    onnx_path: Path | str,
    out_path: Path | str,
    precision: str = "fp16",
    profiles: Sequence[Profile] = (),
    *,
    workspace_bytes: int | None = None,
) -> Path:
    """Parse ``onnx_path``, build a serialized engine for this GPU, write it to ``out_path``.

    ``profiles`` is required when an input has a dynamic dim (a batch
    dimension of -1, say): one dict per optimization profile, mapping each
    dynamic input to its (min, opt, max) shapes. Raises
    :class:`TensorRTUnavailable` without TensorRT or a GPU, ``ValueError`` for
    bad arguments or a graph TensorRT cannot parse or build.
    """
    _check(precision, profiles)
    onnx_path, out_path = Path(onnx_path), Path(out_path)
    if not onnx_path.is_file():
        raise ValueError(f"{onnx_path} does not exist")
    trt = _import_tensorrt()

    logger = trt.Logger(trt.Logger.WARNING)
    try:
        builder = trt.Builder(logger)
    except Exception as exc:  # no CUDA device or driver
        raise TensorRTUnavailable(f"TensorRT cannot use a GPU here: {exc}") from None
    if builder is None:
        raise TensorRTUnavailable("TensorRT cannot use a GPU here (no builder; is there a CUDA device and driver?)")
    flags = 0
    if int(trt.__version__.split(".")[0]) < 10:  # explicit batch is the only mode from TensorRT 10 on
        flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ValueError(f"TensorRT cannot parse {onnx_path}: {errors}")

    config = builder.create_builder_config()
    if workspace_bytes:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if precision == "fp32":
        config.clear_flag(trt.BuilderFlag.TF32)  # TensorRT allows TF32 by default; fp32 means full fp32
    elif precision != "tf32":
        config.set_flag(getattr(trt.BuilderFlag, precision.upper()))

    inputs = [network.get_input(i) for i in range(network.num_inputs)]
    dynamic = [t.name for t in inputs if any(d < 0 for d in t.shape)]
    if dynamic and not profiles:
        raise ValueError(f"inputs {dynamic} have dynamic dims: give optimization profiles with their shapes")
    names = {t.name for t in inputs}
    for profile in profiles:
        unknown = set(profile) - names
        if unknown:
            raise ValueError(f"profile names inputs the model does not have: {sorted(unknown)}")
        missing = set(dynamic) - set(profile)
        if missing:
            raise ValueError(f"every profile must give shapes for the dynamic inputs {sorted(missing)}")
        opt_profile = builder.create_optimization_profile()
        for name, (low, opt, high) in profile.items():
            opt_profile.set_shape(name, tuple(low), tuple(opt), tuple(high))
        config.add_optimization_profile(opt_profile)

    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise ValueError(f"TensorRT could not build an engine from {onnx_path} (see its log above)")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_bytes(bytes(engine))
    log.info("built %s (%s, TensorRT %s) from %s", out_path, precision, trt.__version__, onnx_path)
    return out_path
