"""The backends a runtime replica can execute models with, by config ``backend`` name.

A backend is a class built as ``Backend(model_path, config, default_intra_op_threads)``
(blocking; the data plane calls it in a worker thread) with:

- ``run(feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]``,
  thread-safe, called in a worker thread;
- ``io_specs(batched: bool) -> (inputs, outputs)``, the model's own tensor specs,
  used when the config omits them.

and optionally:

- ``inline_ok``: False when a batch must never run on the event loop (it does I/O or waits for a GPU);
- ``healthy() -> bool`` and ``recovering() -> bool``: cheap, no I/O; a version
  whose backend is unhealthy is not ready, and one that is recovering (a
  tritonserver restarting) is advertised as LOADING meanwhile;
- ``batch_sizes``: the batch sizes it runs best (CUDA graphs), advertised as the
  dynamic batcher's preferred sizes when the config gives none;
- ``device_bytes``: accelerator memory the version holds, which residency counts instead of its size on disk;
- ``close()``: free it now; called once no batch of the version runs any more;
- ``decoupled = True`` with ``stream(request, options)``: an async generator of
  :class:`aiworks.core.inference.Answer` for one request (0..N answers with
  ``final`` unset, and a last one with it set), for configs with Triton's
  ``model_transaction_policy { decoupled: true }``. It runs on the event loop,
  so it puts blocking compute in threads itself and does its own scheduling
  (a generation joining a running batch). Its caller going away arrives as
  ``asyncio.CancelledError`` (or ``GeneratorExit``) inside it: free what the
  request holds in ``finally``.

A config without ``backend`` gets one from its platform (``pytorch_libtorch``:
``pytorch``, ``tensorrt_plan``: ``triton``), as Triton picks its backend.
"""

from __future__ import annotations

from aiworks.runtime.llm_backend import LlmModel
from aiworks.runtime.onnxruntime_backend import OnnxRuntimeModel
from aiworks.runtime.repeat_backend import RepeatModel
from aiworks.runtime.torch_backend import TorchModel
from aiworks.runtime.triton_backend import TritonModel

BACKENDS = {
    "onnxruntime": OnnxRuntimeModel,  # ONNX Runtime on the CPU
    "pytorch": TorchModel,  # TorchScript / torch.export on the CPU or a CUDA GPU; docs/torch.md
    "triton": TritonModel,  # a Triton Inference Server (GPU) over gRPC; docs/triton.md
    "repeat": RepeatModel,  # Triton's repeat backend: a decoupled model for streaming (repeat_int32)
    "llm": LlmModel,  # text generation, continuous batching over a KV-cache decoder; docs/generation.md
}
