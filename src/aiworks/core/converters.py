"""Protobuf <-> domain types for the suite's own protos (runtime.v1, and the specs scheduler.v1 reuses).

pb2 objects stop here: ``to_*`` functions build domain objects from messages,
``from_*`` functions build messages from domain objects. Tensor bytes are
passed by reference both ways.
"""

from __future__ import annotations

from aiworks.core.datatypes import Tensor
from aiworks.core.inference import InferRequest, ModelStatistics
from aiworks.core.model_config import BatchingConfig, ModelSpec, ModelState, TensorSpec
from aiworks.core.options import GATEWAY_PARAMETERS, Priority, RequestOptions, SequenceRef
from aiworks.core.sequence_config import SequenceConfig
from aiworks.pb.runtime.v1 import runtime_pb2 as rpb

_STATE_TO_PB = {
    ModelState.READY: rpb.MODEL_STATE_READY,
    ModelState.UNAVAILABLE: rpb.MODEL_STATE_UNAVAILABLE,
    ModelState.LOADING: rpb.MODEL_STATE_LOADING,
}
_STATE_FROM_PB = {v: k for k, v in _STATE_TO_PB.items()}


def to_tensor(msg: rpb.Tensor) -> Tensor:
    return Tensor(msg.name, msg.datatype, tuple(msg.shape), msg.raw)


def from_tensor(t: Tensor) -> rpb.Tensor:
    raw = t.raw if isinstance(t.raw, bytes) else bytes(t.raw)
    return rpb.Tensor(name=t.name, datatype=t.datatype, shape=t.shape, raw=raw)


def add_tensors(field, tensors) -> None:
    """Append ``tensors`` to the repeated Tensor ``field`` in place.

    Prefer this to ``Message(field=[from_tensor(t), ...])``: protobuf (upb)
    copies each message of such a list again, by serializing and parsing it,
    which for a 4 MiB tensor costs several times the copy of its bytes.
    """
    for t in tensors:
        raw = t.raw if isinstance(t.raw, bytes) else bytes(t.raw)
        field.add(name=t.name, datatype=t.datatype, shape=t.shape, raw=raw)


def _to_specs(msgs) -> tuple[TensorSpec, ...]:
    return tuple(
        TensorSpec(
            m.name, m.datatype, tuple(m.dims), tuple(m.reshape) if m.has_reshape else None, m.format, m.label_filename
        )
        for m in msgs
    )


def _from_specs(specs) -> list[rpb.TensorSpec]:
    return [
        rpb.TensorSpec(
            name=s.name,
            datatype=s.datatype,
            dims=s.dims,
            reshape=s.reshape or (),
            has_reshape=s.reshape is not None,
            format=s.format,
            label_filename=s.label_filename,
        )
        for s in specs
    ]


def to_model_spec(msg: rpb.ModelSpec) -> ModelSpec:
    b = msg.batching
    return ModelSpec(
        name=msg.name,
        version=msg.version,
        platform=msg.platform,
        max_batch_size=msg.max_batch_size,
        inputs=_to_specs(msg.inputs),
        outputs=_to_specs(msg.outputs),
        batching=BatchingConfig(b.enabled, b.max_queue_delay_us, tuple(b.preferred_batch_sizes)),
        instance_count=msg.instance_count or 1,
        parameters=dict(msg.parameters),
        state=_STATE_FROM_PB.get(msg.state, ModelState.UNAVAILABLE),
        reason=msg.reason,
        decoupled=msg.decoupled,
        sequence=SequenceConfig(msg.sequence.strategy, msg.sequence.max_idle_us) if msg.HasField("sequence") else None,
    )


