"""The ``pytorch`` backend: TorchScript and ``torch.export`` programs, as Triton's ``pytorch_libtorch`` serves them.

A model opts in the way a Triton user writes it: ``platform: "pytorch_libtorch"``
(or ``backend: "pytorch"``), with ``<version>/model.pt`` (or the config's
``default_model_filename``). The file is either a TorchScript archive
(``torch.jit.save``) or an exported program (``torch.export.save``); the
backend tells them apart by their contents. Tensor names map onto ``forward``
as in Triton (:mod:`aiworks.runtime.torch_io`: argument names, ``INPUT__0`` /
``OUTPUT__0``, or config order).

Where it runs follows the config's ``instance_group`` kind: ``KIND_CPU`` on
the CPU, ``KIND_GPU`` on the first of its ``gpus`` (refused without CUDA),
and no kind (Triton's auto) on ``cuda:0`` when CUDA is present, else the CPU.
On a GPU (:mod:`aiworks.runtime.torch_cuda`) each instance of the group has
its own CUDA stream, inputs and outputs cross through pinned host memory,
and ``optimization { cuda { graphs: true ... } }`` replays CUDA graphs for
fixed batch sizes.

Config parameters, Triton's and the suite's:

- ``precision``: ``fp32`` (default), ``fp16`` or ``bf16``. Weights are cast
  and ``forward`` runs under autocast; the config's input and output types
  stay what clients send and get.
- ``INFERENCE_MODE`` (default true), ``DISABLE_OPTIMIZED_EXECUTION`` (TorchScript
  is frozen and optimized for inference unless true), ``ENABLE_CACHE_CLEANING``,
  ``INTRA_OP_THREAD_COUNT`` / ``INTER_OP_THREAD_COUNT`` (process-wide: the
  first model that sets them wins, as in Triton).

torch is imported when the first such model loads, so replicas without
PyTorch models never pay for it (or need it installed).
"""

from __future__ import annotations

import contextlib
import io
import logging
import threading
import warnings
import zipfile
from pathlib import Path

import numpy as np

from aiworks.core.errors import AIWorksError, Internal, InvalidArgument, Status
from aiworks.core.model_config import ModelConfig, TensorSpec
from aiworks.runtime.torch_io import InputPlan, graph_plan, plan_inputs, plan_outputs, select_outputs
from aiworks.security.model_guard import ModelGuard

log = logging.getLogger(__name__)

PLATFORM = "pytorch_libtorch"
PRECISIONS = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
_TORCH_DTYPES = {
    "BOOL": "bool", "UINT8": "uint8", "INT8": "int8", "INT16": "int16", "INT32": "int32", "INT64": "int64",
    "FP16": "float16", "FP32": "float32", "FP64": "float64",
}  # fmt: skip
_DATATYPE_OF = {v: k for k, v in _TORCH_DTYPES.items()}

_guard = ModelGuard()  # no keys: plain files load from their path, encrypted ones are refused
_threads_lock = threading.Lock()
_threads_set: dict[str, int] = {}


def use_model_guard(guard: ModelGuard) -> None:
    """Open every model file through ``guard`` from now on (the runtime's main, once)."""
    global _guard
    _guard = guard


def import_torch():
    try:
        import torch
    except ImportError as exc:
        raise InvalidArgument(
            f"the pytorch backend needs PyTorch on this replica (pip install -r requirements-lifecycle.txt): {exc}"
        ) from None
    # Request tensors are read-only views of the message bytes; the model never writes its inputs.
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
    return torch


def archive_kind(source: bytes | Path) -> str:
    """``torchscript``, ``export`` (``torch.export.save``) or ``aoti`` (an AOTInductor package), by contents."""
    try:
        with zipfile.ZipFile(io.BytesIO(source) if isinstance(source, bytes) else source) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError) as exc:
        raise InvalidArgument(f"not a PyTorch model archive: {exc}") from None
    if any("/data/aotinductor/" in n for n in names):
        return "aoti"
    if any(n.endswith("/archive_format") for n in names):
        return "export"
    if any(n.endswith("/data.pkl") for n in names) and any("/code/" in n for n in names):
        return "torchscript"
    raise InvalidArgument("not a TorchScript or torch.export archive (neither code/ nor archive_format inside)")


