"""Triton's ``sequence_batching`` block: stateful models, as the runtime's sequence batcher needs it.

A model whose config has ``sequence_batching`` keeps state across the
requests of one *sequence* (Triton's docs/user_guide/architecture.md,
"Stateful Models"). Clients tag each request with a correlation id
(``sequence_id``, a uint64 or a string) and mark its first and last request
(``sequence_start``, ``sequence_end``). What the config says:

- ``direct { }`` (the default) or ``oldest { max_candidate_sequences,
  preferred_batch_size, max_queue_delay_microseconds }``: how sequences share
  the model's instances (see services/model-runtime/sequence_batcher.py);
- ``max_sequence_idle_microseconds`` (default 1 s, as Triton's): a sequence
  with no request for that long is released;
- ``control_input``: model inputs the batcher fills, never the client:
  ``CONTROL_SEQUENCE_START``/``END``/``READY`` with ``int32_false_true``,
  ``fp32_false_true`` or ``bool_false_true``, and ``CONTROL_SEQUENCE_CORRID``
  with the ``data_type`` the correlation id is given in;
- ``state``: implicit state, an output of the model fed back as an input of
  the sequence's next request (``input_name``, ``output_name``,
  ``data_type``, ``dims``, ``initial_state`` with ``zero_data`` or a
  ``data_file`` under the model's ``initial_state/`` folder).

Only plain dataclasses leave this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2

from aiworks.core.datatypes import DATATYPES
from aiworks.core.errors import InvalidArgument

# Triton's default max_sequence_idle_microseconds.
DEFAULT_IDLE_US = 1_000_000
FLAG_KINDS = ("START", "END", "READY")
CORRID_TYPES = ("INT32", "UINT32", "INT64", "UINT64", "BYTES")
_Control = model_config_pb2.ModelSequenceBatching.Control


@dataclass(frozen=True, slots=True)
class SequenceControl:
    """One control input: ``kind`` START, END, READY or CORRID; ``values`` the false and true value of a flag."""

    name: str
    kind: str
    datatype: str
    values: tuple = ()


@dataclass(frozen=True, slots=True)
class SequenceState:
    """One implicit state tensor; ``initial_dims`` and ``initial_file`` from its ``initial_state`` (zeros else)."""

    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]
    initial_dims: tuple[int, ...] | None = None
    initial_file: str = ""


@dataclass(frozen=True, slots=True)
class SequenceConfig:
    """A model's ``sequence_batching``; the gateway gets only ``strategy`` and ``max_idle_us`` (runtime.proto)."""

    strategy: str = "direct"
    max_idle_us: int = DEFAULT_IDLE_US
    controls: tuple[SequenceControl, ...] = ()
    states: tuple[SequenceState, ...] = ()
    # oldest: sequences each instance batches from; 0 means max_batch_size (at least 1), as in Triton.
    max_candidate_sequences: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_delay_us: int = 0

    @property
    def hidden_inputs(self) -> frozenset[str]:
        """Model inputs the batcher fills (controls and state), which clients neither send nor see."""
        return frozenset(c.name for c in self.controls) | frozenset(s.input_name for s in self.states)

    def control(self, kind: str) -> SequenceControl | None:
        return next((c for c in self.controls if c.kind == kind), None)


def _datatype(value: int, where: str) -> str:
    name = model_config_pb2.DataType.Name(value)
    datatype = "BYTES" if name == "TYPE_STRING" else name.removeprefix("TYPE_")
    if datatype not in DATATYPES:
        raise InvalidArgument(f"{where}: data_type {name} is not supported")
    return datatype


