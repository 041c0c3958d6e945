"""``aiworks optimize --tensorrt``: an ONNX model folder to a TensorRT engine model folder Triton serves.

Writes ``<out>/<name>/config.pbtxt`` (``platform: "tensorrt_plan"``, which
the runtime serves through its triton backend) and ``<out>/<name>/1/model.plan``,
built by :func:`aiworks.lifecycle.tensorrt_build.build_engine` on this machine's GPU.
The batch dim gets one optimization profile from 1 to ``max_batch_size``;
other dynamic dims need ``--profile NAME:MIN/OPT/MAX`` shapes (batch first).
Without the ``tensorrt`` package or a GPU it raises
:class:`~aiworks.lifecycle.tensorrt_build.TensorRTUnavailable`, whose message says
which is missing.
"""

from __future__ import annotations

from pathlib import Path

import onnx
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from aiworks.lifecycle.layout import add_tensor, check_config, graph_io


def parse_profile(text: str) -> tuple[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """``NAME:MIN/OPT/MAX`` with shapes like ``1x128``: an input's (min, opt, max) shapes."""
    name, sep, shapes = text.partition(":")
    parts = shapes.split("/")
    if not sep or not name or len(parts) != 3:
        raise ValueError(f"--profile {text!r}: write NAME:MIN/OPT/MAX, e.g. input_ids:1x16/32x128/64x128")
    try:
        low, opt, high = (tuple(int(d) for d in p.lower().split("x")) for p in parts)
    except ValueError:
        raise ValueError(f"--profile {text!r}: shapes are integers joined by x, e.g. 32x128") from None
    return name, (low, opt, high)


def default_profile(model: onnx.ModelProto, max_batch_size: int, given: dict) -> dict:
    """Every input not ``given``: batch 1 / max/2 / max, its other dims as the graph fixes them."""
    profile = dict(given)
    inputs, _ = graph_io(model)
    for t in inputs:
        if t.name in profile:
            continue
        rest = t.shape[1:]
        if any(d < 0 for d in rest):
            raise ValueError(f"input '{t.name}' has dynamic dims {list(t.shape)}: give --profile {t.name}:MIN/OPT/MAX")
        opt = max(1, max_batch_size // 2)
        profile[t.name] = ((1, *rest), (opt, *rest), (max_batch_size, *rest))
    return profile


def plan_config(name: str, model: onnx.ModelProto, max_batch_size: int, precision: str) -> str:
    """Triton's config for the engine: the ONNX graph's tensors, dynamic batching, one GPU instance."""
    inputs, outputs = graph_io(model)
    cfg = mc.ModelConfig(name=name, platform="tensorrt_plan", max_batch_size=max_batch_size)
    for t in inputs:
        add_tensor(cfg.input.add(), t, True)
    for t in outputs:
        add_tensor(cfg.output.add(), t, True)
    cfg.dynamic_batching.SetInParent()
    cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_GPU)
    cfg.parameters["tensorrt_precision"].string_value = precision  # for people reading the config
    return text_format.MessageToString(cfg)


def build_plan_folder(
    onnx_path: Path, out: Path, name: str, *, precision: str, max_batch_size: int, profiles: dict
) -> Path:
    """Build the engine and write the model folder; returns the folder."""
    from aiworks.lifecycle.tensorrt_build import build_engine

    model = onnx.load(str(onnx_path), load_external_data=False)
    profile = default_profile(model, max_batch_size, profiles)
    text = plan_config(name, model, max_batch_size, precision)
    check_config(text, name)
    folder = Path(out) / name
    build_engine(onnx_path, folder / "1" / "model.plan", precision, [profile])
    (folder / "config.pbtxt").write_text(text)
    return folder
