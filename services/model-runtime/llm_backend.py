"""The ``llm`` backend: text generation with continuous batching over a KV-cache decoder (``aiworks llm build``).

A version folder holds ``model.onnx`` (the decoder with ``past_key_values`` /
``present``, see src/aiworks/lifecycle/llm.py) and ``tokenizer.json``. The
config is decoupled (``model_transaction_policy { decoupled: true }``) with
``text_input`` (BYTES [1]) in and ``text_output`` (BYTES [1]) out, as
Triton's generate convention names them; each response carries the text one
step made (usually one token's). Sampling comes from request parameters:

- ``max_tokens`` (default: the config's ``default_max_tokens``; 1..``max_tokens_cap``, or 0 with
  ``prompt_logprobs``: the prompt is scored, nothing generated),
- ``temperature`` (0: greedy), ``top_k`` (0: off), ``top_p`` (1: off), ``seed``,
- ``stop``: a string, or a JSON list of strings, that ends the generation (not returned),
- ``ignore_eos``: keep going past the end-of-text token,
- ``logprobs``: 0..:data:`MAX_LOGPROBS`: each response then carries a
  ``logprobs`` parameter, a JSON list with one ``[text, bytes, logprob, top]``
  per token it covers (``top``: the ``logprobs`` likeliest tokens as
  ``[text, bytes, logprob]``, likeliest first), the log probabilities from the
  model's own distribution (before temperature, top-k and top-p), ``bytes``
  the token's UTF-8 bytes (a token may hold part of a character),
- ``prompt_logprobs``: 0..:data:`MAX_LOGPROBS`: the first response also
  carries ``prompt_logprobs``, the same entries for the prompt's tokens,
  the first with a ``null`` log probability and no others (nothing predicts
  it); such a prompt is not healed
  (its trailing space stays a token of its own), so its tokens spell it.

Any other parameter is refused (``INVALID_ARGUMENT``) but Triton's own (``triton_*``). Config parameters:
``context_tokens``, ``kv_budget_tokens`` (the replica's KV-cache budget in
tokens; admission waits while it is full), ``max_sequences`` (cache slots),
``prefill_chunk_tokens``, ``share_prompt_min_tokens`` (the shortest prompt
prefix an engine copies from a running sequence instead of reading it again;
16 by default, 0: none), ``keep_prompts`` (finished sequences' rows each
engine keeps for later prompts that begin alike; 4 by default, 0: none),
``priority_aging_s`` (seconds a waiting sequence waits before it competes as
if one QoS class more urgent; 30 by default, 0: classes strictly first) and
``max_tokens_cap``. The scheduling itself is
:mod:`aiworks.runtime.llm_engine`; ONNX Runtime runs in its worker thread.

``instance_group { count: N }`` runs N engines side by side, each with its
own decoder session (``intra_op_thread_count`` threads), cache and worker
thread, as Triton runs N instances of a model. The replica's
``kv_budget_tokens`` and ``max_sequences`` are split evenly between them,
so the replica's totals, which the scheduler routes by, stay as configured;
a new generation goes to an instance holding a generation whose prompt
begins as its own (where it is admitted at once: it copies that prompt's
cache entries), else to the one with the most KV room left once the
generations already there (running or waiting) hold their reservations.
Response parameters: ``prompt_tokens`` on the first (and ``cached_prompt_tokens``
when some of the prompt was copied from another sequence's row), ``completion_tokens``
and ``finish_reason`` (``stop`` or ``length``) on the last, and ``tokens``
on a response that carries the text of more than one token (the steps that
piled up while the stream's reader was busy travel as one response).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from aiworks.core import metrics
from aiworks.core.datatypes import Tensor, deserialize_bytes, serialize_items
from aiworks.core.errors import Internal, InvalidArgument
from aiworks.core.inference import Answer, InferRequest
from aiworks.core.model_config import ModelConfig, TensorSpec
from aiworks.core.options import RequestOptions
from aiworks.runtime.llm_driver import AsyncEngine
from aiworks.runtime.llm_engine import AGING_S, KEEP_PROMPTS, SHARE_MIN_TOKENS, Engine, Sampling

EOS = "<|endoftext|>"
SAMPLING_PARAMETERS = frozenset({"max_tokens", "temperature", "top_k", "top_p", "seed", "stop", "ignore_eos",
                                 "logprobs", "prompt_logprobs"})  # fmt: skip
MAX_LOGPROBS = 20  # the likeliest tokens a response may list beside each chosen one (OpenAI's top_logprobs cap)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 8, 64


# How many sequences more than the emptiest instance one may hold and still take a generation whose prompt it
# holds: the n = 4 choices of a lone request land on one instance, which reads their prompt once.
SHARE_SLACK = 3


def _int(config: ModelConfig, key: str, default: int, minimum: int = 1) -> int:
    try:
        value = int(config.parameters.get(key, default))
    except ValueError:
        raise InvalidArgument(f"model '{config.name}': parameter {key} must be an integer") from None
    if value < minimum:
        raise InvalidArgument(f"model '{config.name}': parameter {key} must be at least {minimum}")
    return value


def _number(params: dict, name: str, kind, default, low, high):
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidArgument(f"parameter '{name}' must be a number")
    try:
        value = kind(value) if kind is float or float(value) == int(float(value)) else None
    except (TypeError, ValueError):
        value = None
    if value is None or not (low <= value <= high):
        raise InvalidArgument(f"parameter '{name}' is {str(params.get(name))[:32]!r}; it must lie in [{low}, {high}]")
    return value


def _stops(value) -> tuple[str, ...]:
    if value is None or value == "":
        return ()
    if isinstance(value, str) and value.startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            raise InvalidArgument("parameter 'stop' is not a valid JSON list of strings") from None
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidArgument("parameter 'stop' must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stops):
        raise InvalidArgument(f"parameter 'stop': at most {MAX_STOP_STRINGS} strings of {MAX_STOP_CHARS} characters")
    return tuple(stops)


def parse_sampling(params: dict, *, default_max_tokens: int, max_tokens_cap: int) -> Sampling:
    """The :class:`Sampling` a request's parameters ask for; unknown or out-of-range ones are refused."""
    # Triton's own request parameters (triton_enable_empty_final_response, ...) are the transport's.
    unknown = sorted(n for n in set(params) - SAMPLING_PARAMETERS if not n.startswith("triton_"))
    if unknown:
        raise InvalidArgument(
            f"unknown sampling parameter(s) {unknown[:4]}; accepted: {sorted(SAMPLING_PARAMETERS)}"
        )
    seed = params.get("seed")
    scored = _number(params, "prompt_logprobs", int, -1, 0, MAX_LOGPROBS) if "prompt_logprobs" in params else -1
    ignore_eos = params.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise InvalidArgument("parameter 'ignore_eos' must be a boolean")
    return Sampling(
        # 0 new tokens only to score a prompt (echo with logprobs): it is read and ends.
        max_tokens=_number(params, "max_tokens", int, default_max_tokens, 0 if scored >= 0 else 1, max_tokens_cap),
        temperature=_number(params, "temperature", float, 0.0, 0.0, 100.0),
        top_k=_number(params, "top_k", int, 0, 0, 1 << 20),
        top_p=_number(params, "top_p", float, 1.0, 1e-6, 1.0),
        seed=None if seed is None else _number(params, "seed", int, 0, 0, 2**63 - 1),
        stop=_stops(params.get("stop")),
        ignore_eos=ignore_eos,
        logprobs=_number(params, "logprobs", int, -1, 0, MAX_LOGPROBS) if "logprobs" in params else -1,
        prompt_logprobs=scored,
    )


