"""The ``codegen`` decoder: a small GPT-2 trained at build time on the Python standard library's source.

No model hub is reachable, so ``aiworks llm build`` makes the weights itself:

1. a byte-level BPE (``tokenizers``) trained on a few MB of the standard
   library's ``.py`` files (every 20th file, by a stable hash of its path,
   is held out for evaluation);
2. a GPT-2 (``transformers``' ``GPT2LMHeadModel``, ~12.3 M parameters with the
   defaults: 6 layers, width 384, 4,096 tokens) trained for ``steps`` AdamW
   steps on random windows of that text, on the CPU (in bfloat16 autocast
   where the CPU has native bfloat16); the weights and tokenizer are cached under
   ``.aiworks/cache/llm/<key>`` so a second build only exports;
3. an ONNX graph of the decoder with its KV cache as inputs and outputs
   (:func:`decoder_graph`): ``input_ids``, ``position_ids``, each row's
   cache length, the rows that want logits and ``past_key_values.{i}.key/value``
   in; ``logits`` and ``present.{i}.key/value`` (the same cache, written in
   place) out. The graph is written node by node from the model's weights,
   so the cache layout does not depend on the transformers version; a test
   checks its logits against ``GPT2LMHeadModel``'s.

The model folder holds ``1/model.onnx``, ``1/tokenizer.json`` and a
``config.pbtxt`` for the runtime's ``llm`` backend (decoupled: one response
per token). ``random=True`` skips training (tests, benchmarks).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

NAME = "codegen"
EOS = "<|endoftext|>"
DEFAULT_CACHE = Path(".aiworks/cache/llm")


@dataclass(frozen=True)
class LlmSpec:
    """What a build makes; every field is part of the cache key."""

    layers: int = 6
    heads: int = 6
    dim: int = 384
    context: int = 256
    vocab: int = 4096
    steps: int = 400
    batch: int = 16
    window: int = 64
    lr: float = 3e-3
    corpus_mb: float = 4.0
    corpus: str = "stdlib-code-v2"  # bumped when corpus() changes, so the cache key does
    seed: int = 0
    random: bool = False

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def _held_out(path: Path) -> bool:
    return int(hashlib.md5(path.as_posix().encode()).hexdigest(), 16) % 20 == 0


def corpus(corpus_mb: float, *, held_out: bool = False) -> list[str]:
    """The standard library's Python code (no tests, no site-packages), sorted, up to ``corpus_mb`` MB."""
    root = Path(sysconfig.get_paths()["stdlib"])
    # No tests, and no data tables posing as code (the codecs' charmaps, pydoc's topics).
    skip = {"test", "tests", "site-packages", "idlelib", "lib2to3", "turtledemo", "__pycache__", "encodings",
            "pydoc_data"}  # fmt: skip
    texts, size, limit = [], 0, int(corpus_mb * 1e6)
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if skip.intersection(rel.parts) or _held_out(rel) != held_out:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(text)
        size += len(text)
        if size >= limit:
            break
    return texts


def train_tokenizer(texts: list[str], vocab: int):
    """A byte-level BPE over ``texts`` with ``<|endoftext|>`` as its one special token."""
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(texts, vocab_size=vocab, min_frequency=2, special_tokens=[EOS], show_progress=False)
    return tokenizer


def token_stream(tokenizer, texts: list[str]) -> np.ndarray:
    eos = tokenizer.token_to_id(EOS)
    ids: list[int] = []
    for enc in tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return np.asarray(ids, dtype=np.int64)