def from_model_spec(spec: ModelSpec) -> rpb.ModelSpec:
    b = spec.batching
    return rpb.ModelSpec(
        name=spec.name,
        version=spec.version,
        platform=spec.platform,
        max_batch_size=spec.max_batch_size,
        inputs=_from_specs(spec.inputs),
        outputs=_from_specs(spec.outputs),
        batching=rpb.BatchingSpec(
            enabled=b.enabled, max_queue_delay_us=b.max_queue_delay_us, preferred_batch_sizes=b.preferred_batch_sizes
        ),
        instance_count=spec.instance_count,
        parameters=spec.parameters,
        state=_STATE_TO_PB[spec.state],
        reason=spec.reason,
        decoupled=spec.decoupled,
        sequence=rpb.SequenceSpec(strategy=spec.sequence.strategy, max_idle_us=spec.sequence.max_idle_us)
        if spec.sequence is not None
        else None,
    )


def to_statistics(msg: rpb.ModelStatistics) -> ModelStatistics:
    return ModelStatistics(**{f: getattr(msg, f) for f in _STAT_FIELDS})


def from_statistics(stats: ModelStatistics) -> rpb.ModelStatistics:
    return rpb.ModelStatistics(**{f: getattr(stats, f) for f in _STAT_FIELDS})


_STAT_FIELDS = [f for f in ModelStatistics.__slots__]


def to_options(msg: rpb.RequestOptions, now_s: float) -> RequestOptions:
    """Options as they arrived; the deadline on this process's clock (``now_s`` is its monotonic now)."""
    deadline = now_s + msg.timeout_us / 1e6 if msg.timeout_us else None
    sequence = None
    if msg.HasField("sequence"):
        s = msg.sequence
        sequence = SequenceRef(s.text if s.WhichOneof("id") == "text" else s.number, s.start, s.end)
    return RequestOptions(Priority.from_level(msg.priority), deadline, msg.tenant, msg.request_id, sequence=sequence)


def from_options(options: RequestOptions, now_s: float | None = None) -> rpb.RequestOptions:
    msg = rpb.RequestOptions(
        priority=options.priority.level,
        timeout_us=options.timeout_us(now_s),
        tenant=options.tenant,
        request_id=options.request_id,
    )
    sequence = options.sequence
    if sequence is not None:
        if isinstance(sequence.id, str):
            msg.sequence.text = sequence.id
        else:
            msg.sequence.number = sequence.id
        msg.sequence.start, msg.sequence.end = sequence.start, sequence.end
    return msg


def to_parameters(params) -> dict:
    """A protobuf ``map<string, Parameter>`` as plain Python values."""
    return {name: getattr(p, p.WhichOneof("value")) for name, p in params.items() if p.WhichOneof("value")}


def fill_parameters(target, params: dict, skip: frozenset = frozenset()) -> None:
    """Copy scalar ``params`` (bool, int, float, str) into a protobuf ``map<string, Parameter>``.

    Anything else (a client's nested JSON) has no place in the OIP's
    parameter types and is left out, as are the names in ``skip``.
    """
    for name, value in params.items():
        if name in skip:
            continue
        p = target[name]
        if isinstance(value, bool):
            p.bool_param = value
        elif isinstance(value, int):
            if -(2**63) <= value < 2**63:
                p.int64_param = value
            elif 0 <= value < 2**64:
                p.uint64_param = value
            else:
                del target[name]
        elif isinstance(value, float):
            p.double_param = value
        elif isinstance(value, str):
            p.string_param = value
        else:
            del target[name]


def to_infer_request(msg: rpb.InferRequest) -> InferRequest:
    return InferRequest(
        model=msg.model,
        version=msg.version,
        inputs=[to_tensor(t) for t in msg.inputs],
        outputs=list(msg.outputs),
        id=msg.id,
        parameters=to_parameters(msg.parameters) if msg.parameters else {},
        tenant=msg.options.tenant,
        classification=dict(msg.classification),
    )


def from_infer_request(req: InferRequest, options: RequestOptions) -> rpb.InferRequest:
    """The message a gateway sends; the deadline becomes the time left now."""
    msg = rpb.InferRequest(
        id=req.id,
        model=req.model,
        version=req.version,
        outputs=req.outputs,
        options=from_options(options),
        classification=req.classification,
    )
    add_tensors(msg.inputs, req.inputs)
    if req.parameters:
        fill_parameters(msg.parameters, req.parameters, GATEWAY_PARAMETERS)
    return msg
