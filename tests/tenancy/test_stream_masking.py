"""A masked model's streamed text (a generation's pieces) is masked across pieces, through the gateway's data plane.

The gateway's real ``GatewayDataPlane.infer_stream`` (demo-mode tenancy, real
masking policies) over a stand-in for the scheduler's routing that streams
fixed text pieces, as the ``llm`` backend streams tokens: the model's side is
the only thing not real, since no small model can be made to write an e-mail
address on demand.
"""

from __future__ import annotations

import asyncio

from aiworks.core.datatypes import Tensor, deserialize_bytes, serialize_items
from aiworks.core.inference import Answer, InferRequest
from aiworks.core.model_config import ModelSpec, TensorSpec
from aiworks.core.options import Priority
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.masking import HOLD_KEEP_BYTES, HOLD_MAX_BYTES, MaskingPolicies, StreamHold


def text_spec(mask: bool) -> ModelSpec:
    return ModelSpec(
        name="writer", version="1", max_batch_size=0, decoupled=True,
        inputs=(TensorSpec("text_input", "BYTES", (1,)),), outputs=(TensorSpec("text_output", "BYTES", (1,)),),
        parameters={"mask_patterns": "email,phone"} if mask else {},
    )  # fmt: skip


class PieceRouting:
    """The routing's face that the data plane calls, streaming ``pieces`` as one piece of text per answer."""

    default_priority = Priority.STANDARD

    def __init__(self, spec: ModelSpec, pieces: list[bytes]):
        self.spec, self.pieces = spec, pieces

    def resolve(self, model: str, version: str) -> ModelSpec:
        return self.spec

    async def infer_stream(self, request, options, *, spec=None, work=None):
        for i, piece in enumerate(self.pieces):
            params = {"prompt_tokens": 3} if i == 0 else {}
            if i == len(self.pieces) - 1:
                params.update(completion_tokens=len(self.pieces), finish_reason="length")
            yield Answer([Tensor("text_output", "BYTES", (1,), serialize_items([piece]))], parameters=params,
                         final=False)  # fmt: skip
        yield Answer([], final=True)  # the stream's bare end flag


def stream(spec: ModelSpec, pieces: list[bytes]) -> list:
    async def main():
        dataplane = GatewayDataPlane(scheduler=None, routing=PieceRouting(spec, pieces))
        request = InferRequest("writer", "", [Tensor("text_input", "BYTES", (1,), serialize_items([b"x"]))])
        return [r async for r in dataplane.infer_stream(request)]

    return asyncio.run(main())


def texts(responses) -> list[bytes]:
    return [bytes(deserialize_bytes(r.outputs[0].raw, 1)[0]) if r.outputs else None for r in responses]


PIECES = [b"Write to ", b"jane.d", b"oe@exa", b"mple.com or call", b" +1 415 555", b" 2671\nthen ", b"wait"]


def test_a_match_split_across_pieces_is_masked():
    whole = b"".join(PIECES)
    masked = MaskingPolicies().mask(text_spec(True), _one(whole))
    expected = bytes(deserialize_bytes(masked.outputs[0].raw, 1)[0])
    assert b"jane.doe@example.com" not in expected and b"415 555 2671" not in expected
    out = stream(text_spec(True), PIECES)
    got = texts(out)
    assert b"".join(t for t in got if t) == expected  # the same text as masking it whole
    assert all(b"@" not in t and b"2671" not in t for t in got if t)
    assert len(out) == len(PIECES) + 1 and out[-1].final and not out[-1].outputs  # as many responses, then the flag
    assert out[0].parameters["prompt_tokens"] == 3 and out[len(PIECES) - 1].parameters["finish_reason"] == "length"
    assert got[:5] == [b"", b"", b"", b"", b""] and got[5].endswith(b"\n")  # held until the line ended


def test_an_unmasked_model_streams_each_piece_as_it_comes():
    assert texts(stream(text_spec(False), PIECES))[:-1] == PIECES


def test_a_line_longer_than_the_hold_is_let_go_but_for_its_end():
    hold = StreamHold(MaskingPolicies().for_spec(text_spec(True)))
    long_line = "é".encode() * (HOLD_MAX_BYTES // 2 + 10)
    assert hold.push(_one(long_line)) is None
    first = hold.push(_one(b"x"))
    released = bytes(deserialize_bytes(first.outputs[0].raw, 1)[0])
    assert len(long_line) - HOLD_KEEP_BYTES - 1 <= len(released) <= len(long_line) - HOLD_KEEP_BYTES
    released.decode("utf-8")  # not cut inside a character
    last = hold.end()
    assert released + bytes(deserialize_bytes(last.outputs[0].raw, 1)[0]) == long_line + b"x"


def _one(text: bytes):
    from aiworks.core.inference import InferResponse

    return InferResponse("writer", "1", [Tensor("text_output", "BYTES", (1,), serialize_items([text]))])
