"""``aiworks llm build``: the KV-cache ONNX export matches GPT-2, the CLI writes a servable folder, training works."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from conftest import TINY

from aiworks.core.model_config import read_config
from aiworks.lifecycle import llm

ROOT = Path(__file__).resolve().parents[2]


def feeds(cfg, ids, mask, positions, past):
    names, _ = llm.io_names(cfg.n_layer)
    return dict(zip(names, [ids, mask, positions, *past]))


def test_the_exported_kv_decoder_matches_gpt2(tmp_path):
    import torch

    model = llm.hf_model(TINY, 1024).eval()
    path = llm.export_onnx(model, tmp_path / "model.onnx")
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    cfg = model.config
    ids = np.random.default_rng(0).integers(0, 1024, (2, 12)).astype(np.int64)
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    empty = [np.zeros((2, cfg.n_head, 0, cfg.n_embd // cfg.n_head), np.float32) for _ in range(2 * cfg.n_layer)]
    positions = np.tile(np.arange(12), (2, 1))
    out = session.run(None, feeds(cfg, ids, np.ones((2, 12), np.int64), positions, empty))
    np.testing.assert_allclose(out[0], want, atol=2e-4)
    # The first 9 tokens, then the last 3 over the cache: the same logits.
    head = session.run(None, feeds(cfg, ids[:, :9], np.ones((2, 9), np.int64), positions[:, :9], empty))
    tail = session.run(None, feeds(cfg, ids[:, 9:], np.ones((2, 12), np.int64), positions[:, 9:], head[1:]))
    np.testing.assert_allclose(tail[0], want[:, 9:], atol=2e-4)
    assert tail[1].shape == (2, cfg.n_head, 12, cfg.n_embd // cfg.n_head)


def test_the_cli_writes_a_decoupled_llm_model_folder(tmp_path):
    cmd = [sys.executable, "-m", "aiworks", "llm", "build", "--random", "--layers", "2", "--out", str(tmp_path),
           "--no-cache", "--quiet"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout and '"parameters"' in done.stdout
    folder = tmp_path / "codegen"
    assert (folder / "1" / "model.onnx").is_file() and (folder / "1" / "tokenizer.json").is_file()
    config = read_config(folder)
    assert config.backend == "llm" and config.decoupled and config.max_batch_size == 0
    assert [t.name for t in config.inputs] == ["text_input"] and [t.name for t in config.outputs] == ["text_output"]
    assert not (tmp_path / ".aiworks").exists()  # --no-cache keeps nothing


@pytest.mark.slow
def test_the_trained_model_has_learnt_python():
    """Trains once (~2-3 min on 2 idle cores; 17 min on a loaded one), cached in .aiworks/cache/llm."""
    spec = llm.LlmSpec()
    tokenizer_json, model, report = llm.trained(spec, cache_dir=ROOT / ".aiworks" / "cache" / "llm", progress=False)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    uniform = math.log(tokenizer.get_vocab_size())
    loss = llm.held_out_loss(tokenizer, model, spec)
    # Well below uniform: at least 2.5 nats (a perplexity 12x lower). A 200-step run reaches ~5.5 of 8.3.
    assert loss < uniform - 2.5, (loss, uniform, report)
    import torch

    def greedy(prompt: str, n: int = 12) -> str:
        ids = torch.tensor([tokenizer.encode(prompt).ids])
        with torch.no_grad():
            for _ in range(n):
                ids = torch.cat([ids, model(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
        return tokenizer.decode(ids[0].tolist())

    assert re.match(r"def [A-Za-z_]\w*\(", greedy("def ")), greedy("def ")
    assert re.match(r"import [A-Za-z_]", greedy("import ")), greedy("import ")
