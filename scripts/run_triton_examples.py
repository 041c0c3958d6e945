"""Run Triton's own Python client examples, unmodified, against the suite, and print what passed.

Give it a checkout of triton-inference-server/client's ``src/python/examples`` (not part of this
repository). It builds a model repository with the demo models, Triton's example models and the streaming
and stateful QA models (``aiworks demo-models --qa --qa-streaming``), starts the whole suite on free ports,
runs each example as its argparse wants (``-u`` pointing at the suite's HTTP or gRPC port; the image
clients get an image made here with PIL), and prints a pass/fail table (``-o json`` for JSON).
docs/triton.md ("Triton's client examples") shows the last table. The image examples import PIL, as
Triton's do: ``.venv/bin/pip install pillow`` first.

    .venv/bin/python scripts/run_triton_examples.py /tmp/client/src/python/examples [-o json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

IMAGE_MODEL = ["-m", "densenet_onnx", "-c", "3", "-s", "INCEPTION"]


@dataclass
class Run:
    example: str
    args: list[str]
    passed: bool = False
    seconds: float = 0.0
    detail: str = ""


def plan(examples: Path, http: str, grpc: str, image: Path) -> list[Run]:
    """One run per example (two for those that take either protocol), with the arguments it needs."""
    runs = []
    for path in sorted(examples.glob("*.py")):
        name = path.name
        if name == "image_client.py":
            runs.append(Run(name, [*IMAGE_MODEL, "-u", http, str(image)]))
            runs.append(Run(name, [*IMAGE_MODEL, "-i", "grpc", "-u", grpc, str(image)]))
        elif name == "grpc_image_client.py":
            runs.append(Run(name, [*IMAGE_MODEL, "-u", grpc, str(image)]))
        elif name == "ensemble_image_client.py":
            runs.append(Run(name, ["-u", http, str(image)]))
        elif name == "reuse_infer_objects_client.py":
            runs.append(Run(name, ["-i", "HTTP", "-u", http]))
            runs.append(Run(name, ["-i", "gRPC", "-u", grpc]))
        elif name == "memory_growth_test.py":
            runs.append(Run(name, ["-i", "HTTP", "-r", "10"]))  # it has no --url: it calls localhost:8000
        elif "grpc" in name:
            runs.append(Run(name, ["-u", grpc]))
        else:
            runs.append(Run(name, ["-u", http]))
    return runs


def execute(run: Run, examples: Path, timeout_s: float) -> Run:
    started = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, run.example, *run.args],
            cwd=examples,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        output = (proc.stdout + proc.stderr).strip()
        run.passed = proc.returncode == 0
        lines = [line for line in output.splitlines() if line.strip()]
        run.detail = "" if run.passed else (lines[-1] if lines else f"exit status {proc.returncode}")[:200]
    except subprocess.TimeoutExpired:
        run.detail = f"no answer within {timeout_s:.0f} s"
    run.seconds = round(time.monotonic() - started, 1)
    return run


def build_repository(target: Path) -> None:
    from aiworks.demo.models import build_demo_repository
    from aiworks.demo.qa_streaming import build_qa_streaming_models
    from aiworks.demo.triton_qa import build_triton_qa_models

    build_demo_repository(target, progress=lambda message: print(message, file=sys.stderr, flush=True))
    build_triton_qa_models(target)
    build_qa_streaming_models(target)


def make_image(path: Path) -> Path:
    import numpy as np
    from PIL import Image

    pixels = (np.random.default_rng(0).random((224, 224, 3)) * 255).astype(np.uint8)
    Image.fromarray(pixels, "RGB").save(path, "JPEG")
    return path


def shown(run: Run) -> str:
    """The run's command line as the table shows it: addresses as HTTP and GRPC, the image as IMAGE."""
    args = [ADDRESSES.get(a, "IMAGE" if a.startswith("/") else a) for a in run.args]
    return " ".join([run.example, *args])


ADDRESSES: dict[str, str] = {}  # the suite's host:port -> HTTP / GRPC, for the table


def table(runs: list[Run]) -> str:
    width = max(len(shown(r)) for r in runs)
    lines = [f"{'example (arguments)':<{width}}  result  seconds  why it failed", "-" * (width + 40)]
    for r in runs:
        lines.append(f"{shown(r):<{width}}  {'pass' if r.passed else 'FAIL':<6}  {r.seconds:>7}  {r.detail}")
    passed = sum(r.passed for r in runs)
    lines.append(f"{passed} of {len(runs)} runs passed")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("examples", type=Path, help="a checkout of triton-inference-server/client src/python/examples")
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table")
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds each example may take (default 90)")
    parser.add_argument(
        "--server-name", default="triton",
        help="the name server metadata reports (the gateway's server_name setting; the health examples check "
        "for 'triton'; default triton)",
    )  # fmt: skip
    parser.add_argument("--only", default="", help="run only the examples whose file name contains this")
    args = parser.parse_args(argv)
    examples = args.examples.resolve()
    if not (examples / "simple_http_infer_client.py").is_file():
        parser.error(f"{args.examples} does not look like triton-inference-server/client's src/python/examples")

    from aiworks.supervisor.supervisor import SuiteConfig, Supervisor

    with tempfile.TemporaryDirectory(prefix="triton-examples-") as tmp:
        work = Path(tmp)
        print("building the model repository ...", file=sys.stderr, flush=True)
        build_repository(work / "repo")
        image = make_image(work / "image.jpg")
        config = SuiteConfig.on_free_ports(
            model_repository=work / "repo",
            log_dir=work / "logs",
            extra_env={"AIWORKS_GATEWAY_SERVER_NAME": args.server_name},
        )
        supervisor = Supervisor(config)
        try:
            print("starting the suite ...", file=sys.stderr, flush=True)
            supervisor.start()
            http, grpc = f"127.0.0.1:{config.http_port}", f"127.0.0.1:{config.grpc_port}"
            ADDRESSES.update({http: "HTTP", grpc: "GRPC"})
            runs = []
            for run in plan(examples, http, grpc, image):
                if args.only not in run.example:
                    continue
                print(f"  {run.example} ...", file=sys.stderr, flush=True)
                runs.append(execute(run, examples, args.timeout))
        finally:
            supervisor.stop()
    if args.output == "json":
        print(json.dumps([asdict(r) for r in runs], indent=2))
    else:
        print(table(runs))
    return 0 if all(r.passed for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