def _byte_values() -> dict[str, int]:
    """Byte-level BPE's alphabet: the character each byte is written as in the vocabulary, back to the byte.

    Printable Latin-1 bytes stand for themselves; the others (controls, space,
    and a few more) take the code points from 256 upwards, in byte order.
    """
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    hidden = [b for b in range(256) if b not in shown]
    return {chr(b): b for b in shown} | {chr(256 + i): b for i, b in enumerate(hidden)}


class TokenPieces:
    """Each vocabulary entry's text and UTF-8 bytes, read from the tokenizer once, for log-probability answers."""

    def __init__(self, tokenizer):
        values = _byte_values()
        self.pieces: list[tuple[str, list[int]]] = []
        for i in range(tokenizer.get_vocab_size()):
            token = tokenizer.id_to_token(i) or ""
            if all(c in values for c in token):
                raw = bytes(values[c] for c in token)
            else:  # an added token (<|endoftext|>) is its own text
                raw = token.encode("utf-8")
            self.pieces.append((raw.decode("utf-8", "replace"), list(raw)))

    def entry(self, token: int, logprob: float, strip: bool = False) -> list:
        text, raw = self.pieces[token]
        if strip and text.startswith(" "):  # a healed first token: its space is the prompt's
            text, raw = text[1:], raw[1:]
        return [text, raw, max(logprob, -9999.0)]  # an impossible token (-inf) as vLLM writes it

    def encode(self, logprobs, healed: bool = False, first: list | None = None) -> str:
        """The ``logprobs`` (or ``prompt_logprobs``, ``first`` its first entry) response parameter for
        :class:`~aiworks.runtime.llm_engine.LogProb` s."""
        out = list(first or [])
        for n, (token, lp, top) in enumerate(logprobs):
            strip = healed and n == 0
            out.append([*self.entry(token, lp, strip), [self.entry(t, v, strip) for t, v in top]])
        return json.dumps(out, ensure_ascii=False)