def hf_model(spec: LlmSpec, vocab: int):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(spec.seed)
    config = GPT2Config(
        vocab_size=vocab, n_positions=spec.context, n_embd=spec.dim, n_layer=spec.layers, n_head=spec.heads,
        activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=vocab - 1, eos_token_id=vocab - 1,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def mean_loss(model, ids: np.ndarray, window: int, windows: int = 16) -> float:
    """Mean next-token cross-entropy (nats) of ``model`` over evenly spaced windows of ``ids``."""
    import torch

    starts = np.linspace(0, len(ids) - window - 1, windows).astype(int)
    batch = torch.from_numpy(np.stack([ids[s : s + window] for s in starts]))
    model.eval()
    with torch.no_grad():
        return float(model(input_ids=batch, labels=batch).loss)


def native_bf16() -> bool:
    """Whether this CPU computes in bfloat16 natively (AVX512-BF16 or AMX): autocast then speeds training ~1.6x."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def train(spec: LlmSpec, *, progress: bool = True):
    """The tokenizer and a GPT2LMHeadModel trained per ``spec``; returns (tokenizer, model, report)."""
    import torch

    from aiworks.lifecycle.progress import bar

    torch.manual_seed(spec.seed)
    started = time.monotonic()
    texts = corpus(spec.corpus_mb)
    tokenizer = train_tokenizer(texts, spec.vocab)
    vocab = tokenizer.get_vocab_size()
    model = hf_model(spec, vocab)
    report = {"parameters": sum(p.numel() for p in model.parameters()), "vocab": vocab}
    if spec.random:
        return tokenizer, model.eval(), report
    ids = token_stream(tokenizer, texts)
    report["train_tokens"] = int(len(ids))
    rng = np.random.default_rng(spec.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.01)
    warmup = max(1, spec.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / spec.steps)))
    )
    bf16 = native_bf16()
    report["bf16_autocast"] = bf16
    model.train()
    with bar(spec.steps, "training codegen", enabled=progress) as b:
        for _ in range(spec.steps):
            starts = rng.integers(0, len(ids) - spec.window - 1, spec.batch)
            batch = torch.from_numpy(np.stack([ids[s : s + spec.window] for s in starts]))
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            b.update()
            b.set_postfix_str(f"loss {loss.item():.2f}")
    report["train_loss"] = loss.item()
    report["train_s"] = round(time.monotonic() - started, 1)
    return tokenizer, model.eval(), report


def held_out_loss(tokenizer, model, spec: LlmSpec) -> float:
    """Mean next-token loss on standard-library files kept out of training."""
    return mean_loss(model, token_stream(tokenizer, corpus(0.5, held_out=True)), min(spec.window, spec.context))


def trained(spec: LlmSpec, *, cache_dir: Path | None = DEFAULT_CACHE, progress: bool = True):
    """(tokenizer.json path, model, report): from the cache when this spec was built before."""
    import torch
    from tokenizers import Tokenizer

    folder = Path(cache_dir) / spec.key() if cache_dir else None
    if folder is not None and (folder / "weights.pt").is_file():
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        model = hf_model(spec, tokenizer.get_vocab_size())
        model.load_state_dict(torch.load(folder / "weights.pt", weights_only=True))
        report = json.loads((folder / "report.json").read_text())
        return folder / "tokenizer.json", model.eval(), {**report, "cached": True}
    tokenizer, model, report = train(spec, progress=progress)
    if not spec.random:
        report["held_out_loss"] = round(held_out_loss(tokenizer, model, spec), 3)
    folder = folder or Path(tempfile.mkdtemp(prefix="aiworks-llm-"))
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    torch.save(model.state_dict(), folder / "weights.pt")
    (folder / "report.json").write_text(json.dumps({**report, "spec": asdict(spec)}, indent=1))
    return folder / "tokenizer.json", model, {**report, "cached": False}


def io_names(layers: int) -> tuple[list[str], list[str]]:
    """The decoder graph's inputs and outputs, in order (:func:`export_onnx`)."""
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return [*FEED_NAMES, *past], ["logits", *present]


FEED_NAMES = ("input_ids", "position_ids", "seqlens_k", "total_sequence_length", "logits_rows")


def decoder_graph(model):
    """GPT-2's forward over ``model``'s weights as an ONNX graph whose attention reads a KV cache in place.

    Written node by node (not traced), so the cache layout is this module's,
    whatever the transformers version. Inputs:

    - ``input_ids``, ``position_ids`` [batch, new] (int64): each row's new tokens and their positions;
    - ``seqlens_k`` [batch] (int32): each row's tokens in its cache slot *after* this call, minus one;
    - ``total_sequence_length`` [] (int32): the largest of those, plus one;
    - ``logits_rows`` [rows] (int64): which of the batch × new tokens (row-major) get logits;
    - ``past_key_values.{i}.key/value`` [batch, heads, context, head_dim] (float32): the cache slots.

    Outputs: ``logits`` [rows, vocab], and ``present.{i}.key/value``, the same
    shape as the past: the caller binds each to its past's memory, so the
    new tokens' keys and values are written into the cache where they belong
    and nothing is copied. Attention is ONNX Runtime's ``GroupQueryAttention``
    (com.microsoft) with as many key/value heads as query heads: each row
    attends to its own ``seqlens_k + 1`` slots only, so a short sequence does
    not pay for a long one beside it. As that operator requires, new tokens
    of several rows share a call only when no row has a history (the prompt's
    first chunk) or each row brings one token (decoding); a prompt's later
    chunks go one row per call.
    """
    from onnx import TensorProto, helper, numpy_helper

    cfg = model.config
    layers, heads, dim = cfg.n_layer, cfg.n_head, cfg.n_embd
    head_dim = dim // heads
    weights = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    inits, nodes = [], []

    def const(name: str, value) -> str:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def node(op: str, ins: list[str], out: str, domain: str | None = None, **attrs) -> str:
        nodes.append(helper.make_node(op, ins, [out], domain=domain, **attrs))
        return out

    def layer_norm(x: str, prefix: str, out: str) -> str:
        gamma, beta = (
            const(f"{prefix}.weight", weights[f"{prefix}.weight"]),
            const(f"{prefix}.bias", weights[f"{prefix}.bias"]),
        )
        return node("LayerNormalization", [x, gamma, beta], out, axis=-1, epsilon=cfg.layer_norm_epsilon)

    def linear(x: str, prefix: str, out: str) -> str:  # GPT-2's Conv1D: x @ W + b, as one Gemm on [tokens, dim]
        w, b = (
            const(f"{prefix}.weight", weights[f"{prefix}.weight"]),
            const(f"{prefix}.bias", weights[f"{prefix}.bias"]),
        )
        return node("Gemm", [x, w, b], out)

    t = "transformer"
    tok = node("Gather", [const("wte", weights[f"{t}.wte.weight"]), "input_ids"], "tok_emb")
    pos = node("Gather", [const("wpe", weights[f"{t}.wpe.weight"]), "position_ids"], "pos_emb")
    new = node("Slice", [node("Shape", ["input_ids"], "ids_shape"), const("one", np.array([1], np.int64)),
                         const("two", np.array([2], np.int64))], "new")  # fmt: skip
    shape3 = node("Concat", [const("minus_one", np.array([-1], np.int64)), new,
                             const("dim3", np.array([3 * dim], np.int64))], "shape3", axis=0)  # fmt: skip
    flat = const("flat", np.array([-1, dim], np.int64))
    x = node("Reshape", [node("Add", [tok, pos], "emb"), flat], "x0")  # [batch * new, dim] throughout
    for i in range(layers):
        p = f"{t}.h.{i}"
        qkv = node("Reshape", [linear(layer_norm(x, f"{p}.ln_1", f"h{i}.ln1"), f"{p}.attn.c_attn", f"h{i}.qkv2"), shape3],
                   f"h{i}.qkv")  # fmt: skip
        nodes.append(helper.make_node("Split", [qkv, const(f"h{i}.split", np.array([dim] * 3, np.int64))],
                                      [f"h{i}.q", f"h{i}.k", f"h{i}.v"], axis=2))  # fmt: skip
        nodes.append(helper.make_node(
            "GroupQueryAttention",
            [f"h{i}.q", f"h{i}.k", f"h{i}.v", f"past_key_values.{i}.key", f"past_key_values.{i}.value",
             "seqlens_k", "total_sequence_length"],
            [f"h{i}.att", f"present.{i}.key", f"present.{i}.value"],
            domain="com.microsoft", num_heads=heads, kv_num_heads=heads, scale=1.0 / math.sqrt(head_dim),
        ))  # fmt: skip
        att = node("Reshape", [f"h{i}.att", flat], f"h{i}.att2")
        x = node("Add", [x, linear(att, f"{p}.attn.c_proj", f"h{i}.proj")], f"h{i}.x1")
        fc = node("MatMul", [layer_norm(x, f"{p}.ln_2", f"h{i}.ln2"), const(f"{p}.mlp.c_fc.weight", weights[f"{p}.mlp.c_fc.weight"])],
                  f"h{i}.fc")  # fmt: skip
        gelu = node("FastGelu", [fc, const(f"{p}.mlp.c_fc.bias", weights[f"{p}.mlp.c_fc.bias"])], f"h{i}.gelu",
                    domain="com.microsoft")  # GPT-2's gelu_new (the tanh form), bias added first  # fmt: skip
        x = node("Add", [x, linear(gelu, f"{p}.mlp.c_proj", f"h{i}.mlp")], f"h{i}.x2")
    last = node("Gather", [x, "logits_rows"], "last", axis=0)
    head = const("lm_head", weights[f"{t}.wte.weight"].T)  # tied to the token embedding
    node("MatMul", [layer_norm(last, f"{t}.ln_f", "final"), head], "logits")
    cache_dims = ["batch", heads, "context", head_dim]
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "new"]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "new"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["batch"]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("logits_rows", TensorProto.INT64, ["rows"]),
    ]
    names_in, names_out = io_names(layers)
    inputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache_dims) for n in names_in[len(FEED_NAMES) :]]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", cfg.vocab_size])]
    outputs += [helper.make_tensor_value_info(n, TensorProto.FLOAT, cache_dims) for n in names_out[1:]]
    graph = helper.make_graph(nodes, "codegen", inputs, outputs, inits)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
    )


