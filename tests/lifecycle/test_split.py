"""aiworks split: stages chained give the unsplit output; the edge helper reports what it sends."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from aiworks.core.model_config import read_config
from aiworks.lifecycle.sessions import open_session
from aiworks.lifecycle.split import EdgeStage, cut_candidates, measure_split, run_stages, split_model, stage_io


def test_digits_in_three_stages_chains_to_the_unsplit_output(digits_v2, tmp_path):
    from aiworks.demo.models import digits_split

    x = digits_split()[1][:32]
    folders = split_model(digits_v2, [["next_activations"], ["out_activations_result"]], tmp_path, name="digits")

    assert [f.name for f in folders] == ["digits_stage1", "digits_stage2", "digits_stage3"]
    for f in folders:
        read_config(f)  # the runtime accepts each stage's config
    assert stage_io(folders[0]) == (["input"], ["next_activations"])
    assert stage_io(folders[2]) == (["out_activations_result"], ["label", "probabilities"])

    chained = run_stages(folders, {"input": x})
    label, probabilities = open_session(digits_v2).run(["label", "probabilities"], {"input": x})
    np.testing.assert_array_equal(chained["label"], label)
    np.testing.assert_allclose(chained["probabilities"], probabilities, rtol=1e-6, atol=1e-7)


def test_edge_stage_returns_the_tensor_to_send_and_the_report_counts_it(digits_v2, tmp_path):
    from aiworks.demo.models import digits_split

    x = digits_split()[1][:8]
    folders = split_model(digits_v2, [["next_activations1"]], tmp_path, name="digits")
    edge = EdgeStage(folders[0])
    sent = edge.run({"input": x})
    assert list(sent) == ["next_activations1"] and sent["next_activations1"].shape == (8, 4096)
    assert EdgeStage.payload_bytes(sent) == 8 * 4096 * 4

    report = measure_split(digits_v2, folders, {"input": x}, repeats=2)
    assert report.input_bytes == x.nbytes and report.sent_bytes == [8 * 4096 * 4]
    assert report.max_abs_diff == 0.0 and len(report.stage_ms) == 2
    assert "sent after stage 1" in report.format()


def test_a_stage_that_still_needs_a_request_input_gets_it(minilm_repo):
    """MiniLM's back half needs the attention mask too: the stage declares it as an input."""
    from aiworks.lifecycle import minilm

    _, work = minilm_repo
    encoder = work / "encoder.onnx"
    cut = next(t.name for t in cut_candidates(onnx.load(str(encoder))) if "layer.2/output/LayerNorm" in t.name)
    folders = split_model(encoder, [[cut]], work / "split", name="minilm_encoder")
    inputs, _ = stage_io(folders[1])
    assert inputs[0] == cut and "attention_mask" in inputs

    feeds = minilm.tokenize(minilm.SENTENCES)
    chained = run_stages(folders, feeds)["embedding"]
    (whole,) = open_session(encoder).run(None, feeds)
    np.testing.assert_allclose(chained, whole, atol=1e-5)


def test_an_unknown_cut_is_refused(digits_v2, tmp_path):
    with pytest.raises(ValueError, match="not an intermediate tensor"):
        split_model(digits_v2, [["no_such_tensor"]], tmp_path)
