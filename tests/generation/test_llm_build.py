"""``aiworks llm build``: the KV-cache ONNX export matches GPT-2, the CLI writes a servable folder, training works."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from generation.llm_support import TINY

from aiworks.core.model_config import read_config
from aiworks.lifecycle import llm

ROOT = Path(__file__).resolve().parents[2]


def test_the_decoder_graph_matches_gpt2_over_its_cache(tmp_path):
    """Whole prompts in one call (two rows, one padded), a prompt's later chunk over its cache, and decoding
    rows of different lengths in one call: the logits are GPT-2's, and the cache is written in place."""
    import torch

    from aiworks.runtime.llm_backend import OnnxDecoder

    model = llm.hf_model(TINY, 1024).eval()
    decoder = OnnxDecoder(llm.export_onnx(model, tmp_path / "model.onnx", precision="fp32"), 1)
    cfg = model.config
    heads, head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
    ids = np.random.default_rng(0).integers(0, 1024, (2, 12)).astype(np.int64)
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids)).logits.numpy()
        want7 = model(input_ids=torch.from_numpy(ids[:1, :7])).logits.numpy()
    cache = np.zeros((2 * cfg.n_layer, 2, heads, 32, head_dim), np.float32)
    slots = [cache[j] for j in range(2 * cfg.n_layer)]

    def call(tokens, positions, seqlens, rows, where):
        return decoder(tokens, positions, np.asarray(seqlens, np.int32), np.asarray(rows, np.int64), where)

    # Row 0 brings 7 tokens (padded to 9), row 1 brings 9: logits at each row's last real token.
    padded = ids[:, :9].copy()
    padded[0, 7:] = 0
    first = call(padded, np.tile(np.minimum(np.arange(9), [[6], [8]]), 1), [8, 8], [6, 9 + 8], slots)
    np.testing.assert_allclose(first[0], want7[0, 6], atol=2e-4)
    np.testing.assert_allclose(first[1], want[1, 8], atol=2e-4)
    assert np.abs(cache[:, 1, :, :9]).sum() > 0 and not cache[:, 1, :, 9:].any()  # written in place, no further
    # Row 0's next two tokens (7, 8) over its cache, alone; its padding slots are written over.
    row0 = [cache[j, :1] for j in range(2 * cfg.n_layer)]
    more = call(ids[:1, 7:9], np.array([[7, 8]]), [8], [0, 1], row0)
    np.testing.assert_allclose(more[1], want[0, 8], atol=2e-4)
    # Then decoding: both rows at length 9, one token each, three steps.
    for step in range(9, 12):
        out = call(ids[:, step : step + 1], np.full((2, 1), step), [step, step], [0, 1], slots)
        np.testing.assert_allclose(out, want[:, step], atol=2e-4)
    # Rows of different lengths decode in one call: each attends to its own slots only.
    junk = cache.copy()
    junk[:, 0, :, 10:] = 7.0  # row 0 is 10 long here; what lies past its length is never read
    out = call(np.array([[ids[0, 10]], [ids[1, 11]]]), np.array([[10], [11]]), [10, 11], [0, 1],
               [junk[j] for j in range(2 * cfg.n_layer)])  # fmt: skip
    np.testing.assert_allclose(out[0], want[0, 10], atol=2e-4)
    np.testing.assert_allclose(out[1], want[1, 11], atol=2e-4)


def test_the_int8_export_serves_what_the_fp32_one_does(tmp_path):
    """The int8 graph: the loss over text windows within 0.02 nats of the float32 graph's, which
    equals the torch model's; most next-token choices agree (random weights: near-uniform logits, the hard case)."""
    import torch

    model = llm.hf_model(TINY, 1024).eval()
    ids = np.random.default_rng(1).integers(0, 1024, 4096)
    with torch.no_grad():
        torch_loss = llm.mean_loss(model, ids, 64)
    exact = llm.served_loss(llm.export_onnx(model, tmp_path / "fp32.onnx"), ids, 64)
    int8 = llm.served_loss(llm.export_onnx(model, tmp_path / "int8.onnx", precision="int8"), ids, 64)
    assert abs(exact - torch_loss) < 1e-4, (exact, torch_loss)
    assert abs(int8 - exact) < 0.02, (int8, exact)
    assert (tmp_path / "int8.onnx").stat().st_size < 0.6 * (tmp_path / "fp32.onnx").stat().st_size
    with pytest.raises(ValueError, match="precision"):
        llm.export_onnx(model, tmp_path / "x.onnx", precision="fp8")


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
    # The served path (the exported ONNX model, the engine): its held-out loss is the torch model's, and it
    # agrees with the torch model on the first token; the int8 graph's loss is within 0.05 nats of it.
    folder, built = llm.build(tmp_path, spec, cache_dir=CACHE, progress=False)
    assert built["precision"] == "fp32" and abs(built["served_held_out_loss"] - loss) < 1e-3, (built, loss)
    _, int8 = llm.build(tmp_path / "int8", spec, cache_dir=CACHE, progress=False, precision="int8")
    assert abs(int8["served_held_out_loss"] - loss) < 0.05, (int8, loss)
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
