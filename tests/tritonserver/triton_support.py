"""Models and helpers shared by the triton tests (fixtures live in conftest.py)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np

from aiworks.demo.models import IRIS_CONFIG  # the demo's iris, served by the suite itself

TESTDATA = Path(__file__).parent / "testdata"


# The same model behind Triton. Its python backend stands in for a GPU
# platform here; on a GPU machine this would be platform "onnxruntime_onnx"
# or "tensorrt_plan" with no triton_backend parameter.
IRIS_TRITON_CONFIG = """\
name: "iris_triton"
backend: "triton"
max_batch_size: 64
input [ { name: "input" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "label" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } },
  { name: "probabilities" data_type: TYPE_FP32 dims: [ 3 ] }
]
dynamic_batching { max_queue_delay_microseconds: 500 }
instance_group [ { count: 1 kind: KIND_GPU } ]
version_policy: { all { } }
parameters { key: "triton_backend" value: { string_value: "python" } }
"""

IRIS_ROWS = np.array([[5.1, 3.5, 1.4, 0.2], [6.7, 3.0, 5.2, 2.3], [5.9, 3.0, 4.2, 1.5]], dtype=np.float32)


def _iris_onnx(c: float) -> bytes:
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.datasets import load_iris
    from sklearn.linear_model import LogisticRegression

    x, y = load_iris(return_X_y=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = LogisticRegression(C=c, max_iter=1000).fit(x.astype(np.float32), y)
        onx = to_onnx(model, initial_types=[("input", FloatTensorType([None, 4]))],
                      options={id(model): {"zipmap": False}}, target_opset={"": 17, "ai.onnx.ml": 3})  # fmt: skip
    return onx.SerializeToString()


def write_repository(root: Path) -> Path:
    """``iris`` (ONNX Runtime) and ``iris_triton`` versions 1 and 2 (through Triton)."""
    v1, v2 = _iris_onnx(1.0), _iris_onnx(0.05)
    (root / "iris" / "1").mkdir(parents=True)
    (root / "iris" / "config.pbtxt").write_text(IRIS_CONFIG)
    (root / "iris" / "1" / "model.onnx").write_bytes(v1)
    (root / "iris_triton").mkdir()
    (root / "iris_triton" / "config.pbtxt").write_text(IRIS_TRITON_CONFIG)
    for version, onnx in ((1, v1), (2, v2)):
        folder = root / "iris_triton" / str(version)
        folder.mkdir()
        (folder / "model.onnx").write_bytes(onnx)
        shutil.copy(TESTDATA / "onnx_python_model.py", folder / "model.py")
    return root


def ort_reference(repository: Path, model: str, version: int, rows: np.ndarray) -> dict[str, np.ndarray]:
    """What ONNX Runtime itself answers for ``rows``."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(repository / model / str(version) / "model.onnx"))
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, {"input": rows})))
