"""Protobuf <-> domain types for the cache's API; pb2 objects stop here.

The value the gateway stores is a serialized ``CachedResponse``: the model,
the version that computed it, and the output tensors as raw bytes.
"""

from __future__ import annotations

from aiworks.core.converters import from_tensor, to_tensor
from aiworks.core.inference import InferResponse
from aiworks.pb.cache.v1 import cache_pb2 as pb


def encode_response(response: InferResponse) -> bytes:
    """The bytes stored for a successful response (its id and parameters are per request: left out)."""
    return pb.CachedResponse(
        model=response.model, version=response.version, outputs=[from_tensor(t) for t in response.outputs]
    ).SerializeToString()


def decode_response(value: bytes, request_id: str = "") -> InferResponse:
    """A stored response, answering the request ``request_id``."""
    msg = pb.CachedResponse.FromString(value)
    return InferResponse(msg.model, msg.version, [to_tensor(t) for t in msg.outputs], id=request_id)