class OnnxDecoder:
    """The decoder's ONNX Runtime session as an :class:`Engine` runner (the graph: ``aiworks.lifecycle.llm``).

    A call binds the caller's cache slots as both the past and the present of
    every layer (the same memory), so the new tokens' keys and values land in
    the cache during the run and only the logits are allocated.
    """

    def __init__(self, path: Path, threads: int):
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        inputs = {i.name: i for i in self.session.get_inputs()}
        self.past_names = [n for n in inputs if n.startswith("past_key_values.")]
        if not self.past_names or "seqlens_k" not in inputs:
            raise InvalidArgument(f"{path}: not a KV-cache decoder of this version (rebuild it: aiworks llm build)")
        self.present_names = [n.replace("past_key_values.", "present.", 1) for n in self.past_names]
        self.layers = len(self.past_names) // 2
        key = inputs[self.past_names[0]]
        self.heads, self.head_dim = int(key.shape[1]), int(key.shape[3])
        self.vocab = int(self.session.get_outputs()[0].shape[1])

    def __call__(self, ids: np.ndarray, positions: np.ndarray, seqlens: np.ndarray, rows: np.ndarray,
                 cache: list[np.ndarray]) -> np.ndarray:  # fmt: skip
        """Logits [len(rows), vocab]; ``cache``: each layer's key and value slots [batch, heads, context, head_dim]
        (C-contiguous float32), read and written in place; ``seqlens``: each row's cache length after the call,
        minus one."""
        binding = self.session.io_binding()
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("position_ids", positions)
        binding.bind_cpu_input("seqlens_k", seqlens)
        binding.bind_cpu_input("total_sequence_length", np.asarray(int(seqlens.max()) + 1, np.int32))
        binding.bind_cpu_input("logits_rows", rows)
        for past, present, buffer in zip(self.past_names, self.present_names, cache):
            shape, address = list(buffer.shape), buffer.ctypes.data
            binding.bind_input(past, "cpu", 0, np.float32, shape, address)
            binding.bind_output(present, "cpu", 0, np.float32, shape, address)
        logits = np.empty((rows.shape[0], self.vocab), np.float32)
        binding.bind_output("logits", "cpu", 0, np.float32, list(logits.shape), logits.ctypes.data)
        self.session.run_with_iobinding(binding)
        return logits


