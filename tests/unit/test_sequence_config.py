"""Triton's sequence_batching parsed, the sequence parameters read, and the repeat backend's own rules."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from aiworks.core.datatypes import Tensor
from aiworks.core.errors import InvalidArgument
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import parse_config
from aiworks.core.options import RequestOptions, SequenceRef, parse_sequence
from aiworks.demo.qa_streaming import REPEAT_INT32_CONFIG, SIMPLE_DYNA_SEQUENCE_CONFIG, accumulator_config
from aiworks.runtime.repeat_backend import RepeatModel


def test_sequence_batching_is_read_as_triton_defines_it():
    c = parse_config(SIMPLE_DYNA_SEQUENCE_CONFIG, fmt="pbtxt", model_name="simple_dyna_sequence")
    seq = c.sequence
    assert seq.strategy == "oldest" and seq.max_idle_us == 10_000_000 and seq.max_candidate_sequences == 64
    assert seq.max_queue_delay_us == 1000
    assert [(x.name, x.kind, x.datatype, x.values) for x in seq.controls] == [
        ("START", "START", "INT32", (0, 1)), ("END", "END", "INT32", (0, 1)), ("READY", "READY", "INT32", (0, 1)),
        ("CORRID", "CORRID", "UINT64", ()),
    ]  # fmt: skip
    assert [t.name for t in c.inputs] == ["INPUT"]  # clients never send the controls
    acc = parse_config(accumulator_config(), fmt="pbtxt", model_name="accumulator").sequence
    [state] = acc.states
    assert (state.input_name, state.output_name, state.datatype, state.dims, state.initial_dims) == (
        "ACC", "ACC_OUT", "INT32", (1,), (1,)
    )
    assert acc.hidden_inputs == {"START", "ACC"}


def test_defaults_are_tritons():
    c = parse_config("max_batch_size: 4\nsequence_batching { }", fmt="pbtxt", model_name="m")
    assert c.sequence.strategy == "direct" and c.sequence.max_idle_us == 1_000_000
    oldest = parse_config("max_batch_size: 4\nsequence_batching { oldest { } }", fmt="pbtxt", model_name="m")
    assert oldest.sequence.max_candidate_sequences == 4
    assert parse_config("max_batch_size: 4", fmt="pbtxt", model_name="m").sequence is None


@pytest.mark.parametrize(
    "block, words",
    [
        ('control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START } ] } ]', "exactly one of"),
        ('control_input [ { name: "S" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 1 ] } ] } ]',
         "two values"),
        ('control_input [ { name: "C" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_FP32 } ] } ]',
         "CORRID control 'C' must be"),
        ('state [ { input_name: "A" data_type: TYPE_INT32 dims: [ 1 ] } ]', "input_name and output_name"),
        ("iterative_sequence: true", "iterative_sequence"),
    ],
)  # fmt: skip
def test_bad_sequence_configs_are_refused_by_name(block, words):
    with pytest.raises(InvalidArgument, match=words):
        parse_config(f"max_batch_size: 4\nsequence_batching {{ {block} }}", fmt="pbtxt", model_name="m")


def test_sequence_parameters_are_read_once_as_triton_reads_them():
    assert parse_sequence({}) is None and parse_sequence({"sequence_id": 0}) is None
    assert parse_sequence({"sequence_id": ""}) is None
    assert parse_sequence({"sequence_id": 5, "sequence_start": True}) == SequenceRef(5, True, False)
    assert parse_sequence({"sequence_id": -1}).id == 2**64 - 1  # an int64 holds a uint64's bits
    assert parse_sequence({"sequence_id": "twin", "sequence_end": True}) == SequenceRef("twin", False, True)
    with pytest.raises(InvalidArgument, match="expected int64_param or string_param"):
        parse_sequence({"sequence_id": [1]})
    with pytest.raises(InvalidArgument, match="'sequence_start' parameter, expected bool_param"):
        parse_sequence({"sequence_id": 1, "sequence_start": 1})
    with pytest.raises(InvalidArgument, match="uint64"):
        parse_sequence({"sequence_id": 2**64})
    with pytest.raises(InvalidArgument, match="at most 256"):
        parse_sequence({"sequence_id": "x" * 300})


def repeat_request(values, delays, wait_ms):
    return InferRequest("repeat_int32", "1", [
        Tensor.from_numpy("IN", np.array(values, dtype=np.int32)),
        Tensor.from_numpy("DELAY", np.array(delays, dtype=np.uint32)),
        Tensor.from_numpy("WAIT", np.array([wait_ms], dtype=np.uint32)),
    ])  # fmt: skip


def test_repeat_answers_each_element_after_its_delay_and_holds_its_instance_for_wait():
    config = parse_config(REPEAT_INT32_CONFIG, fmt="pbtxt", model_name="repeat_int32")
    model = RepeatModel(None, config, 1)

    async def collect(request):
        out = []
        async for answer in model.stream(request, RequestOptions()):
            out.append((time.monotonic(), *(int(np.frombuffer(t.raw, t.datatype == "INT32" and "<i4" or "<u4")[0])
                                            for t in answer.outputs)))  # fmt: skip
        return out

    async def main():
        started = time.monotonic()
        first, second = await asyncio.gather(
            collect(repeat_request([5, 6], [0, 30], 100)), collect(repeat_request([7], [0], 0))
        )
        assert [a[1:] for a in first] == [(5, 0), (6, 1)] and first[1][0] - started >= 0.03
        assert second[0][1:] == (7, 0) and second[0][0] - started >= 0.09  # one instance, held for WAIT
        with pytest.raises(InvalidArgument, match=r"expected IN and DELAY shape to match, got \[2\] and \[1\]"):
            await collect(repeat_request([1, 2], [0], 0))

    asyncio.run(main())
    with pytest.raises(InvalidArgument, match="decoupled"):
        RepeatModel(None, parse_config(REPEAT_INT32_CONFIG.replace("model_transaction_policy { decoupled: true }\n",
                                                                   ""), fmt="pbtxt", model_name="repeat_int32"), 1)
