"""Open Inference Protocol gRPC messages (tritonclient's ``inference`` protos) <-> domain types."""

from __future__ import annotations

import numpy as np
from tritonclient.grpc import service_pb2 as pb

from aiworks.core.datatypes import NUMPY_DTYPES, Tensor, element_count, encode
from aiworks.core.errors import InvalidArgument
from aiworks.core.inference import InferRequest, InferResponse

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


def to_infer_request(msg: pb.ModelInferRequest) -> InferRequest:
    raw_contents = msg.raw_input_contents
    if raw_contents and len(raw_contents) != len(msg.inputs):
        raise InvalidArgument(
            f"raw_input_contents has {len(raw_contents)} entries, but the request has {len(msg.inputs)} inputs"
        )
    tensors = []
    for i, t in enumerate(msg.inputs):
        shape = tuple(t.shape)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"input '{t.name}' has a negative dim in shape {list(shape)}")
        if t.datatype not in NUMPY_DTYPES:
            raise InvalidArgument(f"input '{t.name}': unknown datatype {t.datatype!r}")
        if raw_contents:
            raw = raw_contents[i]
        else:
            field = _CONTENTS_FIELD.get(t.datatype)
            if field is None:
                raise InvalidArgument(f"input '{t.name}': {t.datatype} must be sent in raw_input_contents")
            values = getattr(t.contents, field)
            count = element_count(shape)
            if len(values) != count:
                raise InvalidArgument(
                    f"input '{t.name}' has {len(values)} elements in contents, but the shape needs {count}"
                )
            if t.datatype == "BYTES":
                raw = encode(np.array(list(values), dtype=np.object_), "BYTES")
            else:
                raw = encode(np.asarray(values), t.datatype)
        tensors.append(Tensor(t.name, t.datatype, shape, raw))
    return InferRequest(
        model=msg.model_name,
        version=msg.model_version,
        inputs=tensors,
        outputs=[o.name for o in msg.outputs],
        id=msg.id,
        parameters=to_parameters(msg.parameters),
    )


def from_infer_response(resp: InferResponse) -> pb.ModelInferResponse:
    msg = pb.ModelInferResponse(
        model_name=resp.model,
        model_version=resp.version,
        id=resp.id,
        outputs=[pb.ModelInferResponse.InferOutputTensor(name=t.name, datatype=t.datatype, shape=t.shape) for t in resp.outputs],
        raw_output_contents=[t.raw if isinstance(t.raw, bytes) else bytes(t.raw) for t in resp.outputs],
    )
    if resp.parameters:
        for k, v in from_parameters(resp.parameters).items():
            msg.parameters[k].CopyFrom(v)
    return msg
