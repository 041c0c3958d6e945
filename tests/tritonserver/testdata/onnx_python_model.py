"""A Triton Python-backend model that runs ``model.onnx`` (beside it) with ONNX Runtime.

The CPU stand-in for a GPU model: Triton loads it as ``<model>/<version>/model.py``.

Tensors cross the stub through DLPack, not ``as_numpy()`` / ``Tensor(name, array)``:
the stub bundled in nvidia-pytriton 0.5.7 was built against NumPy 1's dtype
layout and reads NumPy 2 arrays wrongly (every element becomes the first one,
outputs arrive empty), while DLPack does not depend on that layout.
"""

import json
import os

import numpy as np
import onnxruntime as ort
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        path = os.path.join(args["model_repository"], args["model_version"], "model.onnx")
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self.inputs = [i["name"] for i in config["input"]]
        self.outputs = [o["name"] for o in config["output"]]

    def execute(self, requests):
        responses = []
        for request in requests:
            feeds = {n: np.from_dlpack(pb_utils.get_input_tensor_by_name(request, n)) for n in self.inputs}
            results = self.session.run(self.outputs, feeds)
            tensors = [
                pb_utils.Tensor.from_dlpack(n, np.ascontiguousarray(r).__dlpack__())
                for n, r in zip(self.outputs, results)
            ]
            responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
        return responses
