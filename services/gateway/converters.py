"""Open Inference Protocol gRPC messages (tritonclient's ``inference`` protos) <-> domain types."""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from aiworks.core.datatypes import (
    NUMPY_DTYPES,
    Tensor,
    check_raw_input,
    check_shape,
    element_count,
    encode,
    serialize_items,
)
from aiworks.core.errors import InvalidArgument, PayloadTooLarge
from aiworks.core.inference import InferRequest, InferResponse, PendingInputs
from aiworks.core.load_overrides import LoadOverrides, overrides_from_parameters
from aiworks.gateway.filters import MAX_PARAMETERS, InputLimits, class_count
from aiworks.gateway.shared_memory import ShmRef, shm_ref

_DEFAULT_LIMITS = InputLimits()

# Which InferTensorContents field carries each datatype.
_CONTENTS_FIELD = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _param_value(p: pb.InferParameter):
    which = p.WhichOneof("parameter_choice")
    return getattr(p, which) if which else None


def to_parameters(params) -> dict:
    return {k: _param_value(v) for k, v in params.items()}


def from_parameters(params: dict) -> dict[str, pb.InferParameter]:
    out = {}
    for k, v in params.items():
        if isinstance(v, bool):
            out[k] = pb.InferParameter(bool_param=v)
        elif isinstance(v, int):
            out[k] = pb.InferParameter(int64_param=v)
        elif isinstance(v, float):
            out[k] = pb.InferParameter(double_param=v)
        else:
            out[k] = pb.InferParameter(string_param=str(v))
    return out


def to_infer_request_header(
    msg: pb.ModelInferRequest, limits: InputLimits = _DEFAULT_LIMITS, shm=None
) -> tuple[InferRequest, PendingInputs]:
    """The request with its inputs' names, datatypes and shapes, and the decoder of their data.

    ``shm(ref, where)`` gives the bytes an input's shared memory parameters
    name (a slice of the caller's region); without it such an input is
    refused. ``raw_input_contents`` then holds the other inputs' data only,
    in order, as tritonclient sends it.

    Nothing here is proportional to the tensor data: protobuf counts
    repeated fields without building their elements, so typed ``contents``
    are counted against ``max_listed_values`` before any is read.
    """
    limits.check_tensor_count(len(msg.inputs), len(msg.outputs))
    if len(msg.parameters) > MAX_PARAMETERS:
        raise PayloadTooLarge(f"the request has {len(msg.parameters)} parameters; at most {MAX_PARAMETERS} are allowed")
    raw_contents = msg.raw_input_contents
    refs = [shm_ref(to_parameters(t.parameters), f"input '{t.name[:64]}'") if t.parameters else None
            for t in msg.inputs]  # fmt: skip
    in_body = len(refs) - sum(r is not None for r in refs)
    if raw_contents and len(raw_contents) != in_body:
        raise InvalidArgument(
            f"raw_input_contents has {len(raw_contents)} entries, but the request has {in_body} inputs "
            "outside shared memory"
        )
    tensors = []
    decoders = []
    listed = slow = 0
    next_raw = 0
    for t, ref in zip(msg.inputs, refs):
        if t.datatype not in NUMPY_DTYPES:
            raise InvalidArgument(f"input '{t.name}': unknown datatype {t.datatype[:40]!r}")
        shape = tuple(t.shape)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"input '{t.name}' has a negative dim in shape {list(shape)[:8]}")
        check_shape(shape, t.name)
        if ref is not None:
            if shm is None:
                raise InvalidArgument(f"input '{t.name}': shared memory is not available here")
            if t.HasField("contents"):
                raise InvalidArgument(f"input '{t.name}': shared memory input with contents in the message")
            decoders.append(_raw(shm(ref, f"input '{t.name}'"), t.datatype, shape, t.name))
            if t.datatype == "BYTES":
                slow += element_count(shape)
        elif raw_contents:
            decoders.append(_raw(raw_contents[next_raw], t.datatype, shape, t.name))
            next_raw += 1
            if t.datatype == "BYTES":
                slow += element_count(shape)
        else:
            field = _CONTENTS_FIELD.get(t.datatype)
            if field is None:
                raise InvalidArgument(f"input '{t.name}': {t.datatype} must be sent in raw_input_contents")
            values = getattr(t.contents, field)
            listed += len(values)
            decoders.append(_contents(values, t.datatype, shape, t.name))
        tensors.append(Tensor(t.name, t.datatype, shape))
    limits.check_listed(listed, "the request's typed contents")
    request = InferRequest(
        model=msg.model_name,
        version=msg.model_version,
        inputs=tensors,
        outputs=[o.name for o in msg.outputs],
        id=msg.id,
        parameters=to_parameters(msg.parameters),
        classification={
            o.name: class_count(_param_value(o.parameters["classification"]), o.name)
            for o in msg.outputs
            if "classification" in o.parameters
        },
    )

    def decode() -> None:
        for tensor, fill in zip(tensors, decoders):
            tensor.raw = fill()

    return request, PendingInputs(decode, slow + listed)


