"""A BERT WordPiece tokenizer as an ONNX graph, built on onnxruntime-extensions' ``BertTokenizer`` op.

The custom op tokenizes one string (two make a sentence pair), so the graph
runs it in a ``Loop`` over the batch: each row is tokenized, truncated to
``max_length`` and padded to it; then the batch is cut back to its longest
row, which is what a tokenizer called with ``padding="longest"`` returns.

Input ``text``: STRING ``[batch, 1]`` (the shape a Triton BYTES input with
dims ``[1]`` arrives in). Outputs ``input_ids`` and ``attention_mask``: INT64
``[batch, seq]``.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto
from onnx import helper as h

from aiworks.lifecycle.sessions import EXTENSIONS_DOMAIN

OPSET = 17


def _const(name: str, value) -> onnx.NodeProto:
    return h.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(np.asarray(value), name))


def bert_tokenizer_model(
    vocab: list[str], *, max_length: int = 128, lowercase: bool = True, strip_accents: bool = True
) -> onnx.ModelProto:
    """The tokenizer graph for a WordPiece ``vocab`` (tokens in id order)."""
    p = "tokenizer/"
    body = h.make_graph(
        [
            h.make_node("Gather", [p + "flat", p + "i"], [p + "one"], axis=0),
            _const(p + "axis0", np.array([0], np.int64)),
            h.make_node("Unsqueeze", [p + "one", p + "axis0"], [p + "one_1d"]),
            h.make_node(
                "BertTokenizer",
                [p + "one_1d"],
                [p + "ids", p + "type_ids", p + "mask"],
                domain=EXTENSIONS_DOMAIN,
                vocab_file="\n".join(vocab),
                do_lower_case=int(lowercase),
                strip_accents=int(strip_accents),
                max_length=max_length,
                truncation_strategy_name="longest_first",
            ),
            h.make_node("Shape", [p + "ids"], [p + "len"]),
            _const(p + "max_len", np.array([max_length], np.int64)),
            h.make_node("Sub", [p + "max_len", p + "len"], [p + "pad_n"]),
            _const(p + "zero_1d", np.array([0], np.int64)),
            h.make_node("Concat", [p + "zero_1d", p + "pad_n"], [p + "pads"], axis=0),
            h.make_node("Pad", [p + "ids", p + "pads"], [p + "ids_padded"]),
            h.make_node("Pad", [p + "mask", p + "pads"], [p + "mask_padded"]),
            h.make_node("Identity", [p + "cond_in"], [p + "cond_out"]),
        ],
        "tokenize_one",
        [
            h.make_tensor_value_info(p + "i", TensorProto.INT64, []),
            h.make_tensor_value_info(p + "cond_in", TensorProto.BOOL, []),
        ],
        [
            h.make_tensor_value_info(p + "cond_out", TensorProto.BOOL, []),
            h.make_tensor_value_info(p + "ids_padded", TensorProto.INT64, [max_length]),
            h.make_tensor_value_info(p + "mask_padded", TensorProto.INT64, [max_length]),
        ],
    )
    nodes = [
        _const(p + "minus_one", np.array([-1], np.int64)),
        h.make_node("Reshape", ["text", p + "minus_one"], [p + "flat"]),
        h.make_node("Shape", [p + "flat"], [p + "n_1d"]),
        h.make_node("Squeeze", [p + "n_1d"], [p + "n"]),
        _const(p + "true", np.array(True)),
        h.make_node("Loop", [p + "n", p + "true"], [p + "ids_full", p + "mask_full"], body=body),
        _const(p + "axis1", np.array([1], np.int64)),
        h.make_node("ReduceSum", [p + "mask_full", p + "axis1"], [p + "lengths"], keepdims=0),
        h.make_node("ReduceMax", [p + "lengths"], [p + "longest"], keepdims=1),
        h.make_node("Slice", [p + "ids_full", p + "zero", p + "longest", p + "axis1"], ["input_ids"]),
        h.make_node("Slice", [p + "mask_full", p + "zero", p + "longest", p + "axis1"], ["attention_mask"]),
        _const(p + "zero", np.array([0], np.int64)),
    ]
    # Constants first: keep the node list in topological order.
    nodes.sort(key=lambda n: n.op_type != "Constant")
    graph = h.make_graph(
        nodes,
        "bert_tokenizer",
        [h.make_tensor_value_info("text", TensorProto.STRING, ["batch", 1])],
        [
            h.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
            h.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"]),
        ],
    )
    return h.make_model(
        graph, opset_imports=[h.make_opsetid("", OPSET), h.make_opsetid(EXTENSIONS_DOMAIN, 1)], ir_version=8
    )


def with_tokenizer(tokenizer: onnx.ModelProto, encoder: onnx.ModelProto) -> onnx.ModelProto:
    """One graph: text in, the encoder's outputs out (the encoder takes ``input_ids`` and ``attention_mask``)."""
    tokenizer = onnx.ModelProto.FromString(tokenizer.SerializeToString())
    tokenizer.ir_version = encoder.ir_version
    # An exporter may list domains the encoder never uses (torch lists every custom domain registered in the
    # process, e.g. ai.onnx.contrib at version 1000 once onnxruntime-extensions' ops were registered), and
    # merge_models refuses two versions of one domain: keep only the domains the encoder's nodes use.
    used = {node.domain for node in encoder.graph.node} | {""}
    if any(entry.domain not in used for entry in encoder.opset_import):
        encoder = onnx.ModelProto.FromString(encoder.SerializeToString())
        kept = [onnx.OperatorSetIdProto(domain=e.domain, version=e.version) for e in encoder.opset_import
                if e.domain in used]  # fmt: skip
        del encoder.opset_import[:]
        encoder.opset_import.extend(kept)
    merged = onnx.compose.merge_models(
        tokenizer,
        encoder,
        io_map=[("input_ids", "input_ids"), ("attention_mask", "attention_mask")],
        producer_name="aiworks",
    )
    # merge_models lists the default domain once per model; tools such as the quantizer want it once.
    versions: dict[str, int] = {}
    for entry in merged.opset_import:
        versions[entry.domain] = max(versions.get(entry.domain, 0), entry.version)
    del merged.opset_import[:]
    merged.opset_import.extend(h.make_opsetid(domain, version) for domain, version in versions.items())
    onnx.checker.check_model(merged)
    return merged
