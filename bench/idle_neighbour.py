"""What CPU work at the lowest priority costs online latency on this machine: the floor under bench/tiers.py.

A batch job beside online traffic runs niced (the runner, the runtime's
batch lane), on the premise that the kernel then gives online work the CPU
first, so the job costs it nothing. This measures the premise alone, with
no job: one suite (digits v1, one runtime replica, a tenants file) under an
open loop of ``--rate`` one-row requests/s (Poisson, as bench/tiers.py's),
in ``--rounds`` rounds of ``--seconds`` per condition, the conditions in
turn:

  none      nothing else running;
  nice19    one process multiplying 256 x 256 float32 matrices in a loop (one thread) at ``nice -n 19``;
  idle      the same under ``SCHED_IDLE`` (``chrt -i 0``): the kernel runs it only where nothing else wants
            a CPU, and any other task that wakes preempts it.

Each condition's p50 and p99 are the medians of its rounds'; the ratios
are against ``none``. If either hog moves the online p99, CPU work beside
online traffic costs it on this machine whatever its priority (shared
physical cores under the VM's vCPUs, or the host's own scheduling), and
only less such work, or other cores, can lower that cost. Prints one JSON
object and writes it to ``bench/results/idle-neighbour-<time>.json``.

Usage: python bench/idle_neighbour.py [--rate 1600] [--rounds 4] [--seconds 15]   (about 3.5 min)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tenant_suite import quiet_collector, tenant_suite
from tiers import _body, open_loop

from aiworks.demo.models import digits_split

HOG = "import numpy as np\na = np.random.rand(256, 256).astype('float32')\nwhile True:\n    a @ a\n"
CONDITIONS = {"none": None, "nice19": ["nice", "-n", "19"], "idle": ["chrt", "-i", "0"]}


async def run(args) -> dict:
    _, x, _, _ = digits_split()
    bodies = [_body(r) for r in x[:512].astype(np.float32)]
    rounds: dict[str, list[dict]] = {name: [] for name in CONDITIONS}
    hog_env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with tenant_suite("aiworks-neighbour-", {}) as suite:
        quiet_collector()
        began = time.monotonic()
        await open_loop(suite, bodies, args.rate / 2, lambda: time.monotonic() - began > 3)  # warm-up
        for round_ in range(args.rounds):
            for name, prefix in CONDITIONS.items():
                hog = subprocess.Popen([*prefix, sys.executable, "-c", HOG], env=hog_env) if prefix else None
                try:
                    time.sleep(0.5)  # the hog running before the first arrival
                    began = time.monotonic()
                    doc = await open_loop(suite, bodies, args.rate, lambda b=began: time.monotonic() - b >= args.seconds,
                                          seed=round_)  # fmt: skip
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
                rounds[name].append({"p50_ms": doc["p50_ms"], "p99_ms": doc["p99_ms"], "n": doc["n"],
                                     "failed": doc["failed"]})  # fmt: skip
                print(f"round {round_} {name}: {rounds[name][-1]}", file=sys.stderr, flush=True)
    medians = {
        name: {"p50_ms": round(float(np.median([r["p50_ms"] for r in rs])), 2),
               "p99_ms": round(float(np.median([r["p99_ms"] for r in rs])), 2)}
        for name, rs in rounds.items()
    }  # fmt: skip
    base = medians["none"]
    ratios = {f"{name}_vs_none": {"p50": round(m["p50_ms"] / base["p50_ms"], 3), "p99": round(m["p99_ms"] / base["p99_ms"], 3)}
              for name, m in medians.items() if name != "none"}  # fmt: skip
    return {"rate": args.rate, "rounds": rounds, "medians": medians, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=float, default=1600.0, help="online requests/s (about half the capacity here)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=15.0, help="the open loop's length per condition and round")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for the JSON")
    args = parser.parse_args()
    if not shutil.which("chrt"):
        sys.exit("chrt (util-linux) is needed for the SCHED_IDLE condition")
    began = time.time()
    result = asyncio.run(run(args))
    result = {"cpus": os.cpu_count(), "load_average": [round(v, 2) for v in os.getloadavg()],
              "wall_s": round(time.time() - began, 1), "command": " ".join(sys.argv), **result}  # fmt: skip
    text = json.dumps(result, indent=2)
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"idle-neighbour-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(text + "\n")


if __name__ == "__main__":
    main()