def _truthy(params: dict[str, str], key: str, default: bool) -> bool:
    value = params.get(key)
    return default if value is None else value.strip().lower() in ("1", "true", "yes", "on")


def _set_threads(torch, params: dict[str, str], default_intra: int) -> None:
    """PyTorch's thread pools are process-wide: set them once, from the first model that loads."""
    wanted = {
        "intra": int(params.get("INTRA_OP_THREAD_COUNT") or params.get("intra_op_thread_count") or default_intra),
        "inter": int(params.get("INTER_OP_THREAD_COUNT") or params.get("inter_op_thread_count") or 0),
    }
    with _threads_lock:
        if "intra" not in _threads_set and wanted["intra"] > 0:
            torch.set_num_threads(wanted["intra"])
            _threads_set["intra"] = wanted["intra"]
        if "inter" not in _threads_set and wanted["inter"] > 0:
            with contextlib.suppress(RuntimeError):  # only before the first inter-op work
                torch.set_num_interop_threads(wanted["inter"])
            _threads_set["inter"] = wanted["inter"]


def device_for(config: ModelConfig, cuda_available: bool) -> str:
    """The device a config's instance group asks for (Triton's rules; see the module docstring)."""
    groups = config.document.get("instance_group") or []
    kinds = {g.get("kind", "KIND_AUTO") for g in groups} or {"KIND_AUTO"}
    if len(kinds) > 1:
        raise InvalidArgument(f"model '{config.name}': instance groups of one kind only, not {sorted(kinds)}")
    kind = kinds.pop()
    if kind == "KIND_CPU":
        return "cpu"
    if kind not in ("KIND_GPU", "KIND_AUTO"):
        raise InvalidArgument(f"model '{config.name}': instance group kind {kind} is not served by the pytorch backend")
    if not cuda_available:
        if kind == "KIND_GPU":
            raise InvalidArgument(
                f"model '{config.name}' asks for KIND_GPU, but PyTorch sees no CUDA device on this replica"
            )
        return "cpu"
    gpus = [int(g) for g in (groups[0].get("gpus") or [0])] if groups else [0]
    if len(gpus) > 1:
        log.warning(
            "model %s: instance group names GPUs %s; this replica serves it on GPU %d", config.name, gpus, gpus[0]
        )
    return f"cuda:{gpus[0]}"


def _precision(config: ModelConfig) -> str:
    name = (config.parameters.get("precision") or "fp32").strip().lower()
    if name not in PRECISIONS:
        raise InvalidArgument(f"model '{config.name}': precision must be one of {sorted(PRECISIONS)}, not {name!r}")
    return name


