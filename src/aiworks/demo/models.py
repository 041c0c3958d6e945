"""Builds the demo model repository offline, from sklearn's bundled datasets.

- ``iris``: logistic regression on the iris dataset.
- ``digits``: two versions trained on the 8x8 digits dataset:
  version 1 a logistic regression, version 2 a wider multi-layer perceptron
  whose compute makes batching matter.

Models are converted with skl2onnx and written in Triton's layout with a
``config.pbtxt`` each. Nothing is downloaded.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

SEED = 0

IRIS_CONFIG = """\
name: "iris"
platform: "onnxruntime_onnx"
max_batch_size: 64
input [ { name: "input" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [
  { name: "label" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } },
  { name: "probabilities" data_type: TYPE_FP32 dims: [ 3 ] }
]
dynamic_batching { }
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

DIGITS_CONFIG = """\
name: "digits"
platform: "onnxruntime_onnx"
max_batch_size: 64
version_policy: { all { } }
input [ { name: "input" data_type: TYPE_FP32 dims: [ 64 ] } ]
output [
  { name: "label" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } },
  { name: "probabilities" data_type: TYPE_FP32 dims: [ 10 ] }
]
dynamic_batching {
  preferred_batch_size: [ 32, 64 ]
  max_queue_delay_microseconds: 2000
}
instance_group [ { count: 1 kind: KIND_CPU } ]
optimization { graph { level: 0 } }
parameters { key: "intra_op_thread_count" value: { string_value: "1" } }
"""

# Digits version 2 is deliberately wide: at batch 1 its matrix-vector products
# are bound by memory bandwidth (about 6 ms a row on one core here), while a
# batch of 64 reuses each weight 64 times (about 0.6 ms a row). That is the
# regime where dynamic batching pays, as it does for real networks on GPUs.
DIGITS_V2_HIDDEN = (4096, 4096)
DIGITS_V2_EPOCHS = 3


def _to_onnx(model, n_features: int) -> bytes:
    from skl2onnx import to_onnx
    from skl2onnx.common.data_types import FloatTensorType

    onx = to_onnx(
        model,
        initial_types=[("input", FloatTensorType([None, n_features]))],
        options={id(model): {"zipmap": False}},
        target_opset={"": 17, "ai.onnx.ml": 3},
    )
    # skl2onnx names the outputs label and probabilities already.
    return onx.SerializeToString()


def digits_split():
    """The digits dataset scaled to [0, 1], split 80/20 with a fixed seed."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return train_test_split(x, y, test_size=0.2, random_state=SEED, stratify=y)


def iris_data():
    from sklearn.datasets import load_iris

    x, y = load_iris(return_X_y=True)
    return x.astype(np.float32), y


def _build_iris(out: Path) -> None:
    from sklearn.linear_model import LogisticRegression

    x, y = iris_data()
    model = LogisticRegression(max_iter=1000).fit(x, y)
    (out / "iris" / "1").mkdir(parents=True)
    (out / "iris" / "config.pbtxt").write_text(IRIS_CONFIG)
    (out / "iris" / "1" / "model.onnx").write_bytes(_to_onnx(model, 4))


def _build_digits(out: Path) -> None:
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier

    x_train, x_test, y_train, y_test = digits_split()
    v1 = LogisticRegression(max_iter=2000).fit(x_train, y_train)
    v2 = MLPClassifier(
        hidden_layer_sizes=DIGITS_V2_HIDDEN, max_iter=DIGITS_V2_EPOCHS, batch_size=128, random_state=SEED
    ).fit(x_train, y_train)
    for version, model in ((1, v1), (2, v2)):
        (out / "digits" / str(version)).mkdir(parents=True)
        (out / "digits" / str(version) / "model.onnx").write_bytes(_to_onnx(model, 64))
        log.info("digits version %d: test accuracy %.3f", version, model.score(x_test, y_test))
    (out / "digits" / "config.pbtxt").write_text(DIGITS_CONFIG)


STEPS: list[tuple[str, Callable[[Path], None]]] = [("iris", _build_iris), ("digits", _build_digits)]
DEMO_MODELS = tuple(name for name, _ in STEPS)


def build_demo_model(name: str, target: Path, *, progress: Callable[[str], None] = print) -> Path:
    """Build one demo model into ``target/<name>`` (the storage initializer's ``demo`` source)."""
    import warnings

    [step] = [s for n, s in STEPS if n == name]
    target = Path(target)
    target.mkdir(parents=True, exist_ok=True)
    progress(f"building demo model '{name}'")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(target)
    return target / name


def build_demo_repository(target: Path, *, force: bool = False, progress: Callable[[str], None] = print) -> bool:
    """Build the demo repository at ``target`` unless it exists; returns True when built.

    It is built in a temporary folder and moved into place, so an interrupted
    build never leaves a half-written repository behind.
    """
    import warnings

    target = Path(target)
    if target.exists() and any(target.iterdir()) and not force:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".demo-build-") as tmp:
        work = Path(tmp) / "repo"
        work.mkdir()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sklearn's convergence chatter
            for i, (name, step) in enumerate(STEPS, 1):
                progress(f"[{i}/{len(STEPS)}] building demo model '{name}'")
                step(work)
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    return True