PRECISIONS = ("fp32", "int8")


def export_onnx(model, dst: Path, *, precision: str = "fp32") -> Path:
    """Write :func:`decoder_graph` of ``model`` to ``dst``; ``int8``: its matrix products quantized (below).

    ``int8`` is ONNX Runtime's dynamic quantization of every ``Gemm`` and
    ``MatMul`` (the attention, MLP and output projections; attention itself
    and the cache stay float32): weights int8 with one scale per output
    channel, activations quantized per call. On a CPU with VNNI it reads a
    quarter of the weight bytes and multiplies in int8, so a decode step
    and a prompt chunk both run faster; what it costs in accuracy is
    measured at build time (``served_held_out_loss`` in the report, against
    the torch model's ``held_out_loss``).
    """
    import onnx

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}")
    graph = decoder_graph(model)
    if precision == "fp32":
        onnx.save(graph, str(dst))
        return Path(dst)
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "fp32.onnx"
        onnx.save(graph, str(source))
        logging.disable(logging.WARNING)  # its advice to run a shape-inference pass first, on the root logger
        try:
            quantize_dynamic(
            str(source), str(dst), weight_type=QuantType.QInt8, per_channel=True,
            op_types_to_quantize=["MatMul", "Gemm"],
            # Shape inference stops at the contrib attention operator; every tensor here is float32.
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )  # fmt: skip
        finally:
            logging.disable(logging.NOTSET)
    return Path(dst)