def _raw(raw: bytes, datatype: str, shape: tuple[int, ...], name: str):
    def check() -> bytes:
        check_raw_input(raw, datatype, shape, name)
        return raw

    return check


def _contents(values, datatype: str, shape: tuple[int, ...], name: str):
    def convert() -> bytes:
        count = element_count(shape)
        if len(values) != count:
            raise InvalidArgument(f"input '{name}' has {len(values)} elements in contents, but the shape needs {count}")
        if datatype == "BYTES":
            return serialize_items(values)
        try:
            return encode(np.asarray(values, dtype=NUMPY_DTYPES[datatype]), datatype)
        except (TypeError, ValueError, OverflowError):
            raise InvalidArgument(f"input '{name}': contents do not hold {datatype} values") from None

    return convert


def to_infer_request(msg: pb.ModelInferRequest, limits: InputLimits = _DEFAULT_LIMITS) -> InferRequest:
    """The whole request, decoded (header, caps, then data)."""
    request, pending = to_infer_request_header(msg, limits)
    limits.check_shapes(request)
    pending.decode()
    return request


def output_refs(msg: pb.ModelInferRequest) -> dict[str, ShmRef]:
    """The requested outputs the client placed in shared memory."""
    refs = {}
    for o in msg.outputs:
        if o.parameters:
            ref = shm_ref(to_parameters(o.parameters), f"output '{o.name[:64]}'")
            if ref is not None:
                refs[o.name] = ref
    return refs


def _output(t, shm: dict[str, ShmRef]) -> pb.ModelInferResponse.InferOutputTensor:
    out = pb.ModelInferResponse.InferOutputTensor(name=t.name, datatype=t.datatype, shape=t.shape)
    ref = shm.get(t.name)
    if ref is not None:
        out.parameters["shared_memory_region"].string_param = ref.region
        out.parameters["shared_memory_byte_size"].int64_param = len(t.raw)
    return out


def from_infer_response(resp: InferResponse, shm: dict[str, ShmRef] | None = None) -> pb.ModelInferResponse:
    """The response message; outputs in ``shm`` (written there already) have an empty raw entry, as Triton."""
    shm = shm or {}
    msg = pb.ModelInferResponse(
        model_name=resp.model,
        model_version=resp.version,
        id=resp.id,
        outputs=[_output(t, shm) for t in resp.outputs],
        raw_output_contents=[
            b"" if t.name in shm else t.raw if isinstance(t.raw, bytes) else bytes(t.raw) for t in resp.outputs
        ],
    )
    if resp.parameters:
        for k, v in from_parameters(resp.parameters).items():
            msg.parameters[k].CopyFrom(v)
    return msg


def to_load_overrides(parameters) -> LoadOverrides:
    """A RepositoryModelLoad request's ``parameters`` (ModelRepositoryParameter) as its overrides."""
    values = {}
    for key, parameter in parameters.items():
        which = parameter.WhichOneof("parameter_choice")
        values[key] = getattr(parameter, which) if which else None
    return overrides_from_parameters(values, base64_files=False)
