#!/usr/bin/env bash
# The GPU session's one device call (docs/torch.md, "The GPU check"). Here, first:
#   echo /.carry/ >> .git/info/exclude
#   .venv/bin/python scripts/device/prepare_torch_check.py .carry
# then run, with carry [".carry"] and timeout_s 540:
#   bash scripts/device/torch_minilm_check.sh "$OUT"
# It installs the carried wheels into /tmp/site (the image's torch, transformers and numpy serve),
# lays the aiworks package out from the working tree as pyproject.toml maps it, runs the GPU metrics
# check and the torch backend's CUDA tests, then torch_minilm_check.py; everything lands in $OUT.
set -uo pipefail
out="${1:?usage: torch_minilm_check.sh OUT_DIR}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/wheels/*.whl \
  || { echo "installing the carried wheels failed"; exit 2; }
python3 scripts/device/link_package.py /tmp/pkg || exit 2
export PYTHONPATH="/tmp/pkg:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 scripts/device/gpu_metrics_check.py "$out" 2>&1 | tail -5
  python3 -m pytest -q -p no:cacheprovider tests/torch_backend/test_torch_cuda.py 2>&1 | tail -15
  python3 scripts/device/torch_minilm_check.py "$out" --carry .carry
} 2>&1 | tee "$out/device.log"
# Back in $OUT (6 files; a call returns at most 8): device.log, gpu_metrics.json, torch_minilm.json and
# logs/{scheduler,runtime-0,gateway}.log.