def served_loss(path: Path, ids: np.ndarray, window: int, windows: int = 16) -> float:
    """:func:`mean_loss` of the exported graph at ``path`` (what the runtime serves), on the same windows."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
    heads, head_dim = int(past[0].shape[1]), int(past[0].shape[3])
    starts = np.linspace(0, len(ids) - window - 1, windows).astype(int)
    batch = np.stack([ids[s : s + window] for s in starts]).astype(np.int64)
    feeds = {
        "input_ids": batch, "position_ids": np.tile(np.arange(window), (windows, 1)),
        "seqlens_k": np.full(windows, window - 1, np.int32), "total_sequence_length": np.asarray(window, np.int32),
        "logits_rows": np.arange(windows * window),
    }  # fmt: skip
    feeds.update({i.name: np.zeros((windows, heads, window, head_dim), np.float32) for i in past})
    logits = session.run(["logits"], feeds)[0].astype(np.float64).reshape(windows, window, -1)[:, :-1]
    targets = batch[:, 1:]
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    picked = np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float((logz - picked).mean())


def config_text(
    spec: LlmSpec, *, name: str = NAME, kv_budget_tokens: int = 16384, max_sequences: int = 32, threads: int = 1,
    instances: int = 2,
) -> str:  # fmt: skip
    """``config.pbtxt`` for the runtime's ``llm`` backend: text in, one text piece per response out.

    ``instances`` engines run side by side in a replica, sharing ``kv_budget_tokens`` and ``max_sequences``
    evenly; ``threads``: ONNX Runtime's intra-op threads of each one's decoder. Two engines of one thread
    made as many tokens/s on 2 cores as one of two threads, and first tokens sooner (docs/generation.md).
    """
    return f"""\
