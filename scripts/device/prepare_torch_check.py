"""Prepare what ``torch_minilm_check.py`` needs on the GPU machine, within the 64 MiB that travels.

Run here, in the repository's root, before the device call::

    echo /.carry/ >> .git/info/exclude
    .venv/bin/python scripts/device/prepare_torch_check.py .carry

It writes ``.carry/``:

- ``minilm/``: MiniLM-L6's config and tokenizer files, and its weights in
  ``weights.safetensors``: fp16, except the word embeddings (half the
  parameters), which are int8 with one fp16 scale per row. That is 34 MB
  instead of the 91 MB of fp32 weights. The GPU machine rebuilds the model
  from them in fp32; the suite and the in-process baseline there load the
  same rebuilt weights, so they compare like for like. How far the rebuilt
  model is from the shipped one is measured here and recorded in
  ``minilm/fidelity.json``.
- ``wheels/``: the Python packages the suite needs that the machine's image
  lacks (its package list: /work/.library/device/KINDS.md), for CPython 3.12
  on x86-64, fetched with ``pip download`` (``--no-wheels`` skips them, for
  the CPU test here).

It fails if the working tree and the carry together would pass 64 MiB.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT_BYTES = 64 << 20

# Pinned as in pyproject.toml, plus what they pull in that the image does not have. The image's own
# numpy, torch, transformers, tokenizers, safetensors, prometheus-client, PyYAML and nvidia-ml-py serve.
WHEELS = [
    "grpcio==1.85.3",  # the generated stubs need >= 1.81.1
    "grpcio-health-checking==1.81.1",
    "protobuf==6.33.6",  # the generated messages need 6.33
    "tritonclient==2.73.0",
    "python-rapidjson==1.25",  # tritonclient.grpc imports it
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "pydantic-settings==2.16.3",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",  # pydantic needs >= 4.16; the image's may be older
    "python-dotenv==1.2.4",
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "uvicorn==0.54.0",
    "httptools==0.9.0",
    "orjson==3.13.0",
    "redis==8.1.0",
    "hiredis==3.5.0",
    "opentelemetry-api==1.45.2",
    "opentelemetry-sdk==1.45.2",
    "opentelemetry-exporter-otlp-proto-grpc==1.45.2",
    "opentelemetry-exporter-otlp-proto-common==1.45.2",
    "opentelemetry-proto==1.45.2",
    "opentelemetry-semantic-conventions==0.66b2",
    "googleapis-common-protos==1.76.0",
    "cryptography==50.0.2",
    "cffi==2.1.1",  # cryptography's
    "pycparser==3.12",
    "PyJWT==2.15.1",
    "google-re2==1.1.20251105",  # the gateway's masking patterns
]
# pyproject.toml's dependencies that do not travel: the image has them (KINDS.md's package list),
# or the check never imports them.
IMAGE_PROVIDES = {"numpy", "onnx", "onnxruntime", "scikit-learn", "prometheus-client", "aiohttp", "nvidia-ml-py",
                  "pyyaml", "tokenizers"}  # fmt: skip
NOT_IMPORTED = {
    "kubernetes": "the monitor's Kubernetes platform only",
    "skl2onnx": "building the demo repository only",
}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_5_x86_64"]  # fmt: skip
TOKENIZER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt")
EMBEDDINGS = "embeddings.word_embeddings.weight"


def pack_weights(model_dir: Path, out: Path) -> dict:
    """fp16 weights, int8 word embeddings with per-row fp16 scales; returns the rebuilt model's fidelity."""
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(model_dir / "model.safetensors"))
    packed = {}
    for name, tensor in state.items():
        if not tensor.is_floating_point():  # position_ids: an arange the model makes itself
            continue
        if name == EMBEDDINGS:
            scale = (tensor.abs().amax(dim=1, keepdim=True) / 127).clamp(min=1e-12)
            packed[name] = torch.round(tensor / scale).clamp(-127, 127).to(torch.int8)
            packed[name.replace(".weight", ".scale")] = scale.to(torch.float16)
        else:
            packed[name] = tensor.to(torch.float16)
    save_file(packed, str(out / "weights.safetensors"))
    rebuilt = unpack_weights(out / "weights.safetensors")
    return fidelity(model_dir, rebuilt)


def unpack_weights(path: Path) -> dict:
    """The fp32 state dict back from :func:`pack_weights`' file (the GPU machine runs this too)."""
    import torch
    from safetensors.torch import load_file

    packed = load_file(str(path))
    state = {}
    for name, tensor in packed.items():
        if name.endswith(".scale"):
            continue
        if tensor.dtype == torch.int8:
            tensor = tensor.float() * packed[name.replace(".weight", ".scale")].float()
        state[name] = tensor.float()
    return state


def fidelity(model_dir: Path, rebuilt_state: dict) -> dict:
    """Cosine between the shipped model's sentence embeddings and the rebuilt one's."""
    import torch

    from aiworks.lifecycle import minilm

    bert = minilm.load_torch_model()
    reference = minilm.torch_embeddings(minilm.SENTENCES, bert=bert)
    missing, unexpected = bert.load_state_dict(rebuilt_state, strict=False)
    if unexpected:
        raise RuntimeError(f"unexpected weights {unexpected}")
    rebuilt = minilm.torch_embeddings(minilm.SENTENCES, bert=bert)
    cosines = (torch.from_numpy(reference) * torch.from_numpy(rebuilt)).sum(dim=1)
    return {"min_cosine": float(cosines.min()), "mean_cosine": float(cosines.mean()), "missing": list(missing)}


def download_wheels(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--implementation", "cp", *platforms, "--platform", "any", "-d", str(out)]  # fmt: skip
    subprocess.run([*cmd, *WHEELS], check=True)


def tree_bytes() -> int:
    """Bytes of what travels besides the carry: tracked and untracked-not-ignored files."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.split(b"\0")  # fmt: skip
    return sum((ROOT / p.decode()).stat().st_size for p in listed if p and (ROOT / p.decode()).is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the carry folder to write (ignored by git, named in the call's carry)")
    parser.add_argument("--no-wheels", action="store_true", help="weights and tokenizer only (the CPU test)")
    args = parser.parse_args()

    from aiworks.lifecycle import minilm

    model_dir = minilm.model_dir()
    target = args.out / "minilm"
    target.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(model_dir / name, target / name)
    report = pack_weights(model_dir, target)
    (target / "fidelity.json").write_text(json.dumps(report, indent=2))
    print(f"weights: {(target / 'weights.safetensors').stat().st_size / 2**20:.1f} MiB, "
          f"cosine to the shipped model min {report['min_cosine']:.5f}, mean {report['mean_cosine']:.5f}")  # fmt: skip
    if not args.no_wheels:
        download_wheels(args.out / "wheels")
    carried = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    tree = tree_bytes()
    print(f"carry {carried / 2**20:.1f} MiB + working tree {tree / 2**20:.1f} MiB = {(carried + tree) / 2**20:.1f} MiB")
    if carried + tree > LIMIT_BYTES:
        raise SystemExit(f"over the 64 MiB a device call carries by {(carried + tree - LIMIT_BYTES) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
