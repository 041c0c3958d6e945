"""Model configs in Triton's format, and the per-version spec the suite passes around.

A model repository uses Triton's layout: ``<repo>/<model>/config.pbtxt`` (or
``config.json``, the protobuf JSON form) and ``<repo>/<model>/<version>/model.onnx``.
The config is parsed with Triton's own ``ModelConfig`` message, which
tritonclient ships, so every field a Triton user writes means what it means in
Triton. It is then turned into the plain dataclasses below; protobuf objects
stay at this edge.

Settings the suite reads (all standard Triton fields):

- ``max_batch_size``; ``input``/``output`` (name, data_type, dims with -1 for
  variable dims, excluding the batch dim when batching);
- ``dynamic_batching { max_queue_delay_microseconds, preferred_batch_size }``;
- ``instance_group [{ count }]``: concurrent executions per replica;
- ``version_policy``: ``latest { num_versions }``, ``all {}`` or ``specific { versions }``;
- ``optimization { graph { level } }``: ONNX Runtime graph optimization
  (-1 basic, 1 extended, 0 or unset all), as in Triton's onnxruntime backend;
- ``parameters { key: "intra_op_thread_count" ... }``: ONNX Runtime threads;
- ``model_transaction_policy { decoupled }`` and ``sequence_batching``
  (:mod:`aiworks.core.sequence_config`; docs/sequences.md).
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from aiworks.core.datatypes import DATATYPES, bytes_offsets, element_count, itemsize
from aiworks.core.errors import AIWorksError, InvalidArgument, Status
from aiworks.core.names import valid_model_name
from aiworks.core.sequence_config import SequenceConfig, parse_sequence_batching

CONFIG_FILES = ("config.pbtxt", "config.json")

# The runtime backend that serves a Triton platform when the config names no backend, and back.
PLATFORM_BACKENDS = {"pytorch_libtorch": "pytorch", "tensorrt_plan": "triton"}
BACKEND_PLATFORMS = {"pytorch": "pytorch_libtorch", "repeat": "repeat"}


class ModelState(enum.Enum):
    READY = "READY"
    UNAVAILABLE = "UNAVAILABLE"
    LOADING = "LOADING"


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """An input or output: dims exclude the batch dim when the model batches.

    As in Triton, ``dims`` is the shape clients send and see; ``reshape`` (the config's ``reshape.shape``,
    None without one) is the shape the model itself takes or produces, batch dim excluded likewise.
    """

    name: str
    datatype: str
    dims: tuple[int, ...]
    reshape: tuple[int, ...] | None = None
    # An input's Triton format (FORMAT_NCHW or FORMAT_NHWC; "" for FORMAT_NONE): image clients read it.
    format: str = ""
    # An output's Triton label_filename: a file in the model's folder, one class label per line (classification).
    label_filename: str = ""


@dataclass(frozen=True, slots=True)
class BatchingConfig:
    enabled: bool = False
    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    """Which versions on disk are served: ``latest`` N, ``all``, or ``specific``."""

    kind: str = "latest"
    num_versions: int = 1
    versions: tuple[int, ...] = ()

    def select(self, available: list[int]) -> list[int]:
        ordered = sorted(available)
        if self.kind == "all":
            return ordered
        if self.kind == "specific":
            return [v for v in ordered if v in self.versions]
        return ordered[-self.num_versions :] if self.num_versions > 0 else []


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A model's config as read from its repository folder."""

    name: str
    platform: str = "onnxruntime_onnx"
    backend: str = "onnxruntime"
    max_batch_size: int = 0
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    batching: BatchingConfig = BatchingConfig()
    instance_count: int = 1
    version_policy: VersionPolicy = VersionPolicy()
    graph_optimization_level: int = 0
    parameters: dict[str, str] = field(default_factory=dict)
    decoupled: bool = False
    # Triton's sequence_batching (a stateful model); None without it.
    sequence: SequenceConfig | None = None
    # The config in Triton's JSON form, for the model-config endpoint.
    document: dict = field(default_factory=dict)
    # The file it was read from and the SHA-256 of the bytes parsed: a signed
    # model's manifest covers its config (docs/security.md), checked against these.
    source_file: str = ""
    source_sha256: str = ""

    def spec(self, version: str, state: ModelState = ModelState.READY, reason: str = "") -> ModelSpec:
        return ModelSpec(
            name=self.name,
            version=version,
            platform=self.platform,
            max_batch_size=self.max_batch_size,
            inputs=self.inputs,
            outputs=self.outputs,
            batching=self.batching,
            instance_count=self.instance_count,
            parameters=dict(self.parameters),
            state=state,
            reason=reason,
            decoupled=self.decoupled,
            sequence=self.sequence,
        )


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One version of a model as the scheduler and gateway see it."""

    name: str
    version: str
    platform: str = ""
    max_batch_size: int = 0
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    batching: BatchingConfig = BatchingConfig()
    instance_count: int = 1
    parameters: dict[str, str] = field(default_factory=dict)
    state: ModelState = ModelState.READY
    reason: str = ""
    # Triton's model_transaction_policy.decoupled: 0..N responses per request, streaming front ends only.
    decoupled: bool = False
    # Triton's sequence_batching: requests carry a sequence id and are pinned to one replica (a stateful model).
    sequence: SequenceConfig | None = None

    @property
    def ready(self) -> bool:
        return self.state is ModelState.READY

    def with_state(self, state: ModelState, reason: str = "") -> ModelSpec:
        return replace(self, state=state, reason=reason)

    def full_shape(self, t: TensorSpec) -> list[int]:
        """The shape a client sees: with a leading -1 batch dim when batching."""
        return ([-1] if self.max_batch_size > 0 else []) + list(t.dims)


def _datatype(enum_value: int, where: str) -> str:
    name = model_config_pb2.DataType.Name(enum_value)
    dt = "BYTES" if name == "TYPE_STRING" else name.removeprefix("TYPE_")
    if dt not in DATATYPES:
        raise InvalidArgument(f"{where}: data_type {name} is not supported")
    return dt


def _tensor_specs(entries, where: str) -> tuple[TensorSpec, ...]:
    specs = []
    for e in entries:
        dims = tuple(int(d) for d in e.dims)
        if any(d < -1 or d == 0 for d in dims):
            raise InvalidArgument(f"{where}: '{e.name}' has an invalid dim in {list(dims)}")
        reshape = tuple(int(d) for d in e.reshape.shape) if e.HasField("reshape") else None
        if reshape is not None:
            if any(d < -1 or d == 0 for d in reshape):
                raise InvalidArgument(f"{where}: '{e.name}' has an invalid dim in reshape {list(reshape)}")
            if -1 not in dims and -1 not in reshape and element_count(dims) != element_count(reshape):
                raise InvalidArgument(
                    f"{where}: '{e.name}' has dims {list(dims)} and reshape {list(reshape)} of different sizes"
                )
            if dims.count(-1) != reshape.count(-1) and reshape.count(-1) > 1:
                raise InvalidArgument(
                    f"{where}: '{e.name}': reshape {list(reshape)} has more variable dims than dims {list(dims)}"
                )
            if reshape == dims:
                reshape = None
        fmt = model_config_pb2.ModelInput.Format.Name(e.format) if getattr(e, "format", 0) else ""  # inputs only
        labels = getattr(e, "label_filename", "")  # outputs only
        specs.append(TensorSpec(e.name, _datatype(e.data_type, f"{where} '{e.name}'"), dims, reshape, fmt, labels))
    return tuple(specs)


def reshaped(shape: tuple[int, ...], batched: bool, src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[int, ...]:
    """The shape a tensor of ``shape`` (declared ``src``) takes when declared ``dst`` instead.

    The batch dim is kept; the variable dims of ``dst`` take the values of ``src``'s variable dims in order,
    or, when those do not fit, a single one takes whatever makes the sizes agree. Used both ways: dims ->
    reshape for inputs, reshape -> dims for outputs. A numpy reshape to it is a view, never a copy.
    """
    head, body = (tuple(shape[:1]), tuple(shape[1:])) if batched else ((), tuple(shape))
    if -1 not in dst:
        return head + dst
    free = [got for got, want in zip(body, src) if want == -1] if len(body) == len(src) else []
    if len(free) == dst.count(-1):
        values = iter(free)
        carried = tuple(next(values) if d == -1 else d for d in dst)
        if element_count(carried) == element_count(body):
            return head + carried
    known = element_count([d for d in dst if d != -1])
    return head + tuple(element_count(body) // max(known, 1) if d == -1 else d for d in dst)


def parse_config(text: str, *, fmt: str, model_name: str) -> ModelConfig:
    """Parse a Triton model config (``pbtxt`` or ``json``) into a :class:`ModelConfig`."""
    where = f"model '{model_name}' config"
    msg = model_config_pb2.ModelConfig()
    try:
        if fmt == "json":
            json_format.Parse(text, msg)
        else:
            text_format.Parse(text, msg)
    except (text_format.ParseError, json_format.ParseError) as exc:
        raise InvalidArgument(f"{where}: {exc}") from None
    if msg.name and msg.name != model_name:
        raise InvalidArgument(f"{where}: name '{msg.name}' does not match its folder '{model_name}'")
    msg.name = model_name
    if msg.max_batch_size < 0:
        raise InvalidArgument(f"{where}: max_batch_size must be >= 0")

    batching = BatchingConfig()
    if msg.HasField("dynamic_batching"):
        db = msg.dynamic_batching
        preferred = tuple(sorted(int(p) for p in db.preferred_batch_size))
        if msg.max_batch_size and any(p > msg.max_batch_size or p < 1 for p in preferred):
            raise InvalidArgument(f"{where}: preferred_batch_size must lie in 1..max_batch_size")
        batching = BatchingConfig(msg.max_batch_size > 0, int(db.max_queue_delay_microseconds), preferred)

    vp = VersionPolicy()
    if msg.HasField("version_policy"):
        which = msg.version_policy.WhichOneof("policy_choice")
        if which == "all":
            vp = VersionPolicy("all")
        elif which == "specific":
            vp = VersionPolicy("specific", versions=tuple(int(v) for v in msg.version_policy.specific.versions))
        elif which == "latest":
            vp = VersionPolicy("latest", num_versions=int(msg.version_policy.latest.num_versions) or 1)

    instances = sum(max(g.count, 1) for g in msg.instance_group) or 1
    sequence = parse_sequence_batching(msg, model_name, int(msg.max_batch_size))
    inputs = _tensor_specs(msg.input, where)
    if sequence is not None:  # the batcher fills controls and state: clients neither send nor see them
        inputs = tuple(t for t in inputs if t.name not in sequence.hidden_inputs)
    params = {k: v.string_value for k, v in msg.parameters.items()}
    return ModelConfig(
        name=model_name,
        platform=msg.platform or BACKEND_PLATFORMS.get(msg.backend, "onnxruntime_onnx"),
        backend=msg.backend or PLATFORM_BACKENDS.get(msg.platform, "onnxruntime"),
        max_batch_size=int(msg.max_batch_size),
        inputs=inputs,
        outputs=_tensor_specs(msg.output, where),
        batching=batching,
        instance_count=instances,
        version_policy=vp,
        graph_optimization_level=int(msg.optimization.graph.level) if msg.HasField("optimization") else 0,
        parameters=params,
        decoupled=bool(msg.model_transaction_policy.decoupled),
        sequence=sequence,
        document=json_format.MessageToDict(msg, preserving_proto_field_name=True),
    )


def read_config(model_dir: Path) -> ModelConfig:
    """Read ``config.pbtxt`` or ``config.json`` from a model folder."""
    name = model_dir.name
    if not valid_model_name(name):
        raise InvalidArgument(f"model folder '{name}' is not a valid model name")
    for filename in CONFIG_FILES:
        path = model_dir / filename
        if path.is_file():
            data = path.read_bytes()
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidArgument(f"model '{name}' config: {filename} is not UTF-8 text") from None
            config = parse_config(text, fmt=path.suffix.lstrip("."), model_name=name)
            return replace(config, source_file=filename, source_sha256=hashlib.sha256(data).hexdigest())
    raise AIWorksError(f"model '{name}' has no config ({' or '.join(CONFIG_FILES)})", Status.NOT_FOUND)


def check_inputs(spec: ModelSpec, inputs) -> int:
    """Check request tensors against the model's inputs; return the batch rows.

    Raises :class:`InvalidArgument` naming the first problem found: an unknown
    or missing input, a wrong datatype, a shape that does not fit the dims, a
    batch larger than ``max_batch_size``, or data whose size does not match the
    shape. Models without a batch dimension count as one row.
    """
    declared = {t.name: t for t in spec.inputs}
    seen = set()
    rows: int | None = None
    for tensor in inputs:
        want = declared.get(tensor.name)
        if want is None:
            raise InvalidArgument(
                f"unexpected input '{tensor.name}' for model '{spec.name}'; it expects {sorted(declared)}"
            )
        if tensor.name in seen:
            raise InvalidArgument(f"input '{tensor.name}' is given more than once")
        seen.add(tensor.name)
        if tensor.datatype != want.datatype:
            raise InvalidArgument(
                f"input '{tensor.name}' has datatype {tensor.datatype}, model '{spec.name}' expects {want.datatype}"
            )
        shape = list(tensor.shape)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"input '{tensor.name}' has a negative dim in shape {shape}")
        dims = list(want.dims)
        if spec.max_batch_size > 0:
            if len(shape) != len(dims) + 1:
                raise InvalidArgument(
                    f"input '{tensor.name}' has shape {shape}, model '{spec.name}' expects {[-1] + dims}"
                )
            batch, shape = shape[0], shape[1:]
            if batch < 1 or batch > spec.max_batch_size:
                raise InvalidArgument(
                    f"input '{tensor.name}' has batch size {batch}, model '{spec.name}' accepts 1..{spec.max_batch_size}"
                )
            if rows is not None and batch != rows:
                raise InvalidArgument(f"inputs disagree on batch size ({rows} and {batch})")
            rows = batch
        elif len(shape) != len(dims):
            raise InvalidArgument(f"input '{tensor.name}' has shape {shape}, model '{spec.name}' expects {dims}")
        for got, exp in zip(shape, dims):
            if exp != -1 and got != exp:
                full = ([-1] if spec.max_batch_size > 0 else []) + dims
                raise InvalidArgument(
                    f"input '{tensor.name}' has shape {list(tensor.shape)}, model '{spec.name}' expects {full}"
                )
        size = itemsize(tensor.datatype)
        if not size:
            count = len(bytes_offsets(tensor.raw, name=tensor.name)) - 1
            if count != element_count(tensor.shape):
                raise InvalidArgument(
                    f"input '{tensor.name}': {count} BYTES elements, but shape {list(tensor.shape)} needs "
                    f"{element_count(tensor.shape)}"
                )
        elif len(tensor.raw) != element_count(tensor.shape) * size:
            raise InvalidArgument(
                f"input '{tensor.name}': {len(tensor.raw)} bytes of data, but shape {list(tensor.shape)} "
                f"of {tensor.datatype} needs {element_count(tensor.shape) * size}"
            )
    missing = sorted(set(declared) - seen)
    if missing:
        raise InvalidArgument(f"model '{spec.name}' is missing input(s) {missing}")
    return rows if rows is not None else 1