name: "{name}"
backend: "llm"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: {instances} }} ]
parameters {{ key: "context_tokens" value: {{ string_value: "{spec.context}" }} }}
parameters {{ key: "kv_budget_tokens" value: {{ string_value: "{kv_budget_tokens}" }} }}
parameters {{ key: "max_sequences" value: {{ string_value: "{max_sequences}" }} }}
parameters {{ key: "prefill_chunk_tokens" value: {{ string_value: "256" }} }}
parameters {{ key: "max_tokens_cap" value: {{ string_value: "{spec.context}" }} }}
parameters {{ key: "default_max_tokens" value: {{ string_value: "16" }} }}
parameters {{ key: "intra_op_thread_count" value: {{ string_value: "{threads}" }} }}
"""


def build(
    out: Path, spec: LlmSpec = LlmSpec(), *, name: str = NAME, cache_dir: Path | None = DEFAULT_CACHE,
    progress: bool = True, kv_budget_tokens: int = 16384, max_sequences: int = 32, threads: int = 1,
    instances: int = 2, precision: str = "fp32",
) -> tuple[Path, dict]:  # fmt: skip
    """Write ``<out>/<name>`` (version 1); returns the folder and a report (parameters, losses, cached).

    A trained model's report also has ``served_held_out_loss``: the exported graph's loss on the
    held-out windows :func:`held_out_loss` uses, so what ``precision`` costs is on record.
    """
    tokenizer_json, model, report = trained(spec, cache_dir=cache_dir, progress=progress)
    folder = Path(out) / name
    version = folder / "1"
    version.mkdir(parents=True, exist_ok=True)
    if progress:
        print("exporting ONNX with the KV cache ...", file=sys.stderr)
    export_onnx(model, version / "model.onnx", precision=precision)
    report = {**report, "precision": precision}
    if not spec.random:
        from tokenizers import Tokenizer

        held_out = token_stream(Tokenizer.from_file(str(tokenizer_json)), corpus(0.5, held_out=True))
        report["served_held_out_loss"] = round(
            served_loss(version / "model.onnx", held_out, min(spec.window, spec.context)), 4
        )
    shutil.copyfile(tokenizer_json, version / "tokenizer.json")
    (folder / "config.pbtxt").write_text(
        config_text(spec, name=name, kv_budget_tokens=kv_budget_tokens, max_sequences=max_sequences, threads=threads,
                    instances=instances)  # fmt: skip
    )
    if cache_dir is None:
        shutil.rmtree(Path(tokenizer_json).parent, ignore_errors=True)
    return folder, report
