"""ONNX Runtime sessions for the offline tools, with custom ops registered when a graph needs them."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort

# The domain of onnxruntime-extensions' custom ops (tokenizers, string ops).
EXTENSIONS_DOMAIN = "ai.onnx.contrib"
# The model-config parameter that asks the runtime to register onnxruntime-extensions' library.
EXTENSIONS_PARAMETER = "onnxruntime_extensions"


def uses_extensions(model: onnx.ModelProto) -> bool:
    return any(o.domain == EXTENSIONS_DOMAIN for o in model.opset_import)


def extensions_library() -> str:
    """Path of onnxruntime-extensions' custom-op library (raises if the package is missing)."""
    from aiworks.core.lifecycle import import_onnxruntime_extensions

    try:
        onnxruntime_extensions = import_onnxruntime_extensions()
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "this model uses onnxruntime-extensions custom ops: pip install -r requirements-lifecycle.txt"
        ) from exc
    return onnxruntime_extensions.get_library_path()


def session_options(*, threads: int = 0, extensions: bool = False) -> ort.SessionOptions:
    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    if extensions:
        options.register_custom_ops_library(extensions_library())
    return options


def open_session(path: Path | str, *, threads: int = 0) -> ort.InferenceSession:
    """A CPU session for ``path``; registers onnxruntime-extensions when the graph uses its ops."""
    model = onnx.load(str(path), load_external_data=False)
    options = session_options(threads=threads, extensions=uses_extensions(model))
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def sample_feeds(session: ort.InferenceSession, batch: int = 2, seed: int = 0) -> dict:
    """Random feeds that fit the session's inputs: symbolic dims become ``batch`` (first) or 8."""
    import numpy as np

    from aiworks.core.datatypes import NUMPY_DTYPES, ONNX_TO_DATATYPE

    rng = np.random.default_rng(seed)
    feeds = {}
    for arg in session.get_inputs():
        shape = [d if isinstance(d, int) and d > 0 else (batch if i == 0 else 8) for i, d in enumerate(arg.shape)]
        datatype = ONNX_TO_DATATYPE.get(arg.type, "FP32")
        if datatype == "BYTES":
            feeds[arg.name] = np.full(shape, "sample text", dtype=object)
        elif datatype == "BOOL":
            feeds[arg.name] = rng.integers(0, 2, shape).astype(bool)
        elif datatype.startswith(("INT", "UINT")):
            feeds[arg.name] = rng.integers(0, 2, shape).astype(NUMPY_DTYPES[datatype])
        else:
            feeds[arg.name] = rng.random(shape).astype(NUMPY_DTYPES[datatype])
    return feeds