class TorchModel:
    """One loaded PyTorch model version; built as ``TorchModel(path, config, threads)``; ``run`` is thread-safe."""

    def __init__(self, path: Path, config: ModelConfig, default_intra_op_threads: int = 1):
        torch = self.torch = import_torch()
        self.name = config.name
        self.batched = config.max_batch_size > 0
        params = config.parameters
        _set_threads(torch, params, default_intra_op_threads)
        self.device = torch.device(device_for(config, torch.cuda.is_available()))
        self.precision = _precision(config)
        self._cast = None if self.precision == "fp32" else getattr(torch, PRECISIONS[self.precision])
        self._inference_mode = _truthy(params, "INFERENCE_MODE", True)
        self._optimized = not _truthy(params, "DISABLE_OPTIMIZED_EXECUTION", False)
        self._clean_cache = _truthy(params, "ENABLE_CACHE_CLEANING", False)
        self._healthy = True

        source = _guard.open(path, model=config.name, version=Path(path).parent.name)
        self.kind = archive_kind(source)
        allocated = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
        if self.kind == "torchscript":
            forward_args, dict_input, derived = self._load_torchscript(source)
        elif self.kind == "export":
            forward_args, dict_input, derived = self._load_exported(source, config.max_batch_size > 0)
        else:
            raise InvalidArgument(
                f"model '{config.name}': {Path(path).name} is an AOTInductor package (platform torch_aoti), "
                "which this backend does not serve; save a TorchScript or torch.export program as model.pt"
            )
        inputs = config.inputs or (derived[0] if derived else ())
        outputs = config.outputs or (derived[1] if derived else ())
        if not inputs or not outputs:
            raise InvalidArgument(
                f"model '{config.name}': a TorchScript model cannot describe its tensors; declare every input "
                "and output in config.pbtxt, as Triton's pytorch backend requires"
            )
        self.specs = (tuple(inputs), tuple(outputs))
        for t in (*inputs, *outputs):
            if t.datatype not in _TORCH_DTYPES:
                raise InvalidArgument(f"model '{config.name}': tensor '{t.name}' of type {t.datatype} is not supported")
        self.plan: InputPlan = plan_inputs(config.name, [t.name for t in inputs], forward_args, dict_input)
        self._out_index = plan_outputs([t.name for t in outputs])
        self._out_names = [t.name for t in outputs]
        self._out_position = {name: i for i, name in enumerate(self._out_names)}
        self._out_dtypes = [getattr(torch, _TORCH_DTYPES[t.datatype]) for t in outputs]
        self._in_dtypes = [getattr(torch, _TORCH_DTYPES[t.datatype]) for t in inputs]
        self.inline_ok = self.device.type == "cpu"  # a GPU batch waits for its stream: never on the event loop
        self._cuda = None
        if self.device.type == "cuda":
            from aiworks.runtime.torch_cuda import CudaInstances

            resolved = config if config.inputs else _with_specs(config, inputs, outputs)
            self._cuda = CudaInstances(self, config.instance_count, graph_plan(resolved))
            self.device_bytes = torch.cuda.memory_allocated(self.device) - allocated
        else:
            self.device_bytes = 0
        log.info(
            "pytorch model %s: %s on %s, %s, inputs by %s%s",
            config.name,
            self.kind,
            self.device,
            self.precision,
            self.plan.convention,
            f", CUDA graphs for batch sizes {list(self.batch_sizes)}" if self.batch_sizes else "",
        )

    # ---- loading -----------------------------------------------------------------------------

    def _load_torchscript(self, source):
        with warnings.catch_warnings():
            # PyTorch 2.13 deprecates TorchScript; Triton's pytorch_libtorch serves it, so the suite does too.
            warnings.simplefilter("ignore", DeprecationWarning)
            return self._load_torchscript_quietly(source)

    def _load_torchscript_quietly(self, source):
        torch = self.torch
        module = torch.jit.load(io.BytesIO(source) if isinstance(source, bytes) else str(source), map_location="cpu")
        module.eval()
        schema = module.forward.schema
        args = [a for a in schema.arguments if a.name != "self"]
        dict_input = len(args) == 1 and str(args[0].type).startswith("Dict[")
        forward_args = [a.name for a in args]
        module = module.to(self.device)
        if self._cast is not None:
            module = module.to(self._cast)
        if self._optimized:
            try:
                module = torch.jit.optimize_for_inference(torch.jit.freeze(module))
            except Exception as exc:  # some modules do not freeze; they run as saved
                log.warning("model %s: TorchScript not frozen (%s); it runs unfrozen", self.name, exc)
        self.module = module
        return forward_args, dict_input, None

    def _load_exported(self, source, batched: bool):
        torch = self.torch
        from torch.export.passes import move_to_device_pass

        if isinstance(source, bytes):
            program = torch.export.load(io.BytesIO(source))
        else:
            with open(source, "rb") as f:  # a file object: export warns about names not ending in .pt2
                program = torch.export.load(f)
        if self.device.type != "cpu":
            program = move_to_device_pass(program, self.device)
        user_inputs = [s for s in program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
        forward_args = [s.arg.name for s in user_inputs]
        placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
        output_node = next(n for n in program.graph.nodes if n.op == "output")
        user_outputs = [s for s in program.graph_signature.output_specs if s.kind.name == "USER_OUTPUT"]
        results = {n.name: n for n in output_node.args[0] if hasattr(n, "name")}

        def spec(name: str, node) -> TensorSpec:
            value = node.meta.get("val")
            dims = [int(d) if isinstance(d, int) else -1 for d in value.shape]
            if batched and dims:
                dims = dims[1:]
            return TensorSpec(name, _DATATYPE_OF.get(str(value.dtype).removeprefix("torch."), "FP32"), tuple(dims))

        inputs = tuple(spec(name, placeholders[name]) for name in forward_args)
        outputs = tuple(spec(f"OUTPUT__{i}", results[s.arg.name]) for i, s in enumerate(user_outputs))
        module = program.module()
        if self._cast is not None:
            module = module.to(self._cast)
        self.module = module
        return forward_args, False, (inputs, outputs)

    # ---- the model's own view ------------------------------------------------------------------

    def io_specs(self, batched: bool) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        """Inputs and outputs: the config's, or an exported program's own (TorchScript has none to give)."""
        return self.specs

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Batch sizes with a captured CUDA graph: the sizes a batch is padded to (empty without graphs)."""
        return self._cuda.batch_sizes if self._cuda is not None else ()

    def healthy(self) -> bool:
        """False once a CUDA error has left the device in a state no later batch recovers from."""
        return self._healthy

    # ---- execution -----------------------------------------------------------------------------

    def modes(self):
        """The context ``forward`` runs in: no autograd, TorchScript's optimizer as asked, autocast."""
        torch = self.torch
        stack = contextlib.ExitStack()
        stack.enter_context(torch.inference_mode() if self._inference_mode else torch.no_grad())
        if self.kind == "torchscript" and not self._optimized:
            stack.enter_context(torch.jit.optimized_execution(False))
        if self._cast is not None:
            stack.enter_context(torch.autocast(self.device.type, dtype=self._cast, cache_enabled=False))
        return stack

    def forward(self, tensors: list) -> list:
        """Config-ordered input tensors (on the device) -> config-ordered output tensors, in their config types."""
        if self._cast is not None:
            tensors = [t.to(self._cast) if t.is_floating_point() else t for t in tensors]
        if self.plan.dict_input:
            result = self.module(dict(zip(self.plan.names, tensors)))
        else:
            result = self.module(*self.plan.arguments(tensors))
        outs = select_outputs(self.name, result, self._out_names, self._out_index)
        return [o if o.dtype == dt else o.to(dt) for o, dt in zip(outs, self._out_dtypes)]

    def arrays(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        """The request's inputs in config order, in their config types."""
        out = []
        for spec in self.specs[0]:
            array = feeds.get(spec.name)
            if array is None:
                raise InvalidArgument(f"model '{self.name}' needs input '{spec.name}'")
            out.append(array)
        return out

    def run(self, feeds: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
        picks = [self._out_position[n] for n in outputs] if outputs else list(range(len(self._out_names)))
        try:
            if self._cuda is not None:
                return self._cuda.run(self.arrays(feeds), picks)
            torch = self.torch
            with self.modes():
                results = self.forward([torch.from_numpy(a) for a in self.arrays(feeds)])
            return [results[i].contiguous().numpy() for i in picks]
        except AIWorksError:
            raise
        except Exception as exc:
            raise self._error(exc) from None

    def _error(self, exc: Exception) -> AIWorksError:
        torch = self.torch
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            return AIWorksError(f"model '{self.name}': GPU out of memory for this batch", Status.RESOURCE_EXHAUSTED)
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "CUDA error" in str(exc) or "CUBLAS_STATUS" in str(exc):
            self._healthy = False  # a sticky CUDA error: the context is lost for every later batch
            return Internal(f"model '{self.name}': CUDA failed: {text}")
        return InvalidArgument(f"the model rejected the batch: {text}")

    def after_run(self) -> None:
        if self._clean_cache:
            self.torch.cuda.empty_cache()

    def close(self) -> None:
        """Free the model's device memory now (the data plane calls it when it drops the version)."""
        cuda, self._cuda = self._cuda, None
        if cuda is not None:
            cuda.close()
        self.module = None
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()


def _with_specs(config: ModelConfig, inputs, outputs) -> ModelConfig:
    from dataclasses import replace

    return replace(config, inputs=tuple(inputs), outputs=tuple(outputs))
