"""Edge mode: the front stage runs on the device, the back stage in the suite.

:class:`EdgeClient` runs a split model's front stage locally with
onnxruntime (:class:`~aiworks.lifecycle.split.EdgeStage`) and sends the
tensors at the cut, plus any request input the back stage still reads, to the
back-stage model through tritonclient, over HTTP (binary tensor data) or
gRPC. The back-stage model is a stage folder the suite serves
(``digits_stage2``), or a pipeline of the remaining stages when there are
more than two.

Each call reports what crossed the network: the raw bytes of the tensors
sent against the raw bytes of the request's inputs, and over HTTP the whole
request body (JSON header and binary data), so the figure a cut promises
(``aiworks split``'s report) can be checked against the wire.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from aiworks.lifecycle.split import EdgeStage


@dataclass(slots=True)
class EdgeResult:
    """The back stage's outputs and what the call cost."""

    outputs: dict[str, np.ndarray]
    input_bytes: int  # raw bytes of the request's inputs (what a client without the front stage sends)
    sent_bytes: int  # raw bytes of the tensors sent to the back stage
    body_bytes: int  # the HTTP request body (header included); over gRPC, the tensors' bytes
    front_ms: float  # the front stage on the device
    remote_ms: float  # the call to the suite


class EdgeClient:
    """Front stage on the device, back stage in the suite (see the module docstring)."""

    def __init__(
        self,
        front: Path,
        url: str,
        model: str,
        *,
        version: str = "",
        protocol: str = "http",
        threads: int = 1,
    ):
        if protocol not in ("http", "grpc"):
            raise ValueError(f"protocol is 'http' or 'grpc', not {protocol!r}")
        self.front = EdgeStage(Path(front), threads=threads)
        self.model, self.version, self.protocol = model, version, protocol
        if protocol == "http":
            import tritonclient.http as client_module

            self._client = client_module.InferenceServerClient(url)
            metadata = self._client.get_model_metadata(model, version)
            self._inputs = [(t["name"], t["datatype"]) for t in metadata["inputs"]]
            self._outputs = [t["name"] for t in metadata["outputs"]]
        else:
            import tritonclient.grpc as client_module

            self._client = client_module.InferenceServerClient(url)
            metadata = self._client.get_model_metadata(model, version)
            self._inputs = [(t.name, t.datatype) for t in metadata.inputs]
            self._outputs = [t.name for t in metadata.outputs]
        self._module = client_module

    def infer(self, feeds: dict[str, np.ndarray]) -> EdgeResult:
        """Run the front stage on ``feeds`` and the back stage in the suite; returns the final outputs."""
        started = time.perf_counter()
        produced = self.front.run(feeds)
        front_ms = (time.perf_counter() - started) * 1e3
        available = {**feeds, **produced}
        missing = [name for name, _ in self._inputs if name not in available]
        if missing:
            raise ValueError(f"model '{self.model}' reads {missing}, which neither the front stage nor the request has")
        m = self._module
        inputs, sent = [], {}
        for name, datatype in self._inputs:
            array = np.ascontiguousarray(available[name])
            sent[name] = array
            entry = m.InferInput(name, list(array.shape), datatype)
            if self.protocol == "http":
                entry.set_data_from_numpy(array, binary_data=True)
            else:
                entry.set_data_from_numpy(array)
            inputs.append(entry)
        if self.protocol == "http":
            outputs = [m.InferRequestedOutput(n, binary_data=True) for n in self._outputs]
            body, _ = m.InferenceServerClient.generate_request_body(inputs, outputs=outputs)
            body_bytes = len(body)
        else:
            outputs = [m.InferRequestedOutput(n) for n in self._outputs]
            body_bytes = EdgeStage.payload_bytes(sent)
        started = time.perf_counter()
        result = self._client.infer(self.model, inputs, model_version=self.version, outputs=outputs)
        remote_ms = (time.perf_counter() - started) * 1e3
        return EdgeResult(
            outputs={n: result.as_numpy(n) for n in self._outputs},
            input_bytes=EdgeStage.payload_bytes(feeds),
            sent_bytes=EdgeStage.payload_bytes(sent),
            body_bytes=body_bytes,
            front_ms=front_ms,
            remote_ms=remote_ms,
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> EdgeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