class LlmModel:
    """One loaded version of an ``llm`` model; see the module docstring."""

    decoupled = True
    inline_ok = False

    def __init__(self, path: Path, config: ModelConfig, default_intra_op_threads: int):
        from tokenizers import Tokenizer

        where = f"model '{config.name}' (llm backend)"
        if not config.decoupled:
            raise InvalidArgument(f"{where}: needs model_transaction_policy {{ decoupled: true }}")
        folder = Path(path).parent
        if not (folder / "tokenizer.json").is_file():
            raise InvalidArgument(f"{where}: the version folder has no tokenizer.json")
        self.name = config.name
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        threads = int(config.parameters.get("intra_op_thread_count", default_intra_op_threads))
        self.context = _int(config, "context_tokens", 256)
        self.max_tokens_cap = min(_int(config, "max_tokens_cap", self.context), self.context)
        self.default_max_tokens = min(_int(config, "default_max_tokens", 16), self.max_tokens_cap)
        count = max(1, config.instance_count)
        budget, slots = _int(config, "kv_budget_tokens", 16384), _int(config, "max_sequences", 32)
        if budget // count < self.context or slots < count:
            raise InvalidArgument(
                f"{where}: kv_budget_tokens {budget} and max_sequences {slots} split over instance_group count "
                f"{count} leave an instance {budget // count} tokens and {slots // count} sequences; each needs at "
                f"least the context window ({self.context} tokens) and one sequence"
            )
        share = _int(config, "share_prompt_min_tokens", SHARE_MIN_TOKENS, minimum=0)
        keep = _int(config, "keep_prompts", KEEP_PROMPTS, minimum=0)
        aging_s = _int(config, "priority_aging_s", int(AGING_S), minimum=0)
        self.engines = [
            Engine(
                decoder := OnnxDecoder(path, threads), self.tokenizer, layers=decoder.layers, heads=decoder.heads,
                head_dim=decoder.head_dim, context=self.context,
                kv_budget_tokens=budget // count + (i < budget % count),
                max_sequences=slots // count + (i < slots % count),
                prefill_chunk=_int(config, "prefill_chunk_tokens", 64), eos_id=self.tokenizer.token_to_id(EOS),
                share_min_tokens=share, keep_prompts=keep, aging_s=aging_s,
            )
            for i in range(count)
        ]  # fmt: skip
        self.engine = self.engines[0]
        self._async: list[AsyncEngine] = []
        self._pieces = TokenPieces(self.tokenizer)  # for log probabilities; made at load, off the request path
        version = Path(path).parent.name
        self._kv = [metrics.RUNTIME_LLM_KV_TOKENS.labels(self.name, version, k) for k in ("used", "budget")]
        self._seqs = [metrics.RUNTIME_LLM_SEQUENCES.labels(self.name, version, k) for k in ("running", "waiting")]
        self._tokens = [metrics.RUNTIME_LLM_TOKENS.labels(self.name, version, k) for k in ("prompt", "completion")]
        self._reused = metrics.RUNTIME_LLM_PROMPT_REUSED.labels(self.name, version)
        self._ttft = metrics.RUNTIME_LLM_TTFT.labels(self.name, version)
        self._itl = metrics.RUNTIME_LLM_INTER_TOKEN.labels(self.name, version)
        self._gauges()

    def _gauges(self) -> None:
        engines = self.engines
        self._kv[0].set(sum(e.used_tokens for e in engines))
        self._kv[1].set(sum(e.kv_budget_tokens for e in engines))
        self._seqs[0].set(sum(len(e.running) for e in engines))
        self._seqs[1].set(sum(len(e.waiting) for e in engines))

    def _instance(self, prompt: np.ndarray, sampling: Sampling, scope: str) -> AsyncEngine:
        """The instance a new generation joins.

        Where it is admitted at once, one already holding a sequence whose
        prompt begins as this one does (running, waiting, or a finished one's
        row kept aside: the ``n`` choices of a request, a shared system
        prompt, a chat's next turn), so that it copies that prompt's cache entries
        instead of reading them (docs/generation.md, "Shared prompts"), as long
        as that instance holds at most :data:`SHARE_SLACK` sequences more than
        the emptiest one: a prompt that every request shares still spreads over
        the instances, each of which then holds it. Otherwise, and among
        several such, the most KV room left once the sequences already running
        or waiting there hold their reservations, then the fewest of those
        sequences.
        """
        if not self._async:
            self._async = [AsyncEngine(e, on_step=self._gauges) for e in self.engines]
        loads = {}
        for instance in self._async:
            tokens, sequences = instance.engine.load()
            loads[instance] = (tokens - instance.engine.kv_budget_tokens, sequences)
        head = self.engine.head_of(prompt, scope) if sampling.prompt_logprobs < 0 else b""  # a scored one reads all
        if head and len(self._async) > 1:
            reserve = min(self.context, int(prompt.shape[0]) + sampling.max_tokens)
            fewest = min(sequences for _, sequences in loads.values())
            near = [i for i in self._async if loads[i][1] <= fewest + SHARE_SLACK and i.engine.holds(head, reserve)]
            if near:
                return min(near, key=loads.__getitem__)
        return min(self._async, key=loads.__getitem__)

    def io_specs(self, batched: bool) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
        return (TensorSpec("text_input", "BYTES", (1,)),), (TensorSpec("text_output", "BYTES", (1,)),)

    def run(self, feeds, outputs):
        raise InvalidArgument(f"model '{self.name}' is decoupled: it answers on a stream only")

    def prompt_ids(self, request: InferRequest, heal: bool = True) -> tuple[np.ndarray, bool]:
        tensors = {t.name: t for t in request.inputs}
        text = tensors.get("text_input")
        if text is None or text.datatype != "BYTES" or int(np.prod(text.shape)) != 1:
            raise InvalidArgument("expected one BYTES element in input 'text_input'")
        raw = deserialize_bytes(text.raw, 1, name="text_input")[0]
        try:
            prompt = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:
            raise InvalidArgument("input 'text_input' is not UTF-8 text") from None
        if not heal:
            return self.engine.encode(prompt), False
        return self.engine.prepare(prompt)  # the instances share the tokenizer and context

    async def stream(self, request: InferRequest, options: RequestOptions):
        """One response per step that made text; the last carries the token counts and finish reason."""
        sampling = parse_sampling(
            request.parameters, default_max_tokens=self.default_max_tokens, max_tokens_cap=self.max_tokens_cap
        )
        prompt, heal = self.prompt_ids(request, heal=sampling.prompt_logprobs < 0)
        instance = self._instance(prompt, sampling, options.tenant)
        first = True
        last_s = time.perf_counter()
        self._tokens[0].inc(int(prompt.shape[0]))
        async for event in instance.generate(prompt, sampling, heal, int(options.priority), options.tenant):
            if event.seq.error:
                raise Internal(f"model '{self.name}': {event.seq.error}")
            now_s = time.perf_counter()
            (self._ttft if first else self._itl).observe(now_s - last_s)
            last_s = now_s
            params = {"prompt_tokens": int(prompt.shape[0])} if first else {}
            if first and event.seq.reused:
                self._reused.inc(event.seq.reused)
                params["cached_prompt_tokens"] = event.seq.reused  # copied, not read (OpenAI's cached_tokens)
            first = False
            if event.tokens > 1:  # several steps in one response (the consumer fell behind)
                params["tokens"] = event.tokens
            if event.logprobs or (sampling.prompt_logprobs >= 0 and "prompt_tokens" in params):
                if event.logprobs:
                    params["logprobs"] = self._pieces.encode(event.logprobs, event.seq.heal and "prompt_tokens" in params)
                if "prompt_tokens" in params and sampling.prompt_logprobs >= 0:
                    first_token = int(prompt[0])
                    params["prompt_logprobs"] = self._pieces.encode(
                        event.seq.prompt_logprobs, first=[[*self._pieces.entry(first_token, 0.0)[:2], None, []]]
                    )
            if event.finished:
                self._tokens[1].inc(len(event.seq.generated))
                params.update(completion_tokens=len(event.seq.generated), finish_reason=event.seq.finish_reason)
            yield Answer(
                [Tensor("text_output", "BYTES", (1,), serialize_items([event.text.encode("utf-8")]))],
                parameters=params,
                final=False,
            )

    def kv_use(self) -> tuple[int, int]:
        """(KV tokens reserved, the budget), over the instances."""
        return sum(e.used_tokens for e in self.engines), sum(e.kv_budget_tokens for e in self.engines)

    def kv_room(self) -> tuple[int, int, int, tuple[int, int, int]]:
        """(KV tokens free, the budget, sequences waiting for room, those by class: realtime, standard, batch):
        what the heartbeat reports for routing."""
        engines = self.engines
        free = sum(max(0, e.kv_budget_tokens - e.used_tokens) for e in engines)
        by_class = [e.waiting_by_rank() for e in engines]
        waiting = tuple(sum(c[i] for c in by_class) for i in range(3))
        return free, sum(e.kv_budget_tokens for e in engines), sum(waiting), waiting

    def close(self) -> None:
        for instance in self._async:
            instance.close()
