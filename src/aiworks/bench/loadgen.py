"""A closed-loop load generator speaking the Open Inference Protocol over gRPC or HTTP.

Requests are built once per level and re-sent, so the generator spends its CPU
on the protocol, not on making data. Its own CPU use is reported next to the
results: if it nears one core, the generator, not the suite, is the limit.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from aiworks.bench.options import parse_levels
from aiworks.core.datatypes import NUMPY_DTYPES, encode


@dataclass
class LevelResult:
    concurrency: int
    requests: int
    errors: int
    throughput_rps: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    avg_batch: float
    client_cpu: float  # cores used by this process while measuring


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    idx = min(len(sorted_values) - 1, max(0, int(round(q / 100 * (len(sorted_values) - 1)))))
    return sorted_values[idx]


def make_inputs(metadata: dict, batch_size: int, seed: int = 0) -> list[tuple[str, str, list[int], bytes]]:
    """Random inputs shaped by the model's metadata: (name, datatype, shape, raw)."""
    rng = np.random.default_rng(seed)
    out = []
    for t in metadata["inputs"]:
        shape = list(t["shape"])
        if shape and shape[0] == -1:
            shape[0] = batch_size
        shape = [1 if d < 0 else d for d in shape]
        dt = t["datatype"]
        if dt == "BYTES":
            array = np.array(["the quick brown fox"] * int(np.prod(shape)), dtype=object).reshape(shape)
        elif dt.startswith("FP"):
            array = rng.random(shape).astype(NUMPY_DTYPES[dt])
        elif dt == "BOOL":
            array = rng.random(shape) > 0.5
        else:
            array = rng.integers(0, 10, shape).astype(NUMPY_DTYPES[dt])
        out.append((t["name"], dt, shape, encode(array, dt)))
    return out


class GrpcTarget:
    def __init__(self, url: str, model: str, version: str, root_certificates: bytes | None = None):
        import grpc
        from tritonclient.grpc import service_pb2, service_pb2_grpc

        self.pb = service_pb2
        options = [("grpc.max_receive_message_length", 1 << 26)]
        if root_certificates is None:
            self.channel = grpc.aio.insecure_channel(url, options=options)
        else:  # a gateway serving TLS (aiworks up --tls): trust its CA
            credentials = grpc.ssl_channel_credentials(root_certificates=root_certificates)
            self.channel = grpc.aio.secure_channel(url, credentials, options=options)
        self.stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.model, self.version = model, version

    async def metadata(self) -> dict:
        from google.protobuf import json_format

        reply = await self.stub.ModelMetadata(self.pb.ModelMetadataRequest(name=self.model, version=self.version))
        doc = json_format.MessageToDict(reply, preserving_proto_field_name=True)
        for t in doc["inputs"]:
            t["shape"] = [int(d) for d in t["shape"]]
        return doc

    def prepare(self, inputs) -> None:
        req = self.pb.ModelInferRequest(model_name=self.model, model_version=self.version)
        for name, dt, shape, raw in inputs:
            req.inputs.add(name=name, datatype=dt, shape=shape)
            req.raw_input_contents.append(raw)
        self.request = req

    async def infer(self) -> None:
        await self.stub.ModelInfer(self.request)

    async def counts(self) -> tuple[int, int]:
        reply = await self.stub.ModelStatistics(self.pb.ModelStatisticsRequest(name=self.model, version=self.version))
        return (
            sum(m.inference_count for m in reply.model_stats),
            sum(m.execution_count for m in reply.model_stats),
        )

    async def close(self) -> None:
        await self.channel.close()


class HttpTarget:
    def __init__(self, url: str, model: str, version: str):
        import aiohttp

        self.base = url if url.startswith("http") else f"http://{url}"
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "")
        self.model_url = self.base + path

    async def metadata(self) -> dict:
        async with self.session.get(self.model_url) as resp:
            resp.raise_for_status()
            return await resp.json()

    def prepare(self, inputs) -> None:
        header = {
            "inputs": [
                {"name": n, "datatype": dt, "shape": s, "parameters": {"binary_data_size": len(raw)}}
                for n, dt, s, raw in inputs
            ],
            "parameters": {"binary_data_output": True},
        }
        head = json.dumps(header).encode()
        self.body = head + b"".join(raw for *_, raw in inputs)
        self.headers = {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}

    async def infer(self) -> None:
        async with self.session.post(self.model_url + "/infer", data=self.body, headers=self.headers) as resp:
            await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")

    async def counts(self) -> tuple[int, int]:
        async with self.session.get(self.model_url + "/stats") as resp:
            doc = await resp.json()
        stats = doc["model_stats"]
        return sum(m["inference_count"] for m in stats), sum(m["execution_count"] for m in stats)

    async def close(self) -> None:
        await self.session.close()


