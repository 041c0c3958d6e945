"""Models for streaming and stateful serving, built like Triton's QA and example models (no download).

- ``repeat_int32``: Triton's decoupled QA model on the built-in ``repeat``
  backend (services/model-runtime/repeat_backend.py): one response per
  element of ``IN``, each after its ``DELAY`` in milliseconds.
- ``simple_sequence``: the stateful example of Triton's
  docs/examples/model_repository: ONNX, ``max_batch_size: 8``, the direct
  strategy, ``START`` and ``READY`` controls; it computes
  ``OUTPUT = READY ? INPUT + START : 0`` (Triton's batching sequence QA
  models do exactly this; its client examples expect it).
- ``simple_dyna_sequence``: the oldest strategy with ``START``, ``END``,
  ``READY`` and a UINT64 ``CORRID``: ``READY ? INPUT + START + END * CORRID : 0``.
- ``simple_string_dyna_sequence``: string correlation ids (a ``TYPE_STRING``
  ``CORRID``, which must read as an integer), a running sum kept as implicit
  state, the correlation id added at the end:
  ``ACC = (START ? 0 : ACC) + INPUT + END * int(CORRID)``; ``OUTPUT = ACC``.
- ``accumulator``: a real running sum kept as implicit state:
  ``OUTPUT = ACC = (START ? 0 : ACC) + INPUT``, the state ``ACC`` starting at
  zero (``initial_state { zero_data: true }``). One sequence = one running
  total (a digital twin's counter, say).
- ``accumulator_stateless``: the same ONNX file served with no
  ``sequence_batching``: ``START`` and ``ACC`` are plain inputs the client
  sends (bench/stateful_sequences.py compares the two).

:func:`build_qa_streaming_models` writes them in Triton's layout.
"""

from __future__ import annotations

from pathlib import Path

REPEAT_INT32_CONFIG = """\
name: "repeat_int32"
backend: "repeat"
max_batch_size: 0
model_transaction_policy { decoupled: true }
input [
  { name: "IN" data_type: TYPE_INT32 dims: [ -1 ] },
  { name: "DELAY" data_type: TYPE_UINT32 dims: [ -1 ] },
  { name: "WAIT" data_type: TYPE_UINT32 dims: [ 1 ] }
]
output [
  { name: "OUT" data_type: TYPE_INT32 dims: [ 1 ] },
  { name: "IDX" data_type: TYPE_UINT32 dims: [ 1 ] }
]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""

SIMPLE_SEQUENCE_CONFIG = """\
name: "simple_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU } ]
"""

SIMPLE_DYNA_SEQUENCE_CONFIG = """\
name: "simple_dyna_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  max_sequence_idle_microseconds: 10000000
  oldest { max_candidate_sequences: 64 max_queue_delay_microseconds: 1000 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_UINT64 } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 2 kind: KIND_CPU } ]
