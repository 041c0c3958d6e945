"""A stateful model under interleaved sequences against the same model served stateless (issue 14's target).

One suite (scheduler, two runtime replicas, gateway; no result cache) serves
the QA ``accumulator`` (aiworks.demo.qa_streaming) twice from one ONNX file:

- ``accumulator``: a stateful model (``sequence_batching``, the oldest
  strategy, implicit state): each of the N client tasks runs one sequence
  (``sequence_id``, start on its first request), sending one INT32 a
  request; the runtime keeps the running sum;
- ``accumulator_stateless``: the same graph with no sequence batching: each
  task keeps its running sum itself and sends it with every request
  (``START`` 0 and ``ACC``), with dynamic batching.

Each task waits for its answer before sending the next (a sequence cannot
run ahead of its state). The two cases alternate in rounds of
``--round-s`` so that noise from the shared machine falls on both; every
answer is checked against the expected running sum. The figure is the
ratio of throughputs, stateful / stateless (target: >= 0.9).

Usage: python bench/stateful_sequences.py [--sequences 16] [--rounds 4] [--round-s 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import tritonclient.grpc.aio as grpcaio

from aiworks.demo.qa_streaming import build_qa_streaming_models
from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

ROOT = Path(__file__).resolve().parent.parent


def _int32(name: str, value: int) -> grpcaio.InferInput:
    tensor = grpcaio.InferInput(name, [1, 1], "INT32")
    tensor.set_data_from_numpy(np.array([[value]], dtype=np.int32))
    return tensor


async def stateful_task(client, sid: int, stop_at: float, first: bool) -> int:
    """One sequence: requests until ``stop_at``; returns how many were answered."""
    sent = 0
    total = 0
    while time.monotonic() < stop_at:
        value = (sid + sent) % 7
        result = await client.infer("accumulator", [_int32("INPUT", value)], sequence_id=sid,
                                    sequence_start=first and sent == 0)  # fmt: skip
        total += value
        assert int(result.as_numpy("OUTPUT")[0][0]) == STATE[sid] + total, "a sequence lost its state"
        sent += 1
    STATE[sid] += total
    return sent


async def stateless_task(client, sid: int, stop_at: float) -> int:
    sent = 0
    acc = STATELESS[sid]
    while time.monotonic() < stop_at:
        value = (sid + sent) % 7
        inputs = [_int32("INPUT", value), _int32("START", 0), _int32("ACC", acc)]
        result = await client.infer("accumulator_stateless", inputs)
        acc += value
        assert int(result.as_numpy("ACC_OUT")[0][0]) == acc
        sent += 1
    STATELESS[sid] = acc
    return sent


STATE: dict[int, int] = {}
STATELESS: dict[int, int] = {}


async def run(grpc_url: str, sequences: int, rounds: int, round_s: float) -> dict:
    ids = list(range(1000, 1000 + sequences))
    STATE.update(dict.fromkeys(ids, 0))
    STATELESS.update(dict.fromkeys(ids, 0))
    times = {"stateful": 0.0, "stateless": 0.0}
    counts = {"stateful": 0, "stateless": 0}
    async with grpcaio.InferenceServerClient(grpc_url) as client:
        # Warm-up of both paths (connections, sessions, the sequences' start).
        warm = time.monotonic() + 1.0
        await asyncio.gather(*(stateful_task(client, sid, warm, True) for sid in ids))
        await asyncio.gather(*(stateless_task(client, sid, warm) for sid in ids))
        for _ in range(rounds):
            for case in ("stateless", "stateful"):
                started = time.monotonic()
                stop_at = started + round_s
                if case == "stateful":
                    done = await asyncio.gather(*(stateful_task(client, sid, stop_at, False) for sid in ids))
                else:
                    done = await asyncio.gather(*(stateless_task(client, sid, stop_at) for sid in ids))
                times[case] += time.monotonic() - started
                counts[case] += sum(done)
        for sid in ids:  # end the sequences
            await client.infer("accumulator", [_int32("INPUT", 0)], sequence_id=sid, sequence_end=True)
    rates = {case: counts[case] / times[case] for case in times}
    return {
        "sequences": sequences, "rounds": rounds, "round_s": round_s, "requests": counts,
        "infer_per_s": {k: round(v, 1) for k, v in rates.items()},
        "ratio_stateful_over_stateless": round(rates["stateful"] / rates["stateless"], 3),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--round-s", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stateful_sequences.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        repo = Path(tmp) / "repo"
        build_qa_streaming_models(repo, ("accumulator", "accumulator_stateless"))
        config = SuiteConfig.on_free_ports(model_repository=repo, log_dir=Path(tmp) / "logs", cache=False)
        supervisor = Supervisor(config)
        try:
            supervisor.start()
            result = asyncio.run(run(f"127.0.0.1:{config.grpc_port}", args.sequences, args.rounds, args.round_s))
        finally:
            supervisor.stop()
    result.update(date=time.strftime("%Y-%m-%d"), cpus=os.cpu_count(), replicas=config.replicas)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
