"""The minilm text model: tokenizer in the graph, embeddings match PyTorch, INT8 stays close."""

from __future__ import annotations

import numpy as np
import onnx

from aiworks.core.datatypes import decode, serialize_bytes
from aiworks.core.model_config import read_config
from aiworks.lifecycle import minilm
from aiworks.lifecycle.sessions import open_session


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_config_takes_text_and_returns_embeddings(minilm_repo):
    folder, _ = minilm_repo
    config = read_config(folder)
    assert config.max_batch_size == 64 and config.batching.enabled
    assert [(t.name, t.datatype, t.dims) for t in config.inputs] == [("text", "BYTES", (1,))]
    assert [(t.name, t.datatype, t.dims) for t in config.outputs] == [
        ("embedding", "FP32", (384,)),
        ("token_count", "INT64", (1,)),
    ]
    assert config.parameters[minilm.EXTENSIONS_PARAMETER] == "true"
    assert config.version_policy.kind == "all"
    assert (folder / "1" / "model.onnx").is_file() and (folder / "2" / "model.onnx").is_file()


def test_build_reports_each_step_as_it_starts(minilm_repo):
    _, work = minilm_repo
    lines = (work.parent / "progress.txt").read_text().splitlines()
    assert [line.split(" s: ")[0].rsplit(" ", 1)[0] for line in lines] == [
        f"minilm build [{i}/5]" for i in range(1, 6)
    ]
    assert "exporting the encoder" in lines[1] and "quantizing" in lines[3]


def test_onnx_embeddings_match_pytorch(minilm_repo, minilm_reference):
    folder, _ = minilm_repo
    got = minilm.embed(folder / "1" / "model.onnx", minilm.SENTENCES)
    assert got.shape == (len(minilm.SENTENCES), 384)
    assert cosine(got, minilm_reference).min() >= 0.999
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # normalised, as the pipeline says


def test_the_text_model_counts_each_texts_tokens_as_the_tokenizer_does(minilm_repo):
    folder, _ = minilm_repo
    session = open_session(folder / "1" / "model.onnx")
    texts = np.asarray(list(minilm.SENTENCES), dtype=object).reshape(-1, 1)
    (counts,) = session.run([minilm.TOKEN_COUNT], {"text": texts})
    want = minilm.tokenize(list(minilm.SENTENCES))["attention_mask"].sum(axis=1, keepdims=True)
    assert counts.dtype == np.int64 and counts.shape == (len(minilm.SENTENCES), 1)
    np.testing.assert_array_equal(counts, want)


def test_int8_embeddings_stay_within_cosine_0_99(minilm_repo, minilm_reference):
    folder, _ = minilm_repo
    got = minilm.embed(folder / "2" / "model.onnx", minilm.SENTENCES)
    assert cosine(got, minilm_reference).min() >= 0.99
    assert (folder / "2" / "model.onnx").stat().st_size < 0.5 * (folder / "1" / "model.onnx").stat().st_size


def test_in_graph_tokenizer_matches_the_hf_tokenizer(minilm_repo):
    _, work = minilm_repo
    from aiworks.lifecycle.tokenizer_graph import bert_tokenizer_model

    texts = [
        "Hello world!",
        "",
        "   ",
        "Café naïve résumé — ÉLAN, 東京 and an emoji 🙂\twith  tabs",
        "word " * 300,  # truncated to 128 tokens
        "don't stop-believing; it's 3.14!",
    ]
    tokenizer = minilm.load_tokenizer()
    graph = bert_tokenizer_model(minilm.vocab(tokenizer), max_length=minilm.MAX_LENGTH)
    onnx.save(graph, work / "tokenizer.onnx")
    session = open_session(work / "tokenizer.onnx")
    ids, mask = session.run(None, {"text": np.array(texts, dtype=object).reshape(-1, 1)})
    want = minilm.tokenize(texts, tokenizer)
    assert ids.shape == (len(texts), 128)
    np.testing.assert_array_equal(ids, want["input_ids"])
    np.testing.assert_array_equal(mask, want["attention_mask"])
    # A batch of short texts is cut back to its longest row, as padding="longest" does.
    short_ids, _ = session.run(None, {"text": np.array([["a b"], ["a"]], dtype=object)})
    np.testing.assert_array_equal(short_ids, minilm.tokenize(["a b", "a"], tokenizer)["input_ids"])


def test_runs_on_the_tensors_the_runtime_feeds(minilm_repo, minilm_reference):
    """The runtime decodes a BYTES [N, 1] tensor and hands ONNX Runtime str objects: that is enough."""
    folder, _ = minilm_repo
    texts = list(minilm.SENTENCES[:3])
    raw = serialize_bytes(np.array(texts, dtype=object).reshape(-1, 1))
    array = decode(raw, "BYTES", (3, 1))
    feed = np.vectorize(lambda b: b.decode("utf-8", "replace"), otypes=[object])(array)
    session = open_session(folder / "1" / "model.onnx")
    (out,) = session.run(["embedding"], {"text": feed})
    assert out.dtype == np.float32 and out.shape == (3, 384)
    assert cosine(out, minilm_reference[:3]).min() >= 0.999


def test_encoder_export_matches_pytorch_on_token_ids(minilm_repo, minilm_reference):
    """The bare encoder (runtime-independent pre-processing in Python) agrees as well."""
    _, work = minilm_repo
    session = open_session(work / "encoder.onnx")
    (out,) = session.run(None, minilm.tokenize(minilm.SENTENCES))
    assert cosine(out, minilm_reference).min() >= 0.999