async def _level(target, concurrency: int, warmup_s: float, duration_s: float) -> LevelResult:
    latencies: list[float] = []
    errors = 0
    measuring = False
    stop_at = time.perf_counter() + warmup_s + duration_s

    async def worker():
        nonlocal errors
        while True:
            started = time.perf_counter()
            if started >= stop_at:
                return
            try:
                await target.infer()
                if measuring:
                    latencies.append(time.perf_counter() - started)
            except Exception:
                if measuring:
                    errors += 1

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await asyncio.sleep(warmup_s)
    rows0, execs0 = await target.counts()
    measuring = True
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*tasks)
    cpu1, wall1 = time.process_time(), time.perf_counter()
    rows1, execs1 = await target.counts()
    elapsed = wall1 - wall0
    latencies.sort()
    ms = [x * 1e3 for x in latencies]
    return LevelResult(
        concurrency=concurrency,
        requests=len(latencies),
        errors=errors,
        throughput_rps=len(latencies) / elapsed if elapsed > 0 else 0.0,
        p50_ms=_percentile(ms, 50),
        p90_ms=_percentile(ms, 90),
        p99_ms=_percentile(ms, 99),
        mean_ms=statistics.fmean(ms) if ms else float("nan"),
        avg_batch=(rows1 - rows0) / (execs1 - execs0) if execs1 > execs0 else float("nan"),
        client_cpu=(cpu1 - cpu0) / elapsed if elapsed > 0 else 0.0,
    )


async def sweep(
    protocol: str,
    url: str,
    model: str,
    version: str,
    levels: list[int],
    *,
    batch_size: int = 1,
    warmup_s: float = 1.0,
    duration_s: float = 5.0,
    report=print,
    inputs: list[tuple[str, str, list[int], bytes]] | None = None,
    root_certificates: bytes | None = None,
) -> list[LevelResult]:
    """One level after another; ``inputs`` (name, datatype, shape, raw) replace the random ones;
    ``root_certificates``: the CA of a gateway serving gRPC over TLS."""
    if protocol == "grpc":
        target = GrpcTarget(url, model, version, root_certificates)
    else:
        target = HttpTarget(url, model, version)
    try:
        target.prepare(inputs or make_inputs(await target.metadata(), batch_size))
        results = []
        for level in levels:
            result = await _level(target, level, warmup_s, duration_s)
            report(format_row(result))
            results.append(result)
        return results
    finally:
        await target.close()


HEADER = (
    f"{'concurrency':>11} {'infer/s':>9} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'mean ms':>8} "
    f"{'avg batch':>9} {'errors':>6} {'client CPU':>10}"
)


def format_row(r: LevelResult) -> str:
    return (
        f"{r.concurrency:>11} {r.throughput_rps:>9.1f} {r.p50_ms:>8.2f} {r.p90_ms:>8.2f} {r.p99_ms:>8.2f} "
        f"{r.mean_ms:>8.2f} {r.avg_batch:>9.2f} {r.errors:>6} {r.client_cpu * 100:>9.0f}%"
    )


def run_cli(args) -> None:
    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    levels = parse_levels(args.concurrency_range)
    print(f"model {args.model} over {args.protocol} at {url}, batch size {args.batch_size}, "
          f"{args.duration_s:.0f} s per level after {args.warmup_s:.0f} s warm-up")
    print(HEADER)
    results = asyncio.run(
        sweep(
            args.protocol,
            url,
            args.model,
            args.model_version,
            levels,
            batch_size=args.batch_size,
            warmup_s=args.warmup_s,
            duration_s=args.duration_s,
        )
    )
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
