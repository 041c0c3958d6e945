"""The "traditional single-node deployment" that bench/qos_vs_single_node.py compares against.

One FastAPI process (uvicorn with httptools, as the gateway uses) that loads
one ONNX model with onnxruntime and runs every request on its own: no queue,
no batching across clients, no replicas. The body is read on the event
loop; parsing, the ONNX Runtime call and encoding run in Starlette's thread
pool (40 threads), as a plain ``def`` endpoint would, so ONNX Runtime (which
releases the GIL) computes several requests at once, on every core, with its
default thread settings. It speaks enough of the Open Inference Protocol
for the same load generator: model metadata, infer with JSON or binary
tensor data, and statistics.

Usage: python bench/baseline_server.py --model model-repository/digits/2/model.onnx [--port 9000]
"""

from __future__ import annotations

import argparse
import json
import threading

import numpy as np
import onnxruntime as ort
import uvicorn
from fastapi import FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

_NUMPY = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32}
_DATATYPE = {np.dtype(v): k for k, v in _NUMPY.items()}


def create_app(model_path: str, name: str, version: str, intra_op_threads: int = 0) -> FastAPI:
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads  # 0: ONNX Runtime's default (one per core)
    session = ort.InferenceSession(model_path, options, providers=["CPUExecutionProvider"])
    inp = session.get_inputs()[0]
    outputs = [o.name for o in session.get_outputs()]
    counts = {"rows": 0, "runs": 0}
    lock = threading.Lock()
    app = FastAPI()
    metadata = {
        "name": name,
        "versions": [version],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": inp.name, "datatype": "FP32", "shape": [-1, *inp.shape[1:]]}],
        "outputs": [{"name": o, "datatype": "FP32", "shape": [-1]} for o in outputs],
    }
    base = f"/v2/models/{name}/versions/{version}"

    @app.get("/v2/health/ready")
    def ready():
        return {"ready": True}

    @app.get(base)
    def model_metadata():
        return metadata

    @app.get(base + "/stats")
    def stats():
        return {"model_stats": [{"name": name, "version": version, "inference_count": counts["rows"],
                                 "execution_count": counts["runs"]}]}  # fmt: skip

    @app.post(base + "/infer")
    async def infer(request: Request):
        body = await request.body()
        return await run_in_threadpool(_infer, request.headers.get("inference-header-content-length"), body)

    def _infer(header_length: str | None, body: bytes) -> Response:
        if header_length:
            head, raw = json.loads(body[: int(header_length)]), body[int(header_length) :]
            spec = head["inputs"][0]
            x = np.frombuffer(raw, dtype=_NUMPY[spec["datatype"]]).reshape(spec["shape"])
        else:
            head = json.loads(body)
            spec = head["inputs"][0]
            x = np.asarray(spec["data"], dtype=_NUMPY[spec["datatype"]]).reshape(spec["shape"])
        results = session.run(None, {inp.name: x})
        with lock:
            counts["rows"] += x.shape[0]
            counts["runs"] += 1
        if header_length:  # answer in kind: binary outputs after a JSON header
            parts, out = [], []
            for o, r in zip(outputs, results):
                r = np.ascontiguousarray(r)
                data = r.tobytes()
                parts.append(data)
                out.append({"name": o, "datatype": _DATATYPE.get(r.dtype, "FP32"), "shape": list(r.shape),
                            "parameters": {"binary_data_size": len(data)}})  # fmt: skip
            doc = json.dumps({"model_name": name, "model_version": version, "outputs": out}).encode()
            return Response(doc + b"".join(parts), media_type="application/octet-stream",
                            headers={"Inference-Header-Content-Length": str(len(doc))})  # fmt: skip
        doc = {"model_name": name, "model_version": version,
               "outputs": [{"name": o, "datatype": _DATATYPE.get(r.dtype, "FP32"), "shape": list(r.shape),
                            "data": r.ravel().tolist()} for o, r in zip(outputs, results)]}  # fmt: skip
        return Response(json.dumps(doc), media_type="application/json")

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="path of the ONNX model")
    parser.add_argument("--name", default="digits")
    parser.add_argument("--version", default="2")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--intra-op-threads", type=int, default=0, help="ONNX Runtime threads per run; 0: its default")
    args = parser.parse_args()
    app = create_app(args.model, args.name, args.version, args.intra_op_threads)
    uvicorn.run(app, host=args.host, port=args.port, http="httptools", access_log=False, log_level="warning")


if __name__ == "__main__":
    main()
