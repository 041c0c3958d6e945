"""The pytorch backend on a CUDA GPU: placement, pinned copies, CUDA graphs with padding, bf16, residency.

Skipped without CUDA: scripts/device/torch_minilm_check.sh runs this file on
the lent GPU machine.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from torch_support import MLP_TS_CONFIG, reference, rows

from aiworks.core.datatypes import Tensor, decode
from aiworks.core.model_config import parse_config
from aiworks.runtime.dataplane import RuntimeDataPlane
from aiworks.runtime.repository import ModelRepository
from aiworks.runtime.torch_backend import TorchModel

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

GPU_CONFIG = MLP_TS_CONFIG.replace("KIND_CPU", "KIND_GPU").replace(
    "dynamic_batching { max_queue_delay_microseconds: 2000 }",
    "dynamic_batching { max_queue_delay_microseconds: 2000 }\noptimization { cuda { graphs: true } }",
)


def load(torch_repository, text: str) -> TorchModel:
    config = parse_config(text, fmt="pbtxt", model_name="mlp_ts")
    return TorchModel(ModelRepository(torch_repository).model_file(config, 1), config, 1)


def test_graphs_are_captured_and_padded_batches_answer_exactly(torch_repository):
    model = load(torch_repository, GPU_CONFIG)
    assert model.device.type == "cuda" and not model.inline_ok
    assert model.batch_sizes == (1, 2, 4, 8, 16)
    assert model.device_bytes > 0
    for n in (1, 3, 5, 16):  # 3 and 5 run padded to 4 and 8
        x = rows(n, seed=n)
        logits, probabilities = model.run({"INPUT__0": x}, [])
        assert probabilities.shape == (n, 3)
        np.testing.assert_allclose(probabilities, reference(x)[0], rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(logits, reference(x)[1], rtol=1e-4, atol=1e-4)
    model.close()


def test_instances_run_concurrently_and_agree(torch_repository):
    model = load(torch_repository, GPU_CONFIG)
    errors = []

    def worker(seed: int) -> None:
        try:
            for i in range(50):
                x = rows(1 + (seed + i) % 16, seed=seed * 1000 + i)
                np.testing.assert_allclose(model.run({"INPUT__0": x}, ["OUTPUT__0"])[0], reference(x)[0], atol=1e-4)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_bf16_and_the_eager_path_for_uncaptured_sizes(torch_repository):
    text = GPU_CONFIG.replace(
        "max_batch_size: 16", 'max_batch_size: 16\nparameters { key: "precision" value: { string_value: "bf16" } }'
    ).replace(
        "optimization { cuda { graphs: true } }",
        "optimization { cuda { graphs: true graph_spec [ { batch_size: 4 } ] } }",
    )
    model = load(torch_repository, text)
    assert model.batch_sizes == (4,)
    for n in (2, 9):  # 9 is over every captured size: it runs eagerly
        x = rows(n, seed=n)
        probabilities = model.run({"INPUT__0": x}, ["OUTPUT__0"])[0]
        assert probabilities.dtype == np.float32
        np.testing.assert_allclose(probabilities, reference(x)[0], atol=3e-2)


def test_the_data_plane_advertises_graph_sizes_and_counts_gpu_memory(torch_repository, tmp_path):
    # Not an async test: the GPU machine has no pytest-asyncio.
    asyncio.run(_data_plane_on_the_gpu(torch_repository, tmp_path))


async def _data_plane_on_the_gpu(torch_repository, tmp_path):
    import shutil

    shutil.copytree(torch_repository / "mlp_ts", tmp_path / "mlp_ts")
    (tmp_path / "mlp_ts" / "config.pbtxt").write_text(GPU_CONFIG)
    dataplane = RuntimeDataPlane(ModelRepository(tmp_path))
    try:
        (spec,) = await dataplane.load("mlp_ts")
        assert spec.batching.preferred_batch_sizes == (1, 2, 4, 8, 16)
        loaded = dataplane._version("mlp_ts", "1")
        assert loaded.size_bytes == loaded.model.device_bytes > 0
        x = rows(3)
        outputs, _ = await dataplane.execute(
            "mlp_ts", "1", [Tensor("INPUT__0", "FP32", x.shape, x.tobytes())], ["OUTPUT__0"]
        )
        np.testing.assert_allclose(decode(outputs[0].raw, "FP32", outputs[0].shape), reference(x)[0], atol=1e-4)
    finally:
        await dataplane.close()
