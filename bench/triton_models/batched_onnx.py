"""A Triton Python-backend model that runs ``model.onnx`` (beside it) with ONNX Runtime, one run per batch.

Triton hands ``execute`` every request of a dynamic batch; this model joins
their inputs along the batch dimension, runs the session once and splits the
outputs back, as Triton's own onnxruntime backend does. It is the yardstick
for ``bench/vs_triton.py``: the nvidia-pytriton build of tritonserver has no
onnxruntime backend, so this is the fairest Triton that runs here.

Numeric tensors cross the stub through DLPack: the stub in nvidia-pytriton
0.5.7 was built against NumPy 1's dtype layout and misreads NumPy 2 arrays
through ``as_numpy()``; BYTES tensors (object arrays) have no DLPack form and
go through ``as_numpy()``, which reads them correctly.
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        folder = os.path.join(args["model_repository"], args["model_version"])
        options = ort.SessionOptions()
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        options.intra_op_num_threads = int(params.get("intra_op_thread_count", "1"))
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if "onnxruntime_extensions" in params:
            from onnxruntime_extensions import get_library_path

            options.register_custom_ops_library(get_library_path())
        self.session = ort.InferenceSession(
            os.path.join(folder, "model.onnx"), options, providers=["CPUExecutionProvider"]
        )
        self.inputs = [(i["name"], i["data_type"] == "TYPE_STRING") for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]
        # Output dims as the config declares them (without the batch dim): the model's own may lack a trailing 1.
        self.output_dims = {o["name"]: [int(d) for d in o["dims"]] for o in config["output"]}

    def _read(self, request, name, is_bytes):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return tensor.as_numpy() if is_bytes else np.from_dlpack(tensor)

    def execute(self, requests):
        per_request = [{n: self._read(r, n, b) for n, b in self.inputs} for r in requests]
        rows = [len(feeds[self.inputs[0][0]]) for feeds in per_request]
        if len(requests) == 1:
            feeds = per_request[0]
        else:
            feeds = {n: np.concatenate([f[n] for f in per_request]) for n, _ in self.inputs}
        results = self.session.run(self.outputs, feeds)
        responses = []
        start = 0
        for count in rows:
            tensors = []
            for name, value in zip(self.outputs, results):
                piece = np.ascontiguousarray(value[start : start + count]).reshape([count, *self.output_dims[name]])
                tensors.append(pb_utils.Tensor.from_dlpack(name, piece.__dlpack__()))
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            start += count
        return responses
