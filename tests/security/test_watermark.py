"""Owner fingerprints in ONNX metadata, on a real model that onnxruntime runs before and after."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

from aiworks.security.watermark import (
    FINGERPRINT_KEY,
    OWNER_KEY,
    WatermarkError,
    check_file,
    check_watermark,
    embed_watermark,
    watermark_file,
    weights_digest,
)

KEY = b"owner-secret-key-0123456789abcdef"


def _outputs(path) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
    return session.run(None, {"x": x})[0]


def test_watermarked_model_loads_and_gives_identical_outputs(onnx_model, tmp_path):
    marked = tmp_path / "marked.onnx"
    mark = watermark_file(onnx_model, marked, "acme-ml", KEY)
    props = {p.key: p.value for p in onnx.load_model(str(marked)).metadata_props}
    assert props[OWNER_KEY] == "acme-ml" and props[FINGERPRINT_KEY] == mark.fingerprint
    np.testing.assert_array_equal(_outputs(marked), _outputs(onnx_model))
    assert check_file(marked, KEY, owner="acme-ml").owner == "acme-ml"


def test_missing_watermark_is_reported(onnx_model):
    with pytest.raises(WatermarkError, match="no AIWorks watermark") as info:
        check_file(onnx_model, KEY)
    assert info.value.reason == "missing"


@pytest.mark.parametrize("target", ["initializer", "constant"])
def test_edited_weights_break_the_watermark(onnx_model, tmp_path, target):
    marked = tmp_path / "marked.onnx"
    watermark_file(onnx_model, marked, "acme-ml", KEY)
    model = onnx.load_model(str(marked))
    if target == "initializer":
        w = numpy_helper.to_array(model.graph.initializer[0]).copy()
        w[0, 0] += 1e-3
        model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w, model.graph.initializer[0].name))
    else:
        attr = next(n for n in model.graph.node if n.op_type == "Constant").attribute[0]
        attr.t.CopyFrom(numpy_helper.from_array(np.array([0.5, 2.0, 1.5], np.float32), attr.t.name))
    onnx.save_model(model, str(marked))
    with pytest.raises(WatermarkError, match="weights were changed") as info:
        check_file(marked, KEY)
    assert info.value.reason == "mismatch"


def test_wrong_key_or_owner_fails(onnx_model, tmp_path):
    marked = tmp_path / "marked.onnx"
    watermark_file(onnx_model, marked, "acme-ml", KEY)
    with pytest.raises(WatermarkError, match="another key"):
        check_file(marked, b"x" * 32)
    with pytest.raises(WatermarkError, match="not 'globex'") as info:
        check_file(marked, KEY, owner="globex")
    assert info.value.reason == "other-owner"
    model = onnx.load_model(str(marked))
    with pytest.raises(WatermarkError, match="already carries a watermark of owner 'acme-ml'"):
        embed_watermark(model, "globex", KEY)
    embed_watermark(model, "globex", KEY, replace=True)
    assert check_watermark(model, KEY).owner == "globex"


def test_digest_survives_external_data_and_ignores_metadata(onnx_model, tmp_path):
    model = onnx.load_model(str(onnx_model))
    digest = weights_digest(model)
    ext = tmp_path / "ext" / "model.onnx"
    ext.parent.mkdir()
    onnx.save_model(
        model,
        str(ext),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="weights.bin",
        size_threshold=0,
    )  # this moves the weights of `model` out to the file, so reload below
    assert (ext.parent / "weights.bin").exists()
    assert weights_digest(onnx.load_model(str(ext))) == digest
    model = onnx.load_model(str(onnx_model))
    model.metadata_props.add(key="note", value="anything")
    assert weights_digest(model) == digest
    watermark_file(ext, ext, "acme-ml", KEY)
    assert check_file(ext, KEY).weights_sha256 == digest
    assert ext.stat().st_size < 1024  # the weights stayed in weights.bin
    np.testing.assert_array_equal(_outputs(ext), _outputs(onnx_model))
