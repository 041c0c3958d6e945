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
3. an ONNX export of the decoder with its KV cache as inputs and outputs
   (:func:`export_onnx`): ``input_ids``, ``attention_mask``, ``position_ids``
   and ``past_key_values.{i}.key/value`` in; ``logits`` and
   ``present.{i}.key/value`` out. The exported graph is this module's own
   forward over the model's weights (:class:`KVDecoder`), so the cache layout
   does not depend on the transformers version; a test checks its logits
   against ``GPT2LMHeadModel``'s.

The model folder holds ``1/model.onnx``, ``1/tokenizer.json`` and a
``config.pbtxt`` for the runtime's ``llm`` backend (decoupled: one response
per token). ``random=True`` skips training (tests, benchmarks).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
import sysconfig
import tempfile
import time
import warnings
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
            b.set_postfix_str(f"loss {float(loss):.2f}")
    report["train_loss"] = float(loss)
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


def kv_decoder(model):
    """:class:`KVDecoder` over ``model``'s weights (a torch module; built lazily so torch stays optional)."""
    import torch

    class KVDecoder(torch.nn.Module):
        """GPT-2's forward with an explicit KV cache: the graph the runtime runs.

        ``attention_mask`` [batch, past + new] marks the cache slots (and new
        tokens) each row may attend; ``position_ids`` [batch, new] are each
        row's own positions, so rows with different histories share a batch.
        ``present`` holds the new tokens' keys and values only: attention
        scores the past and the new keys apart and joins the (small) score
        rows, so the cache is read where it lies and never copied into a
        longer tensor; the caller stores the new entries in its cache.
        """

        def __init__(self, hf):
            super().__init__()
            self.hf = hf
            cfg = hf.config
            self.heads, self.head_dim = cfg.n_head, cfg.n_embd // cfg.n_head

        def forward(self, input_ids, attention_mask, position_ids, *past):
            t = self.hf.transformer
            x = t.wte(input_ids) + t.wpe(position_ids)
            bsz, new = input_ids.shape[0], input_ids.shape[1]
            total = attention_mask.shape[1]
            width = total - new
            q_pos = torch.arange(new) + width
            causal = torch.arange(total)[None, :] <= q_pos[:, None]
            allowed = causal[None, None, :, :] & (attention_mask[:, None, None, :] > 0)
            scale = 1.0 / math.sqrt(self.head_dim)
            presents = []
            for i, block in enumerate(t.h):
                h = block.ln_1(x)
                q, k, v = block.attn.c_attn(h).split(self.heads * self.head_dim, dim=2)
                q, k, v = (z.view(bsz, new, self.heads, self.head_dim).transpose(1, 2) for z in (q, k, v))
                presents += [k, v]
                pk, pv = past[2 * i], past[2 * i + 1]
                scores = torch.cat([q @ pk.transpose(-1, -2), q @ k.transpose(-1, -2)], dim=-1) * scale
                scores = scores.masked_fill(~allowed, -1e9)
                p = torch.softmax(scores, dim=-1)
                att = p[..., :width] @ pv + p[..., width:] @ v
                att = att.transpose(1, 2).reshape(bsz, new, self.heads * self.head_dim)
                x = x + block.attn.c_proj(att)
                x = x + block.mlp(block.ln_2(x))
            logits = t.ln_f(x) @ t.wte.weight.T
            return (logits, *presents)

    return KVDecoder(model).eval()


def io_names(layers: int) -> tuple[list[str], list[str]]:
    past = [f"past_key_values.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    present = [f"present.{i}.{kv}" for i in range(layers) for kv in ("key", "value")]
    return ["input_ids", "attention_mask", "position_ids", *past], ["logits", *present]


def export_onnx(model, dst: Path) -> Path:
    """Write the KV-cache decoder graph (opset 17, batch / new / past / total dims dynamic).

    ``present.{i}.key/value`` are [batch, heads, new, head_dim]: the new tokens' entries, not past + new.
    """
    import torch

    cfg = model.config
    heads, head_dim = cfg.n_head, cfg.n_embd // cfg.n_head
    inputs, outputs = io_names(cfg.n_layer)
    ids = torch.tensor([[1, 2, 3]])
    past = [torch.zeros(1, heads, 2, head_dim) for _ in range(2 * cfg.n_layer)]
    args = (ids, torch.ones(1, 5, dtype=torch.int64), torch.tensor([[2, 3, 4]]), *past)
    dynamic = {"input_ids": {0: "batch", 1: "new"}, "attention_mask": {0: "batch", 1: "total"},
               "position_ids": {0: "batch", 1: "new"}, "logits": {0: "batch", 1: "new"}}  # fmt: skip
    dynamic.update({n: {0: "batch", 2: "past"} for n in inputs[3:]})
    dynamic.update({n: {0: "batch", 2: "new"} for n in outputs[1:]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            kv_decoder(model), args, str(dst), dynamo=False, opset_version=17,
            input_names=inputs, output_names=outputs, dynamic_axes=dynamic,
        )  # fmt: skip
    return Path(dst)


def config_text(
    spec: LlmSpec, *, name: str = NAME, kv_budget_tokens: int = 16384, max_sequences: int = 32, threads: int = 2
) -> str:
    """``config.pbtxt`` for the runtime's ``llm`` backend: text in, one text piece per response out.

    ``threads``: ONNX Runtime's intra-op threads for the decoder (the runtime's default is 1, which leaves
    a batched decode step on one core).
    """
    return f"""\
name: "{name}"
backend: "llm"
max_batch_size: 0
model_transaction_policy {{ decoupled: true }}
input [ {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ 1 ] }} ]
instance_group [ {{ kind: KIND_CPU count: 1 }} ]
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
    progress: bool = True, kv_budget_tokens: int = 16384, max_sequences: int = 32, threads: int = 2,
) -> tuple[Path, dict]:  # fmt: skip
    """Write ``<out>/<name>`` (version 1); returns the folder and a report (parameters, losses, cached)."""
    tokenizer_json, model, report = trained(spec, cache_dir=cache_dir, progress=progress)
    folder = Path(out) / name
    version = folder / "1"
    version.mkdir(parents=True, exist_ok=True)
    if progress:
        print("exporting ONNX with the KV cache ...", file=sys.stderr)
    export_onnx(model, version / "model.onnx")
    shutil.copyfile(tokenizer_json, version / "tokenizer.json")
    (folder / "config.pbtxt").write_text(
        config_text(spec, name=name, kv_budget_tokens=kv_budget_tokens, max_sequences=max_sequences, threads=threads)
    )
    if cache_dir is None:
        shutil.rmtree(Path(tokenizer_json).parent, ignore_errors=True)
    return folder, report
