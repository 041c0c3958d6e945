"""The pytorch backend in-process on the CPU: TorchScript and torch.export files, Triton's names, precision."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest
import torch
from torch_support import MLP_TS_CONFIG, reference, rows

from aiworks.core.datatypes import Tensor, decode
from aiworks.core.errors import InvalidArgument
from aiworks.core.model_config import parse_config, read_config
from aiworks.runtime.backends import BACKENDS
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.repository import ModelRepository, model_filename
from aiworks.runtime.torch_backend import TorchModel, archive_kind, device_for


def load(repository, name: str, text: str | None = None) -> TorchModel:
    repo = ModelRepository(repository)
    config = parse_config(text, fmt="pbtxt", model_name=name) if text else read_config(repository / name)
    return BACKENDS[config.backend](repo.model_file(config, 1), config, 1)


def test_torchscript_outputs_map_by_their_index_not_their_order(torch_repository):
    model = load(torch_repository, "mlp_ts")
    x = rows(5)
    logits, probabilities = model.run({"INPUT__0": x}, [])  # the config lists OUTPUT__1 (logits) first
    want_p, want_l = reference(x)
    np.testing.assert_allclose(probabilities, want_p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(logits, want_l, rtol=1e-5, atol=1e-6)
    (only,) = model.run({"INPUT__0": x}, ["OUTPUT__0"])
    np.testing.assert_allclose(only, want_p, rtol=1e-5, atol=1e-6)
    assert model.kind == "torchscript" and model.device.type == "cpu" and model.inline_ok


def test_inputs_named_after_forward_arguments_and_default_model_filename(torch_repository):
    config = read_config(torch_repository / "mixer")
    assert model_filename(config) == "mixer.torchscript"
    model = load(torch_repository, "mixer")
    assert model.plan.convention == "forward argument names"
    x = np.array([[1, -2, 3, -4]], np.float32)
    shift = np.full((1, 4), 10, np.float32)
    mixed, positives = model.run({"shift": shift, "x": x}, [])
    np.testing.assert_array_equal(mixed, x * 2 + 10)
    assert positives.dtype == np.int64 and positives.tolist() == [[2]]


def test_an_exported_program_describes_its_own_tensors(torch_repository):
    model = load(torch_repository, "mlp_ep")
    inputs, outputs = model.io_specs(batched=True)
    assert [(t.name, t.datatype, t.dims) for t in inputs] == [("features", "FP32", (8,))]
    assert [(t.name, t.datatype, t.dims) for t in outputs] == [("OUTPUT__0", "FP32", (3,)), ("OUTPUT__1", "FP32", (3,))]
    x = rows(7, seed=3)
    probabilities, logits = model.run({"features": x}, [])
    np.testing.assert_allclose(probabilities, reference(x)[0], rtol=1e-5, atol=1e-6)
    assert model.kind == "export"


async def test_the_data_plane_completes_the_config_serves_and_closes_on_unload(torch_repository):
    dataplane = RuntimeDataPlane(ModelRepository(torch_repository))
    try:
        (spec,) = await dataplane.load("mlp_ep")
        assert spec.platform == "pytorch_libtorch"
        assert [t.name for t in spec.inputs] == ["features"]
        x = rows(3)
        outputs, _ = await dataplane.execute("mlp_ep", "1", [Tensor("features", "FP32", x.shape, x.tobytes())], [])
        got = decode(outputs[0].raw, outputs[0].datatype, outputs[0].shape)
        np.testing.assert_allclose(got, reference(x)[0], rtol=1e-5, atol=1e-6)
        model = dataplane._version("mlp_ep", "1").model
        await dataplane.unload("mlp_ep")
        for _ in range(50):  # closed in the worker pool
            if model.module is None:
                break
            await __import__("asyncio").sleep(0.02)
        assert model.module is None
    finally:
        await dataplane.close()


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_half_precision_runs_under_autocast_and_stays_close(torch_repository, precision):
    text = MLP_TS_CONFIG.replace(
        "max_batch_size: 16",
        f'max_batch_size: 16\nparameters {{ key: "precision" value: {{ string_value: "{precision}" }} }}',
    )
    model = load(torch_repository, "mlp_ts", text)
    x = rows(6)
    logits, probabilities = model.run({"INPUT__0": x}, [])
    assert probabilities.dtype == np.float32  # the config's type, whatever the model computed in
    np.testing.assert_allclose(probabilities, reference(x)[0], atol=3e-2)


def test_unoptimized_execution_and_inference_mode_off(torch_repository):
    text = MLP_TS_CONFIG.replace(
        "max_batch_size: 16",
        'max_batch_size: 16\nparameters { key: "DISABLE_OPTIMIZED_EXECUTION" value: { string_value: "true" } }\n'
        'parameters { key: "INFERENCE_MODE" value: { string_value: "false" } }',
    )
    model = load(torch_repository, "mlp_ts", text)
    x = rows(2)
    np.testing.assert_allclose(model.run({"INPUT__0": x}, ["OUTPUT__1"])[0], reference(x)[1], rtol=1e-5, atol=1e-6)


def test_what_cannot_be_served_is_refused_with_the_reason(torch_repository, tmp_path):
    with pytest.raises(InvalidArgument, match="declare every input and output"):
        load(torch_repository, "mlp_ts", 'name: "mlp_ts" platform: "pytorch_libtorch" max_batch_size: 4')
    if not torch.cuda.is_available():
        with pytest.raises(InvalidArgument, match="KIND_GPU, but PyTorch sees no CUDA device"):
            load(torch_repository, "mlp_ts", MLP_TS_CONFIG.replace("KIND_CPU", "KIND_GPU"))
    model = load(torch_repository, "mlp_ts")
    with pytest.raises(InvalidArgument, match="rejected the batch"):
        model.run({"INPUT__0": np.zeros((2, 5), np.float32)}, [])
    with pytest.raises(InvalidArgument, match="needs input 'INPUT__0'"):
        model.run({"other": np.zeros((2, 8), np.float32)}, [])
    with pytest.raises(InvalidArgument, match="not a PyTorch model archive"):
        archive_kind(b"not a zip file")
    aoti = io.BytesIO()
    with zipfile.ZipFile(aoti, "w") as archive:
        archive.writestr("model/data/aotinductor/model/x.so", b"")
    assert archive_kind(aoti.getvalue()) == "aoti"


def test_device_follows_the_instance_group_kind():
    def config(groups: str):
        return parse_config(f'name: "m" platform: "pytorch_libtorch" {groups}', fmt="pbtxt", model_name="m")

    assert device_for(config(""), cuda_available=False) == "cpu"
    assert device_for(config(""), cuda_available=True) == "cuda:0"
    assert device_for(config("instance_group [ { kind: KIND_CPU } ]"), cuda_available=True) == "cpu"
    assert device_for(config("instance_group [ { kind: KIND_GPU gpus: [ 1 ] } ]"), cuda_available=True) == "cuda:1"
    with pytest.raises(InvalidArgument, match="KIND_GPU"):
        device_for(config("instance_group [ { kind: KIND_GPU } ]"), cuda_available=False)
    with pytest.raises(InvalidArgument, match="KIND_MODEL"):
        device_for(config("instance_group [ { kind: KIND_MODEL } ]"), cuda_available=True)


def test_minilm_exported_for_the_pytorch_backend_matches_pytorch(minilm_repository, minilm_feeds):
    feeds, want = minilm_feeds
    config = read_config(minilm_repository / "minilm_torch")
    assert config.platform == "pytorch_libtorch" and config.backend == "pytorch"
    assert [(t.name, t.datatype, t.dims) for t in config.inputs] == [
        ("input_ids", "INT64", (-1,)),
        ("attention_mask", "INT64", (-1,)),
    ]
    model = load(minilm_repository, "minilm_torch")
    (got,) = model.run(feeds, ["embedding"])
    cosine = (got * want).sum(axis=1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cosine.min() > 0.99999
    np.testing.assert_allclose(got, want, atol=1e-5)
    # A shorter batch (other sequence length) runs on the same traced model.
    short = {k: v[:2, :6] for k, v in feeds.items()}
    assert model.run(short, [])[0].shape == (2, 384)
