"""The ``repeat`` backend: a decoupled model that answers each request 0..N times, as Triton's repeat backend does.

It serves Triton's ``repeat_int32`` QA model (``backend: "repeat"``,
``model_transaction_policy { decoupled: true }``, ``max_batch_size: 0``):

- inputs ``IN`` (INT32, a vector), ``DELAY`` (UINT32, the same shape as
  ``IN``) and ``WAIT`` (UINT32 ``[1]``);
- outputs ``OUT`` (INT32 ``[1]``) and ``IDX`` (UINT32 ``[1]``).

For a request it sends one response per element of ``IN``: the i-th after
waiting ``DELAY[i]`` milliseconds, with ``OUT = IN[i]`` and ``IDX = i``; then
the request ends with an empty final response (Triton's backend sends the
final flag on its own), so an ``IN`` of shape ``[0]`` gets no response at
all. The request holds one of the model's instances (``instance_group``
count) for ``WAIT`` milliseconds, then frees it while its responses go on:
with ``WAIT`` shorter than the delays, one instance serves several requests
at once and their responses interleave.

It exists to test and demonstrate streaming (gRPC ``ModelStreamInfer``,
``triton_final_response``, cancellation) with a real decoupled model; the
version folder holds no file. A request whose caller goes away stops at its
next delay.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import InvalidArgument
from aiworks.core.inference import Answer, InferRequest
from aiworks.core.model_config import ModelConfig, TensorSpec
from aiworks.core.options import RequestOptions

_INPUTS = (("IN", "INT32"), ("DELAY", "UINT32"), ("WAIT", "UINT32"))
_OUTPUTS = (("OUT", "INT32"), ("IDX", "UINT32"))


def _check_config(config: ModelConfig) -> None:
    where = f"model '{config.name}' (repeat backend)"
    if config.max_batch_size != 0:
        raise InvalidArgument(f"{where}: the repeat backend does not batch; set max_batch_size: 0")
    if not config.decoupled:
        raise InvalidArgument(f"{where}: needs model_transaction_policy {{ decoupled: true }}")
    inputs = {t.name: t for t in config.inputs}
    outputs = {t.name: t for t in config.outputs}
    for specs, wanted, kind in ((inputs, _INPUTS, "input"), (outputs, _OUTPUTS, "output")):
        if sorted(specs) != sorted(name for name, _ in wanted):
            raise InvalidArgument(f"{where}: expects {kind}s {[n for n, _ in wanted]}, the config has {sorted(specs)}")
        for name, datatype in wanted:
            if specs[name].datatype != datatype:
                raise InvalidArgument(f"{where}: {kind} {name} must be {datatype}, not {specs[name].datatype}")
    if len(inputs["IN"].dims) != 1 or inputs["IN"].dims != inputs["DELAY"].dims:
        raise InvalidArgument(f"{where}: IN must be a vector and DELAY must have its shape")
    for spec in (inputs["WAIT"], outputs["OUT"], outputs["IDX"]):
        if spec.dims != (1,):
            raise InvalidArgument(f"{where}: {spec.name} must have dims [1]")


class RepeatModel:
    """One loaded version of a repeat model; see the module docstring."""

    decoupled = True

    def __init__(self, path: Path, config: ModelConfig, default_intra_op_threads: int):
        _check_config(config)
        self.name = config.name
        self._instances = asyncio.Semaphore(max(1, config.instance_count))

    def io_specs(self, batched: bool) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        return (
            (TensorSpec("IN", "INT32", (-1,)), TensorSpec("DELAY", "UINT32", (-1,)), TensorSpec("WAIT", "UINT32", (1,))),
            (TensorSpec("OUT", "INT32", (1,)), TensorSpec("IDX", "UINT32", (1,))),
        )

    def run(self, feeds, outputs):
        raise InvalidArgument(f"model '{self.name}' is decoupled: it answers on a stream only")

    async def stream(self, request: InferRequest, options: RequestOptions):
        """The responses to one request (the empty final one follows from the stream itself)."""
        tensors = {t.name: t for t in request.inputs}
        values, delays, wait = (tensors[name] for name, _ in _INPUTS)
        if values.shape != delays.shape:
            raise InvalidArgument(
                f"expected IN and DELAY shape to match, got {list(values.shape)} and {list(delays.shape)}"
            )
        values_np = np.frombuffer(values.raw, dtype="<i4")
        delays_np = np.frombuffer(delays.raw, dtype="<u4")
        wait_ms = int(np.frombuffer(wait.raw, dtype="<u4")[0])
        loop = asyncio.get_running_loop()
        await self._instances.acquire()
        held = [True]

        def free() -> None:
            if held[0]:
                held[0] = False
                self._instances.release()

        # The instance is held for WAIT ms whatever happens to the request, as Triton's backend holds it.
        loop.call_later(wait_ms / 1e3, free)
        for i, (value, delay_ms) in enumerate(zip(values_np.tolist(), delays_np.tolist())):
            await asyncio.sleep(delay_ms / 1e3)
            yield Answer(
                [
                    Tensor("OUT", "INT32", (1,), int(value).to_bytes(4, "little", signed=True)),
                    Tensor("IDX", "UINT32", (1,), i.to_bytes(4, "little")),
                ],
                final=False,
            )
