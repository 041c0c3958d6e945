"""Where each process of the suite spends its CPU under load: py-spy samples of every hop, side by side.

Starts the suite as bench/vs_triton.py does (2 runtime replicas, the same
model files), drives it with tritonclient's asyncio gRPC client (closed loop,
``--concurrency`` tasks), samples the gateway and one runtime replica with
py-spy for ``--duration-s`` while the load runs, and prints, per process, the
functions that hold the most samples (own time: the innermost frame of our
code or of a library's, and inclusive time). Raw samples are written next to
``--out`` for flame graphs (``py-spy``'s collapsed format).

py-spy is a tool, not a dependency of the suite: ``pip install py-spy`` (or
point ``--py-spy`` at its binary).

Usage:
  python bench/profile_hops.py [--model iris] [--concurrency 64] [--duration-s 10] [--out bench/results/profile]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vs_triton import MODELS, build_suite_repository  # noqa: E402


async def drive(url: str, model, concurrency: int, stop: asyncio.Event) -> int:
    import tritonclient.grpc.aio as client_module

    client = client_module.InferenceServerClient(url)
    inputs = []
    for name, datatype, array in model.inputs():
        tensor = client_module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    done = 0

    async def worker() -> None:
        nonlocal done
        while not stop.is_set():
            await client.infer(model.name, inputs, model_version=model.version)
            done += 1

    tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
    await stop.wait()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    return done


def summarize(raw: Path, top: int) -> str:
    """Own and inclusive sample shares of the functions in py-spy's collapsed stacks."""
    own: collections.Counter = collections.Counter()
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        # One entry per function: py-spy names frames "function (file:line)".
        frames = [re.sub(r":\d+\)$", ")", frame) for frame in stack.split(";")]
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    lines = [f"  {total} samples; own time:"]
    lines += [f"    {100 * n / total:5.1f}%  {frame}" for frame, n in own.most_common(top)]
    lines.append("  inclusive (frames of aiworks only):")
    ours = [(f, n) for f, n in inclusive.most_common() if "aiworks" in f or "/services/" in f]
    lines += [f"    {100 * n / total:5.1f}%  {frame}" for frame, n in ours[:top]]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="iris", choices=sorted(MODELS))
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--duration-s", type=float, default=10.0)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--out", type=Path, default=Path("bench/results/profile"))
    args = parser.parse_args()

    from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

    model = MODELS[args.model]
    repo = build_suite_repository([args.model])
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        config = SuiteConfig.on_free_ports(
            model_repository=repo, replicas=args.replicas, log_dir=Path(work) / "logs", log_level="WARNING", cache=False
        )
        suite = Supervisor(config)
        suite.start()
        try:
            pids = {c.name: c.process.pid for c in suite.children if c.process is not None}
            targets = {name: pid for name, pid in pids.items() if name in ("gateway", "runtime-0")}

            async def run() -> tuple[int, float]:
                stop = asyncio.Event()
                load = asyncio.create_task(drive(f"127.0.0.1:{config.grpc_port}", model, args.concurrency, stop))
                await asyncio.sleep(2.0)  # warm up
                started = time.perf_counter()
                spies = [
                    await asyncio.create_subprocess_exec(
                        args.py_spy, "record", "--pid", str(pid), "--duration", str(int(args.duration_s)),
                        "--rate", "200", "--format", "raw", "--output", str(args.out / f"{name}.txt"), "--nonblocking",
                        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
                    )  # fmt: skip
                    for name, pid in targets.items()
                ]
                for spy in spies:
                    await spy.wait()
                elapsed = time.perf_counter() - started
                stop.set()
                return await load, elapsed

            done, elapsed = asyncio.run(run())
        finally:
            suite.stop()
    print(f"{args.model} over gRPC, c={args.concurrency}: {done} requests in all, sampled for {elapsed:.1f} s")
    for name in targets:
        raw = args.out / f"{name}.txt"
        if raw.is_file():
            print(f"\n{name}:\n{summarize(raw, args.top)}")
        else:
            print(f"\n{name}: no samples (py-spy failed; it needs ptrace rights)")


if __name__ == "__main__":
    main()
