"""The classification extension's pure parts: ranking, formatting, shapes, and reading label files."""

from __future__ import annotations

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import InvalidArgument
from aiworks.core.model_config import TensorSpec
from aiworks.runtime.classification import classify, read_labels


def _strings(t: Tensor) -> list:
    return [s.decode() for s in t.to_numpy().ravel().tolist()]


def test_integers_rank_without_overflow_and_ties_go_to_the_lower_index():
    values = np.array([[-128, 127, 5, 127], [0, -128, -1, 0]], dtype=np.int8)
    top = classify(Tensor.from_numpy("o", values), 3, (), batched=True)
    assert top.datatype == "BYTES" and top.shape == (2, 3)
    assert _strings(top) == ["127:1", "127:3", "5:2", "0:0", "0:3", "-1:2"]
    unsigned = np.array([0, 255, 254, 1], dtype=np.uint8)
    assert _strings(classify(Tensor.from_numpy("o", unsigned), 2, (), batched=False)) == ["255:1", "254:2"]


def test_floats_print_as_c_f_with_labels_where_a_line_has_one():
    values = np.array([0.25, 0.5, 0.125, 1e-7], dtype=np.float32)
    top = classify(Tensor.from_numpy("o", values), 10, ("zero", "", "two"), batched=False)
    assert top.shape == (4,)  # capped at the classes a row has
    assert _strings(top) == ["0.500000:1", "0.250000:0:zero", "0.125000:2:two", "0.000000:3"]


def test_label_files_must_stay_in_the_model_folder(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "labels.txt").write_text("cat\ndog\n")
    (tmp_path / "secret.txt").write_text("x\n")
    out = TensorSpec("prob", "FP32", (2,), label_filename="labels.txt")
    assert read_labels(folder, tmp_path, "m", (out,)) == {"prob": ("cat", "dog")}
    for bad in ("../secret.txt", "/etc/passwd", "missing.txt"):
        with pytest.raises(InvalidArgument) as err:
            read_labels(folder, tmp_path, "m", (TensorSpec("prob", "FP32", (2,), label_filename=bad),))
        assert str(tmp_path) not in err.value.message and "model 'm'" in err.value.message
