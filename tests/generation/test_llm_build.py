"""``aiworks llm build``: the KV-cache ONNX export matches GPT-2, the CLI writes a servable folder, training works."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from generation.llm_support import TINY

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
    # The first 9 tokens, then the last 3 over the cache: the same logits. ``present`` is the new tokens' only.
    head = session.run(None, feeds(cfg, ids[:, :9], np.ones((2, 9), np.int64), positions[:, :9], empty))
    assert head[1].shape == (2, cfg.n_head, 9, cfg.n_embd // cfg.n_head)
    tail = session.run(None, feeds(cfg, ids[:, 9:], np.ones((2, 12), np.int64), positions[:, 9:], head[1:]))
    np.testing.assert_allclose(tail[0], want[:, 9:], atol=2e-4)
    assert tail[1].shape == (2, cfg.n_head, 3, cfg.n_embd // cfg.n_head)
    # A cache with holes (a masked-out slot between the prompt and the new token) reads as one without.
    holed = [np.concatenate([kv[:, :, :9], np.full_like(kv[:, :, :1], 7.0)], axis=2) for kv in head[1:]]
    mask = np.ones((2, 11), np.int64)
    mask[:, 9] = 0
    one = session.run(None, feeds(cfg, ids[:, 9:10], mask, positions[:, 9:10], holed))
    np.testing.assert_allclose(one[0][:, 0], want[:, 9], atol=2e-4)


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


# The default before issue 18's size (1.1 M parameters, ~1 CPU-minute): what the test suite trains. The default
# (12.3 M parameters, ~3 min on 2 idle cores) is checked only once `aiworks llm build` has trained and cached it.
SMALL = llm.LlmSpec(layers=4, heads=4, dim=128, vocab=2048, steps=200, batch=32, lr=5e-3)
CACHE = ROOT / ".aiworks" / "cache" / "llm"


@pytest.mark.slow
@pytest.mark.timeout(900)  # a clean clone trains the small spec first: 1-2 min on 2 idle cores, 5 on a loaded one
@pytest.mark.parametrize("which", ["small", "default"])
def test_the_trained_model_has_learnt_python_context(tmp_path, which):
    """The held-out loss is well below uniform and below a unigram model's (frequencies from the training text).

    Tests never train the default: its case runs on the weights a build cached, and is skipped without them.
    """
    spec = SMALL if which == "small" else llm.LlmSpec()
    if which == "default" and not (CACHE / spec.key() / "weights.pt").is_file():
        pytest.skip("the default codegen is not trained here yet: `aiworks llm build` trains and caches it")
    from tokenizers import Tokenizer

    from aiworks.runtime.llm_backend import OnnxDecoder
    from aiworks.runtime.llm_engine import Engine, Sampling

    tokenizer_json, model, report = llm.trained(spec, cache_dir=CACHE, progress=False)
    tokenizer = Tokenizer.from_file(str(tokenizer_json))
    uniform = math.log(tokenizer.get_vocab_size())
    loss = llm.held_out_loss(tokenizer, model, spec)
    counts = np.bincount(llm.token_stream(tokenizer, llm.corpus(spec.corpus_mb)), minlength=tokenizer.get_vocab_size())
    unigram = (counts + 1.0) / (counts + 1.0).sum()
    held_out = llm.token_stream(tokenizer, llm.corpus(0.5, held_out=True))
    unigram_loss = float(-np.log(unigram[held_out]).mean())
    assert loss < uniform - 1.5 and loss < unigram_loss - 0.5, (loss, unigram_loss, uniform, report)
    # The served path (the exported ONNX model, the engine) agrees with the torch model on the first token.
    folder, _ = llm.build(tmp_path, spec, cache_dir=CACHE, progress=False)
    decoder = OnnxDecoder(folder / "1" / "model.onnx", 2)
    engine = Engine(decoder, tokenizer, layers=decoder.layers, heads=decoder.heads, head_dim=decoder.head_dim,
                    context=spec.context, kv_budget_tokens=4096, max_sequences=4)
    import torch

    ids = engine.encode("import os\nimport")
    seq = engine.add(ids, Sampling(max_tokens=1))
    while seq.state != "done":
        engine.step()
    with torch.no_grad():
        want = int(model(input_ids=torch.from_numpy(ids)[None]).logits[0, -1].argmax())
    assert seq.generated == [want]
