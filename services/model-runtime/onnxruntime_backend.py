"""The ONNX Runtime (CPU) backend.

Model files are opened through the replica's :class:`~aiworks.security.model_guard.ModelGuard`
(:func:`use_model_guard`, set once at start): an encrypted, signed or
watermarked model reaches ONNX Runtime as checked plaintext bytes in memory,
never as a decrypted file; a refused one raises ``ModelRefused``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort

from aiworks.core.datatypes import ONNX_TO_DATATYPE
from aiworks.core.errors import InvalidArgument
from aiworks.core.model_config import ModelConfig, TensorSpec
from aiworks.security.model_guard import ModelGuard

# Triton's onnxruntime backend reads optimization.graph.level this way.
_GRAPH_LEVELS = {
    -1: ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    1: ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    0: ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}

_guard = ModelGuard()  # no keys: plain files load from their path, encrypted ones are refused


def use_model_guard(guard: ModelGuard) -> None:
    """Open every model file through ``guard`` from now on (the runtime's main, once)."""
    global _guard
    _guard = guard


class OnnxRuntimeModel:
    """One loaded ONNX model version; ``run`` is thread-safe and releases the GIL."""

    def __init__(self, path: Path, config: ModelConfig, default_intra_op_threads: int):
        options = ort.SessionOptions()
        options.graph_optimization_level = _GRAPH_LEVELS.get(
            config.graph_optimization_level, ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        )
        options.intra_op_num_threads = int(config.parameters.get("intra_op_thread_count", default_intra_op_threads))
        options.inter_op_num_threads = int(config.parameters.get("inter_op_thread_count", 1))
        # Spinning worker threads burn CPU that other replicas need on small machines.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if config.parameters.get("onnxruntime_extensions", "").lower() == "true":
            # Graphs with in-graph pre-processing (the minilm tokenizer) use its custom ops.
            from aiworks.core.lifecycle import import_onnxruntime_extensions

            options.register_custom_ops_library(import_onnxruntime_extensions().get_library_path())
        guarded = _guard.open_all(
            path,
            model=config.name,
            version=Path(path).parent.name,
            config_file=config.source_file,
            config_sha256=config.source_sha256,
        )
        source = guarded.source
        if guarded.external:  # checked against the signature: ONNX Runtime gets exactly those bytes
            names = list(guarded.external)
            buffers = [guarded.external[n] for n in names]
            options.add_external_initializers_from_files_in_memory(names, buffers, [len(b) for b in buffers])
        elif isinstance(source, bytes):
            # Weights kept in external files beside the model are found here when it loads from memory.
            options.add_session_config_entry(
                "session.model_external_initializers_file_folder_path", str(Path(path).parent)
            )
        if not isinstance(source, bytes):
            source = str(source)
        self.session = ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
        self.output_names = [o.name for o in self.session.get_outputs()]

    def io_specs(self, batched: bool) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        """Inputs and outputs as the ONNX graph declares them (for configs that omit them)."""

        def spec(arg) -> TensorSpec:
            dims = [d if isinstance(d, int) and d > 0 else -1 for d in arg.shape]
            if batched and dims:
                dims = dims[1:]
            return TensorSpec(arg.name, ONNX_TO_DATATYPE.get(arg.type, "FP32"), tuple(dims))

        return (
            tuple(spec(a) for a in self.session.get_inputs()),
            tuple(spec(a) for a in self.session.get_outputs()),
        )

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
        try:
            return self.session.run(outputs or self.output_names, feeds)
        except (ort.capi.onnxruntime_pybind11_state.InvalidArgument, ValueError) as exc:
            raise InvalidArgument(f"the model rejected the batch: {exc}") from None