"""

SIMPLE_STRING_DYNA_SEQUENCE_CONFIG = """\
name: "simple_string_dyna_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
default_model_filename: "string_dyna.onnx"
sequence_batching {
  max_sequence_idle_microseconds: 10000000
  oldest { max_candidate_sequences: 64 max_queue_delay_microseconds: 1000 }
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END int32_false_true: [ 0, 1 ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
  ]
  state [
    {
      input_name: "ACC" output_name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ]
      initial_state { data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zero" }
    }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { count: 1 kind: KIND_CPU } ]
"""


def accumulator_config(name: str = "accumulator", *, max_batch_size: int = 16, candidates: int = 32,
                       idle_us: int = 10_000_000, delay_us: int = 0) -> str:  # fmt: skip
    """The implicit-state accumulator's config (tests build small variants: few slots, short idle times)."""
    return f"""\
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
default_model_filename: "accumulator.onnx"
sequence_batching {{
  max_sequence_idle_microseconds: {idle_us}
  oldest {{ max_candidate_sequences: {candidates} max_queue_delay_microseconds: {delay_us} }}
  control_input [
    {{ name: "START" control [ {{ kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] }} ] }}
  ]
  state [
    {{
      input_name: "ACC" output_name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ]
      initial_state {{ data_type: TYPE_INT32 dims: [ 1 ] zero_data: true name: "zero" }}
    }}
  ]
}}
input [ {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
output [ {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""


def accumulator_stateless_config(name: str = "accumulator_stateless", *, max_batch_size: int = 16,
                                 delay_us: int = 0) -> str:  # fmt: skip
    """The accumulator's ONNX file served as a plain model: the client sends START and ACC itself."""
    return f"""\
name: "{name}"
platform: "onnxruntime_onnx"
max_batch_size: {max_batch_size}
default_model_filename: "accumulator.onnx"
input [
  {{ name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "START" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "ACC" data_type: TYPE_INT32 dims: [ 1 ] }}
]
output [
  {{ name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "ACC_OUT" data_type: TYPE_INT32 dims: [ 1 ] }}
]
dynamic_batching {{ max_queue_delay_microseconds: {delay_us} }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""


def _graph(name: str, inputs: list, outputs: list, nodes: list, initializers=()):
    import onnx
    from onnx import helper

    graph = helper.make_graph(nodes, name, inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8  # onnxruntime reads IR 8 with opset 17
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _int32(name: str):
    from onnx import TensorProto, helper

    return helper.make_tensor_value_info(name, TensorProto.INT32, [None, 1])


def simple_sequence_onnx(dyna: bool = False) -> bytes:
    """``READY ? INPUT + START (+ END * CORRID) : 0`` over a batch of [N, 1] tensors."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    zero = numpy_helper.from_array(np.zeros((1, 1), dtype=np.int32), "zero")
    nodes = [helper.make_node("Add", ["INPUT", "START"], ["sum"])]
    inputs = [_int32("INPUT"), _int32("START"), _int32("READY")]
    if dyna:
        inputs += [_int32("END"), helper.make_tensor_value_info("CORRID", TensorProto.UINT64, [None, 1])]
        nodes += [
            helper.make_node("Cast", ["CORRID"], ["corrid"], to=TensorProto.INT32),
            helper.make_node("Mul", ["END", "corrid"], ["last"]),
            helper.make_node("Add", ["sum", "last"], ["value"]),
        ]
    else:
        nodes.append(helper.make_node("Identity", ["sum"], ["value"]))
    nodes += [
        helper.make_node("Equal", ["READY", "zero"], ["idle"]),
        helper.make_node("Where", ["idle", "zero", "value"], ["OUTPUT"]),
    ]
    return _graph("simple_dyna_sequence" if dyna else "simple_sequence", inputs, [_int32("OUTPUT")], nodes, [zero])


def accumulator_onnx() -> bytes:
    """``ACC_OUT = (START ? 0 : ACC) + INPUT``; ``OUTPUT = ACC_OUT``."""
    import numpy as np
    from onnx import helper, numpy_helper

    zero = numpy_helper.from_array(np.zeros((1, 1), dtype=np.int32), "zero")
    nodes = [
        helper.make_node("Equal", ["START", "zero"], ["going_on"]),
        helper.make_node("Where", ["going_on", "ACC", "zero"], ["carried"]),
        helper.make_node("Add", ["carried", "INPUT"], ["ACC_OUT"]),
        helper.make_node("Identity", ["ACC_OUT"], ["OUTPUT"]),
    ]
    inputs = [_int32("INPUT"), _int32("START"), _int32("ACC")]
    return _graph("accumulator", inputs, [_int32("OUTPUT"), _int32("ACC_OUT")], nodes, [zero])


def string_dyna_onnx() -> bytes:
    """``ACC_OUT = (START ? 0 : ACC) + INPUT + END * int(CORRID)``; ``OUTPUT = ACC_OUT``."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    zero = numpy_helper.from_array(np.zeros((1, 1), dtype=np.int32), "zero")
    nodes = [
        helper.make_node("Cast", ["CORRID"], ["corrid"], to=TensorProto.INT32),
        helper.make_node("Mul", ["END", "corrid"], ["last"]),
        helper.make_node("Equal", ["START", "zero"], ["going_on"]),
        helper.make_node("Where", ["going_on", "ACC", "zero"], ["carried"]),
        helper.make_node("Add", ["carried", "INPUT"], ["sum"]),
        helper.make_node("Add", ["sum", "last"], ["ACC_OUT"]),
        helper.make_node("Identity", ["ACC_OUT"], ["OUTPUT"]),
    ]
    inputs = [_int32("INPUT"), _int32("START"), _int32("END"), _int32("ACC"),
              helper.make_tensor_value_info("CORRID", TensorProto.STRING, [None, 1])]  # fmt: skip
    return _graph("simple_string_dyna_sequence", inputs, [_int32("OUTPUT"), _int32("ACC_OUT")], nodes, [zero])


def _write(
    target: Path, name: str, config: str, files: dict[str, bytes], beside: dict[str, str] | None = None
) -> None:
    """Model ``name``: its config, ``files`` in version 1, and ``beside`` (text files such as labels) next to the config."""
    version = target / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    (target / name / "config.pbtxt").write_text(config)
    for filename, data in files.items():
        (version / filename).write_bytes(data)
    for filename, text in (beside or {}).items():
        (target / name / filename).write_text(text)


def write_accumulator(target: Path, name: str = "accumulator", **config) -> Path:
    """The implicit-state accumulator as model ``name`` in the repository at ``target``, with ``config`` for
    :func:`accumulator_config` (tests' variants: few slots, short idle times); its folder."""
    _write(Path(target), name, accumulator_config(name, **config), {"accumulator.onnx": accumulator_onnx()})
    return Path(target) / name


def build_models(builders: dict, target: Path, names) -> list[Path]:
    """Write the models ``names`` (keys of ``builders``) into the repository at ``target``; returns their folders."""
    target = Path(target)
    for name in names:
        builders[name](target)
    return [target / name for name in names]


BUILDERS = {
    "repeat_int32": lambda t: _write(t, "repeat_int32", REPEAT_INT32_CONFIG, {}),
    "simple_sequence": lambda t: _write(t, "simple_sequence", SIMPLE_SEQUENCE_CONFIG,
                                        {"model.onnx": simple_sequence_onnx()}),
    "simple_dyna_sequence": lambda t: _write(t, "simple_dyna_sequence", SIMPLE_DYNA_SEQUENCE_CONFIG,
                                             {"model.onnx": simple_sequence_onnx(dyna=True)}),
    "simple_string_dyna_sequence": lambda t: _write(t, "simple_string_dyna_sequence",
                                                    SIMPLE_STRING_DYNA_SEQUENCE_CONFIG,
                                                    {"string_dyna.onnx": string_dyna_onnx()}),
    "accumulator": write_accumulator,
    "accumulator_stateless": lambda t: _write(t, "accumulator_stateless", accumulator_stateless_config(),
                                              {"accumulator.onnx": accumulator_onnx()}),
}  # fmt: skip
QA_STREAMING_MODELS = tuple(BUILDERS)


def build_qa_streaming_models(target: Path, names=QA_STREAMING_MODELS) -> list[Path]:
    """Write the models ``names`` into the repository at ``target``; returns their folders."""
    return build_models(BUILDERS, target, names)
