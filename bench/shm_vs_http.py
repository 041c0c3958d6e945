"""A 4 MiB FP32 tensor through system shared memory against binary HTTP, at concurrency 1 (issue 14, item 6).

One suite (scheduler, one runtime replica, gateway; no result cache) serves
``identity``: an ONNX Identity on a [1048576] FP32 tensor, so the model's own
compute is small and the figure is the cost of moving 4 MiB in and 4 MiB out.
One tritonclient HTTP client sends the same input two ways:

- ``http_binary``: the input as binary data in the body, the output as binary
  data in the answer;
- ``shm``: the input read from, and the output written into, system shared
  memory regions registered once (the request and answer carry JSON only).

The two cases alternate in rounds of ``--requests`` so that noise from the
shared machine falls on both; every answer is checked outside the timing.
The figure is the ratio of p50 latencies, shm / http_binary (target <= 0.5).
A third case, ``tiny_request`` (``identity_small``, one element), is the
fixed cost of a request through the suite; ``shm_path_breakdown_ms`` times,
in this process, each step the 4 MiB takes between gateway and runtime on
the shared memory path (messages, frames, serialization, parsing): where the
``shm`` case's time goes (docs/benchmarks.md).

Usage: python bench/shm_vs_http.py [--rounds 6] [--requests 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import onnx
import tritonclient.http as httpclient
import tritonclient.utils.shared_memory as shm
from onnx import TensorProto, helper

from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

ROOT = Path(__file__).resolve().parent.parent
N = 1 << 20  # 4 MiB of FP32


def build_repository(root: Path) -> None:
    for name, size in (("identity", N), ("identity_small", 1)):
        folder = root / name
        (folder / "1").mkdir(parents=True)
        graph = helper.make_graph(
            [helper.make_node("Identity", ["x"], ["y"])],
            name,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [size])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [size])],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        onnx.save(model, folder / "1" / "model.onnx")
        (folder / "config.pbtxt").write_text(
            f'input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {size} ] }} ]\n'
            f'output [ {{ name: "y" data_type: TYPE_FP32 dims: [ {size} ] }} ]\n'
            'parameters { key: "preload" value: { string_value: "true" } }\n'
        )


def _ms(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "p50_ms": round(statistics.median(ordered) * 1e3, 3),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))] * 1e3, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1e3, 3),
    }


class Cases:
    """The two ways of sending the tensor, over one HTTP client."""

    def __init__(self, client: httpclient.InferenceServerClient):
        self.client = client
        self.data = np.random.default_rng(0).standard_normal(N).astype(np.float32)
        suffix = uuid.uuid4().hex[:10]
        self.in_key, self.out_key = f"/aiw_bench_in_{suffix}", f"/aiw_bench_out_{suffix}"
        self.in_handle = shm.create_shared_memory_region("bench_in", self.in_key, 4 * N)
        self.out_handle = shm.create_shared_memory_region("bench_out", self.out_key, 4 * N)
        shm.set_shared_memory_region(self.in_handle, [self.data])
        client.register_system_shared_memory("bench_in", self.in_key, 4 * N)
        client.register_system_shared_memory("bench_out", self.out_key, 4 * N)

    def close(self) -> None:
        self.client.unregister_system_shared_memory()
        shm.destroy_shared_memory_region(self.in_handle)
        shm.destroy_shared_memory_region(self.out_handle)

    def http_binary(self):
        tensor = httpclient.InferInput("x", [N], "FP32")
        tensor.set_data_from_numpy(self.data, binary_data=True)
        return self.client.infer("identity", [tensor], outputs=[httpclient.InferRequestedOutput("y", binary_data=True)])

    def check_http_binary(self, result) -> None:
        assert np.array_equal(result.as_numpy("y"), self.data), "binary HTTP answered the wrong tensor"

    def shm(self):
        tensor = httpclient.InferInput("x", [N], "FP32")
        tensor.set_shared_memory("bench_in", 4 * N)
        output = httpclient.InferRequestedOutput("y")
        output.set_shared_memory("bench_out", 4 * N)
        return self.client.infer("identity", [tensor], outputs=[output])

    def check_shm(self, result) -> None:
        assert "data" not in result.get_output("y")
        out = shm.get_contents_as_numpy(self.out_handle, np.float32, [N])
        assert np.array_equal(out, self.data), "shared memory holds the wrong tensor"
        shm.set_shared_memory_region(self.out_handle, [np.zeros(N, np.float32)])  # the next answer must write it

    def small(self):
        tensor = httpclient.InferInput("x", [1], "FP32")
        tensor.set_data_from_numpy(self.data[:1], binary_data=True)
        return self.client.infer("identity_small", [tensor], outputs=[httpclient.InferRequestedOutput("y")])


def breakdown(repeats: int = 10) -> dict:
    """Median ms of each step a 4 MiB tensor takes inside the suite on the shared memory path, in this process.

    The gateway's and runtime's own functions and messages, without the
    network and the model: where the time of the ``shm`` case goes. This
    process takes the glibc malloc settings the supervisor gives the gateway
    and runtime (``MALLOC_ENV``) first, so the steps cost what they cost there.
    """
    import ctypes

    from aiworks.supervisor.supervisor import MALLOC_ENV

    libc = ctypes.CDLL("libc.so.6")
    for option, name in ((-3, "MALLOC_MMAP_THRESHOLD_"), (-1, "MALLOC_TRIM_THRESHOLD_"), (-2, "MALLOC_TOP_PAD_")):
        libc.mallopt(option, int(MALLOC_ENV[name]))
    from aiworks.core.converters import add_tensors, from_infer_request, to_infer_request
    from aiworks.core.datatypes import Tensor
    from aiworks.core.inference import InferRequest
    from aiworks.core.options import RequestOptions
    from aiworks.pb.runtime.v1 import runtime_pb2 as rpb

    data = np.random.default_rng(1).standard_normal(N).astype(np.float32)
    region = memoryview(bytearray(data.tobytes()))  # stands for the mapped region
    request = InferRequest("identity", "1", [Tensor("x", "FP32", (N,), region)], ["y"])
    steps: dict[str, list[float]] = {}

    def timed(name: str, fn):
        started = time.perf_counter()
        value = fn()
        steps.setdefault(name, []).append(time.perf_counter() - started)
        return value

    for _ in range(repeats):
        msg = timed("gateway: request message (the one copy of the input)", lambda: from_infer_request(
            request, RequestOptions()))  # fmt: skip
        frame = timed("gateway: frame of the request", lambda: _frame(rpb.InferRequestFrame, msg))
        wire = timed("gateway: serialize the frame (gRPC)", frame.SerializeToString)
        got = timed("runtime: parse the frame", lambda: rpb.InferRequestFrame.FromString(wire))
        req = timed("runtime: request to tensors", lambda: to_infer_request(got.items[0]))
        array = timed("runtime: tensor to numpy", lambda: np.frombuffer(req.inputs[0].raw, np.float32))
        out = Tensor("y", "FP32", (N,), array.tobytes())  # onnxruntime's output, copied out of its buffer
        reply = timed("runtime: response message", lambda: _reply(rpb, add_tensors, out))
        rframe = timed("runtime: frame of the response", lambda: _frame(rpb.InferResponseFrame, reply))
        rwire = timed("runtime: serialize the frame (gRPC)", rframe.SerializeToString)
        back = timed("gateway: parse the frame", lambda: rpb.InferResponseFrame.FromString(rwire))
        raw = timed("gateway: output bytes", lambda: back.items[0].outputs[0].raw)
        target = memoryview(bytearray(4 * N))
        timed("gateway: write the output into the region", lambda: target.__setitem__(slice(0, len(raw)), raw))
    medians = {name: round(statistics.median(values) * 1e3, 2) for name, values in steps.items()}
    medians["total"] = round(sum(medians.values()), 2)
    return medians


def _frame(frame_type, item):
    frame = frame_type()  # as the stream's Outbox builds it (src/aiworks/core/stream.py)
    frame.items.add().CopyFrom(item)
    return frame


def _reply(rpb, add_tensors, out):
    reply = rpb.InferResponse()
    add_tensors(reply.outputs, [out])
    return reply


def run(http_url: str, rounds: int, requests: int) -> dict:
    client = httpclient.InferenceServerClient(http_url, network_timeout=60, connection_timeout=60)
    cases = Cases(client)
    samples: dict[str, list[float]] = {"http_binary": [], "shm": [], "tiny_request": []}
    try:
        for name in samples:  # warm-up: connections, sessions, page faults of the regions
            for _ in range(3):
                getattr(cases, name if name != "tiny_request" else "small")()
        for _ in range(rounds):
            for name in ("http_binary", "shm", "tiny_request"):
                send = getattr(cases, name if name != "tiny_request" else "small")
                for i in range(requests):
                    started = time.perf_counter()
                    result = send()
                    samples[name].append(time.perf_counter() - started)
                    if i == 0 and name != "tiny_request":
                        getattr(cases, f"check_{name}")(result)
    finally:
        cases.close()
        client.close()
    figures = {name: _ms(values) for name, values in samples.items()}
    ratio = figures["shm"]["p50_ms"] / figures["http_binary"]["p50_ms"]
    return {
        "tensor": f"FP32 [{N}] ({4 * N >> 20} MiB) in and out, model Identity (onnxruntime)",
        "rounds": rounds, "requests_per_round": requests, "concurrency": 1,
        "latency": figures,
        "ratio_shm_over_http_binary_p50": round(ratio, 3),
        "target": "<= 0.5",
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "shm_vs_http.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build_repository(repo)
        config = SuiteConfig.on_free_ports(model_repository=repo, log_dir=Path(tmp) / "logs", cache=False, replicas=1)
        supervisor = Supervisor(config)
        try:
            supervisor.start()
            result = run(f"127.0.0.1:{config.http_port}", args.rounds, args.requests)
        finally:
            supervisor.stop()
    result["shm_path_breakdown_ms"] = breakdown()
    result.update(
        date=time.strftime("%Y-%m-%d"), cpus=os.cpu_count(), machine=platform.processor() or platform.machine(),
        command="python bench/shm_vs_http.py " + f"--rounds {args.rounds} --requests {args.requests}",
    )  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