def _control(entry, where: str) -> SequenceControl:
    if len(entry.control) != 1:
        raise InvalidArgument(f"{where}: control input '{entry.name}' must have exactly one control")
    control = entry.control[0]
    kind = _Control.Kind.Name(control.kind).removeprefix("CONTROL_SEQUENCE_")
    if kind == "CORRID":
        datatype = _datatype(control.data_type, f"{where}: CORRID control '{entry.name}'")
        if datatype not in CORRID_TYPES:
            raise InvalidArgument(
                f"{where}: CORRID control '{entry.name}' must be TYPE_UINT64, TYPE_INT64, TYPE_UINT32, TYPE_INT32 "
                "or TYPE_STRING"
            )
        return SequenceControl(entry.name, kind, datatype)
    given = [
        (datatype, tuple(values))
        for datatype, values in (
            ("INT32", control.int32_false_true), ("FP32", control.fp32_false_true), ("BOOL", control.bool_false_true)
        )
        if values
    ]  # fmt: skip
    if len(given) != 1 or len(given[0][1]) != 2:
        raise InvalidArgument(
            f"{where}: {kind} control '{entry.name}' must give exactly one of int32_false_true, fp32_false_true "
            "or bool_false_true, with two values"
        )
    datatype, values = given[0]
    return SequenceControl(entry.name, kind, datatype, values)


def parse_sequence_batching(msg, model_name: str, max_batch_size: int) -> SequenceConfig | None:
    """The ``sequence_batching`` of a parsed ``ModelConfig`` message, or None when it has none."""
    if not msg.HasField("sequence_batching"):
        return None
    where = f"model '{model_name}' config: sequence_batching"
    sb = msg.sequence_batching
    if sb.iterative_sequence:
        raise InvalidArgument(f"{where}: iterative_sequence is not supported")
    if msg.model_transaction_policy.decoupled:
        raise InvalidArgument(f"{where}: a decoupled model cannot also be a sequence model here")
    controls = tuple(_control(entry, where) for entry in sb.control_input)
    kinds = [c.kind for c in controls]
    if len(set(kinds)) != len(kinds):
        raise InvalidArgument(f"{where}: each control kind may appear once; got {kinds}")
    states = []
    for s in sb.state:
        if not s.input_name or not s.output_name:
            raise InvalidArgument(f"{where}: a state needs input_name and output_name")
        dims = tuple(int(d) for d in s.dims)
        if any(d < -1 or d == 0 for d in dims):
            raise InvalidArgument(f"{where}: state '{s.input_name}' has an invalid dim in {list(dims)}")
        initial_dims, initial_file = None, ""
        if len(s.initial_state) > 1:
            raise InvalidArgument(f"{where}: state '{s.input_name}' may have one initial_state")
        if s.initial_state:
            init = s.initial_state[0]
            initial_dims = tuple(int(d) for d in init.dims)
            if any(d < 1 for d in initial_dims):
                raise InvalidArgument(f"{where}: initial_state of '{s.input_name}' needs fixed dims")
            if init.WhichOneof("state_data") == "data_file":
                initial_file = init.data_file
                if "/" in initial_file or "\\" in initial_file or initial_file.startswith("."):
                    raise InvalidArgument(f"{where}: initial_state data_file must be a file name in initial_state/")
        datatype = _datatype(s.data_type, f"{where}: state '{s.input_name}'")
        states.append(SequenceState(s.input_name, s.output_name, datatype, dims, initial_dims, initial_file))
    strategy = "oldest" if sb.WhichOneof("strategy_choice") == "oldest" else "direct"
    if strategy == "oldest":
        oldest = sb.oldest
        candidates = int(oldest.max_candidate_sequences) or max(1, max_batch_size)
        preferred = tuple(sorted(int(p) for p in oldest.preferred_batch_size))
        delay_us = int(oldest.max_queue_delay_microseconds)
    else:
        candidates, preferred, delay_us = 0, (), int(sb.direct.max_queue_delay_microseconds)
    return SequenceConfig(
        strategy=strategy,
        max_idle_us=int(sb.max_sequence_idle_microseconds) or DEFAULT_IDLE_US,
        controls=controls,
        states=tuple(states),
        max_candidate_sequences=candidates,
        preferred_batch_sizes=preferred,
        max_queue_delay_us=delay_us,
    )
