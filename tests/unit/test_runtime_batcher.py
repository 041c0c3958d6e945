"""A runtime replica's dynamic batcher: requests join batches and get their own rows back, exactly."""

import asyncio

import numpy as np

from aiworks.core.datatypes import Tensor
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import BatchingConfig, ModelSpec, TensorSpec
from aiworks.core.options import Priority
from aiworks.runtime.batcher import ModelQueue


class Doubling:
    """Doubles its input; records every batch's rows."""

    def __init__(self, delay_s: float = 0.0):
        self.batches: list[int] = []
        self.delay_s = delay_s

    async def __call__(self, inputs, outputs):
        x = inputs[0].to_numpy()
        self.batches.append(x.shape[0])
        await asyncio.sleep(self.delay_s)
        return [Tensor.from_numpy("y", x * 2)], 1000


def spec(batching=True, max_batch=8, delay_us=20_000, instances=1) -> ModelSpec:
    return ModelSpec(
        "m",
        "1",
        max_batch_size=max_batch,
        inputs=(TensorSpec("x", "FP32", (2,)),),
        outputs=(TensorSpec("y", "FP32", (2,)),),
        batching=BatchingConfig(batching, delay_us, ()),
        instance_count=instances,
    )


def request(rows: int, start: float = 0.0) -> InferRequest:
    x = (np.arange(rows * 2, dtype=np.float32) + start).reshape(rows, 2)
    return InferRequest("m", "1", [Tensor.from_numpy("x", x)])


async def test_concurrent_requests_are_batched_and_split_exactly():
    model = Doubling(delay_s=0.01)
    queue = ModelQueue(spec(), model, batching=True)
    rows = [1, 3, 2, 1, 1, 2, 1, 1, 3, 2]
    answers = await asyncio.gather(
        *(queue.submit(request(n, start=100 * i), n, Priority.STANDARD) for i, n in enumerate(rows))
    )
    for i, (n, answer) in enumerate(zip(rows, answers)):
        expected = (np.arange(n * 2, dtype=np.float32) + 100 * i).reshape(n, 2) * 2
        np.testing.assert_array_equal(answer.outputs[0].to_numpy(), expected)
    assert sum(model.batches) == sum(rows)
    assert len(model.batches) < len(rows)  # some requests shared a batch
    assert max(model.batches) <= 8
    await queue.close()


async def test_no_batching_runs_each_request_alone():
    model = Doubling(delay_s=0.005)
    queue = ModelQueue(spec(), model, batching=False)
    await asyncio.gather(*(queue.submit(request(2), 2) for _ in range(6)))
    assert model.batches == [2] * 6
    await queue.close()


async def test_every_instance_runs_a_batch_at_once():
    model = Doubling(delay_s=0.05)
    queue = ModelQueue(spec(batching=False, instances=3), model, batching=True)
    started = asyncio.get_running_loop().time()
    await asyncio.gather(*(queue.submit(request(1), 1) for _ in range(3)))
    assert asyncio.get_running_loop().time() - started < 0.09  # three at once, not one after another
    await queue.close()
