"""The backends a runtime replica can execute models with, by config ``backend`` name.

A backend is a class built as ``Backend(model_path, config, default_intra_op_threads)``
(blocking; the data plane calls it in a worker thread) with:

- ``run(feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]``,
  thread-safe, called in a worker thread;
- ``io_specs(batched: bool) -> (inputs, outputs)``, the model's own tensor specs,
  used when the config omits them.
"""

from __future__ import annotations

from aiworks.runtime.onnxruntime_backend import OnnxRuntimeModel
from aiworks.runtime.triton_backend import TritonModel

BACKENDS = {
    "onnxruntime": OnnxRuntimeModel,  # ONNX Runtime on the CPU
    "triton": TritonModel,  # a Triton Inference Server (GPU) over gRPC; docs/triton.md
}
