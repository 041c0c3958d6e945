"""Continuous (iteration-level) batching of text generations over a KV-cache decoder.

:class:`Engine` is the scheduler, with no asyncio in it: each :meth:`Engine.step`

1. drops cancelled sequences (their cache slot and KV budget come back at once);
2. admits waiting sequences, most urgent class first (the request's QoS
   class: realtime, standard, batch; first come first served within one;
   a sequence that has waited ``aging_s`` competes as if one class more
   urgent, so batch work is not held back for ever by a stream of urgent
   generations),
   while a cache slot is free and their reservation (prompt + ``max_tokens``
   tokens) fits the replica's KV budget: the first in that order that does
   not fit waits, and so does everyone behind it, so that freed room goes to
   the most urgent sequence waiting rather than to a smaller, later one;
3. runs one prefill batch: at most ``prefill_chunk`` prompt tokens in all,
   taken from the oldest sequences still reading their prompts, so a long
   prompt costs the others one chunk's time per step, not its whole length,
   and many short ones are read together; the first tokens of the prompts
   now read are sampled and can be handed out at once (:meth:`prefill_step`).
   A prompt is not read twice in one engine (:meth:`_reuse`): one that begins
   with at least ``share_min_tokens`` tokens already in a running sequence's
   cache row copies those keys and values and reads only the rest;
   prompts equal to one read in the same batch (the ``n`` choices of one
   request) copy its row and its last logits once it is read, and those
   that only begin as one read in the batch wait a step to copy that. The
   rows of the last ``keep_prompts`` sequences that ended are kept aside
   (:meth:`_retain`) and shared the same way, so a later request that
   begins as an earlier one did (a system prompt, a chat's next turn)
   copies it too;
4. runs one decode step for every sequence that was past its prompt when the
   step began, in one batch: rows with different histories share it, each
   with its own positions, attending to its own cache slots only (its
   length, not the longest row's, nor the whole context);
5. samples each row's next token, applies stop strings, and returns the text
   pieces made (:class:`Event`); finished sequences leave the batch there.

The cache is one array ``[2 * layers, max_sequences, heads, context, head_dim]``
(a sequence owns one slot row). The rows are kept packed, decoding sequences
first: the decode step hands the decoder ``cache[j, :decoding]`` as it lies
(contiguous views, no copy), and the decoder writes each new token's key and
value into its row in place (its ``present`` outputs are bound to the same
memory as its ``past`` inputs); a sequence that ends
or leaves its prefill moves one row (its own tokens only) to keep the
packing. :class:`~aiworks.runtime.llm_driver.AsyncEngine` drives it from
asyncio: steps run in a thread of the engine's own, never on the event loop,
and each generation is an async iterator whose closing cancels its sequence.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from aiworks.core.errors import InvalidArgument


@dataclass(frozen=True)
class Sampling:
    """How one generation picks tokens: greedy when ``temperature`` is 0."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int = -1  # -1: none; 0: each chosen token's log probability; k: and the k likeliest tokens'
    prompt_logprobs: int = -1  # the same for the prompt's tokens (but its first, which nothing predicts)


LogProb = tuple[int, float, tuple[tuple[int, float], ...]]  # (token id, log probability, the k likeliest (id, lp))

# The engine's default ``share_min_tokens``: below it, reading the tokens again costs about what finding a
# sequence that holds them and copying its rows does.
SHARE_MIN_TOKENS = 16
# The engine's default ``keep_prompts``: finished sequences' rows kept for later prompts that begin alike (each
# the memory of one sequence's row; the default model's is 4.7 MB).
KEEP_PROMPTS = 4
# The engine's default ``aging_s``: a waiting sequence competes as if one class more urgent after this long (the
# runtime's one-shot queues do the same with ``priority_aging_ms``; generations run for seconds, hence seconds).
AGING_S = 30.0


def prompt_log_probabilities(logits: np.ndarray, tokens: np.ndarray, k: int) -> list[LogProb]:
    """Each of ``tokens``' :class:`LogProb` under the logits row before it (``logits[i]`` predicts ``tokens[i]``)."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    z -= np.log(np.exp(z).sum(axis=1, keepdims=True))
    chosen = z[np.arange(len(tokens)), tokens]
    out = []
    for i, token in enumerate(tokens.tolist()):
        top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            best = np.argpartition(z[i], -min(k, z.shape[1]))[-k:]
            best = best[np.argsort(-z[i, best], kind="stable")]
            top = tuple((int(j), float(z[i, j])) for j in best)
        out.append((token, float(chosen[i]), top))
    return out


def log_probability(logits: np.ndarray, token: int, k: int) -> LogProb:
    """``token``'s log probability under a row of logits, and the ``k`` likeliest tokens' (likeliest first)."""
    return prompt_log_probabilities(logits[None], np.asarray([token]), k)[0]


def sample(logits: np.ndarray, s: Sampling, rng: np.random.Generator) -> int:
    """One token id from a row of logits per ``s``."""
    if s.temperature <= 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / s.temperature
    if 0 < s.top_k < z.shape[0]:
        cut = np.partition(z, -s.top_k)[-s.top_k]
        z = np.where(z >= cut, z, -np.inf)
    p = np.exp(z - z.max())
    p /= p.sum()
    if s.top_p < 1.0:
        order = np.argsort(-p)
        keep = np.cumsum(p[order]) - p[order] < s.top_p  # the smallest prefix reaching top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(p.shape[0], p=p))


@dataclass(eq=False)
class Sequence:
    """One generation's state; the engine owns it once added."""

    prompt: np.ndarray  # int64 token ids
    sampling: Sampling
    reserve: int  # KV tokens held while admitted
    rng: np.random.Generator
    slot: int = -1
    rank: int = 1  # the request's QoS class (0 realtime, 1 standard, 2 batch): admission order
    due: float = 0.0  # when it was queued, plus aging_s per class below realtime: admission goes by this
    length: int = 0  # tokens in its cache slot
    next_id: int = -1  # the sampled token not yet in the cache
    generated: list[int] = field(default_factory=list)
    emitted: int = 0  # characters of the generated text handed out
    state: str = "waiting"  # waiting, prefill, decode, done
    cancelled: bool = False
    finish_reason: str = ""
    error: str = ""
    heal: bool = False  # the prompt's trailing space was taken off (Engine.prepare)
    reported: int = 0  # generated tokens covered by the events handed out
    logprobs: list = field(default_factory=list)  # one LogProb per generated token, when sampling.logprobs >= 0
    prompt_logprobs: list = field(default_factory=list)  # one per prompt token but the first (prompt_logprobs >= 0)
    carry: np.ndarray | None = None  # the logits after the prompt's chunk read so far (for its next chunk's first)
    pending: LogProb | None = None  # the sampled token's, until _accept takes the token
    head: bytes = b""  # the key to sharing its prompt (Engine.head_of: scope, first ids); b"": shares none
    follows: bool = False  # it may copy another's prompt entries (not when its prompt is scored: it reads it whole)
    reused: int = 0  # prompt tokens whose keys and values were copied from another sequence's row, not computed

    def cached(self) -> np.ndarray:
        """The token ids whose keys and values its cache row holds (the prompt's, then the generated ones')."""
        read = self.prompt.shape[0]
        if self.length <= read:
            return self.prompt[: self.length]
        return np.concatenate([self.prompt, np.asarray(self.generated[: self.length - read], np.int64)])


@dataclass(frozen=True)
class Event:
    """Text a step made for a sequence; ``finished`` with its reason on its last one.

    ``tokens``: the sequence's tokens made since its previous event (more than
    one when text was held back, or when :meth:`~aiworks.runtime.llm_driver.AsyncEngine.generate` joined
    the events of several steps for a consumer that fell behind).
    """

    seq: Sequence
    text: str
    finished: bool = False
    tokens: int = 1
    logprobs: tuple = ()  # the LogProb of each of those tokens, when the sequence asked for them


@dataclass(eq=False)
class Kept:
    """A finished sequence's cache row kept aside (:meth:`Engine._retain`): its sharing key, token ids, row."""

    head: bytes
    tokens: np.ndarray
    row: int


class Engine:
    """See the module docstring. ``runner(ids, positions, seqlens, rows, cache) -> logits`` runs the decoder
    (:class:`aiworks.runtime.llm_backend.OnnxDecoder`) over the given cache rows, writing the new entries."""

    def __init__(
        self, runner, tokenizer, *, layers: int, heads: int, head_dim: int, context: int,
        kv_budget_tokens: int, max_sequences: int, prefill_chunk: int = 64, eos_id: int | None = None,
        share_min_tokens: int = SHARE_MIN_TOKENS, keep_prompts: int = KEEP_PROMPTS, aging_s: float = AGING_S,
    ):  # fmt: skip
        self.runner, self.tokenizer = runner, tokenizer
        # 0: no aging, classes strictly first (a wait of a day per class step is never reached)
        self.aging_s = aging_s if aging_s > 0 else 86400.0
        self.layers, self.context = layers, context
        self.kv_budget_tokens, self.max_sequences = kv_budget_tokens, max_sequences
        self.prefill_chunk = max(1, prefill_chunk)
        self.eos_id = eos_id
        self.share_min_tokens = share_min_tokens  # 0: every prompt is read whole (no sharing)
        self.cache = np.zeros((2 * layers, max_sequences, heads, context, head_dim), np.float32)
        self.keep = max(0, keep_prompts) if share_min_tokens > 0 else 0
        self.kept_cache = np.zeros((2 * layers, self.keep, heads, context, head_dim), np.float32)
        self.kept: list[Kept] = []  # least recently used first
        self._lock = threading.Lock()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in cache-row order: running[i].slot == i, decoding ones first
        self.decoding = 0  # running[:decoding] are past their prompts
        self._decode_rows = 0  # of those, the ones this step decodes (set by prefill_step)
        self.used_tokens = 0
        self.steps = 0
        self.reused_tokens = 0  # prompt tokens copied from another sequence's row (:meth:`_reuse`), all told
        self._spaced: np.ndarray | None = None

    @property
    def free_slots(self) -> int:
        return self.max_sequences - len(self.running)

    # ---- the caller's side (any thread) ----

    def prepare(self, text: str) -> tuple[np.ndarray, bool]:
        """A prompt's token ids, and whether its trailing space was taken off to be healed.

        Byte-level BPE glues a space to the word after it, so a prompt ending
        in one space ("def ") would leave the model a lone space token it
        rarely saw. The space is dropped from the prompt instead and the first
        token is drawn among those that start with a space, which is left out
        of the text handed back.
        """
        if len(text) >= 2 and text.endswith(" ") and not text[-2].isspace():
            return self.encode(text[:-1]), True
        return self.encode(text), False

    def _space_tokens(self) -> np.ndarray:
        if self._spaced is None:
            vocab = self.tokenizer.get_vocab_size()
            self._spaced = np.asarray(
                [self.tokenizer.decode([i], skip_special_tokens=False).startswith(" ") for i in range(vocab)]
            )
        return self._spaced

    def encode(self, text: str) -> np.ndarray:
        ids = self.tokenizer.encode(text).ids
        if not ids:
            ids = [self.eos_id if self.eos_id is not None else 0]
        return np.asarray(ids, dtype=np.int64)

    def add(
        self, prompt: np.ndarray, sampling: Sampling, heal: bool = False, rank: int = 1, scope: str = ""
    ) -> Sequence:
        """Queue a sequence for admission; ``rank`` is its class (lower first), arrival orders one class.
        ``scope`` (the tenant): it shares prompts with sequences of the same scope only (:meth:`head_of`)."""
        n = int(prompt.shape[0])
        if n >= self.context:
            raise InvalidArgument(f"the prompt is {n} tokens; the context window is {self.context} tokens")
        reserve = min(self.context, n + sampling.max_tokens)
        if reserve > self.kv_budget_tokens:
            raise InvalidArgument(
                f"prompt ({n} tokens) + max_tokens ({sampling.max_tokens}) exceed the KV budget of "
                f"{self.kv_budget_tokens} tokens"
            )
        seq = Sequence(prompt, sampling, reserve, np.random.default_rng(sampling.seed), rank=rank)
        seq.head = self.head_of(prompt, scope)
        seq.follows = bool(seq.head) and sampling.prompt_logprobs < 0
        if heal:
            seq.heal, seq.emitted = True, 1  # the first token's leading space is the prompt's
            self._space_tokens()
        with self._lock:
            self._enqueue(seq)
        return seq

    def head_of(self, prompt: np.ndarray, scope: str = "") -> bytes:
        """What a prompt shares by (:meth:`_reuse`): its scope (the tenant) and first ``share_min_tokens`` ids; b""
        for one that shares nothing (too short, or sharing off).

        The scope keeps tenants apart: the copied entries are those a sequence
        would compute itself, but a first token that comes sooner would tell a
        tenant that another one's running prompt begins as its own.
        """
        k = self.share_min_tokens
        return scope.encode() + b"\0" + prompt[:k].tobytes() if 0 < k < prompt.shape[0] else b""

    def _whole(self, seq: Sequence) -> bytes:
        """``seq``'s scope and whole prompt (it has a head): what equal prompts in one batch share."""
        return seq.head + seq.prompt[self.share_min_tokens :].tobytes()

    def holds(self, head: bytes, reserve: int) -> bool:
        """Whether a sequence running or waiting here begins with ``head``, and a new one of ``reserve`` KV
        tokens would be admitted beside the others without waiting for room."""
        with self._lock:
            seqs = [*self.running, *self.waiting]
            held = self.used_tokens + sum(s.reserve for s in self.waiting)
            return (len(seqs) < self.max_sequences and held + reserve <= self.kv_budget_tokens
                    and (any(s.head == head for s in seqs) or any(e.head == head for e in self.kept)))  # fmt: skip

    def _enqueue(self, seq: Sequence) -> None:
        """Put ``seq`` behind every waiting sequence due before it (under the lock): those of its class or a more
        urgent one, and those of a less urgent class that have waited ``aging_s`` per class step more than it."""
        seq.due = time.monotonic() + seq.rank * self.aging_s
        waiting = self.waiting
        at = len(waiting)
        while at > 0 and waiting[at - 1].due > seq.due:  # usually 0 steps: most arrivals share a class
            at -= 1
        waiting.insert(at, seq)

    def cancel(self, seq: Sequence) -> None:
        """Stop ``seq``; a waiting one leaves now, a running one before the next step."""
        with self._lock:
            seq.cancelled = True
            if seq.state == "waiting":
                try:
                    self.waiting.remove(seq)
                except ValueError:
                    pass
                seq.state, seq.finish_reason = "done", "cancelled"

    def fail_all(self, reason: str) -> list[Event]:
        """End every sequence (after a failed step): their last events, with ``reason``."""
        with self._lock:
            seqs = list(self.running) + list(self.waiting)
            self.running.clear()
            self.waiting.clear()
            self.decoding = 0
            for seq in seqs:
                if seq.slot >= 0:
                    self.used_tokens -= seq.reserve
                    seq.slot = -1
                seq.state, seq.finish_reason, seq.error = "done", "error", reason
        return [Event(seq, "", True) for seq in seqs]

    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def waiting_by_rank(self) -> tuple[int, int, int]:
        """Sequences waiting for room, by class (realtime, standard, batch): what a new one waits behind."""
        counts = [0, 0, 0]
        with self._lock:
            for seq in self.waiting:
                counts[min(max(seq.rank, 0), 2)] += 1
        return counts[0], counts[1], counts[2]

    def load(self) -> tuple[int, int]:
        """KV tokens held or asked for (the running and waiting sequences' reservations), and those sequences."""
        with self._lock:
            return self.used_tokens + sum(s.reserve for s in self.waiting), len(self.running) + len(self.waiting)

    # ---- the step (one thread) ----

    def _move(self, src: int, dst: int) -> None:
        """Move the sequence in cache row ``src`` to row ``dst`` (its own tokens only)."""
        seq = self.running[src]
        self.cache[:, dst, :, : seq.length] = self.cache[:, src, :, : seq.length]
        self.running[dst], seq.slot = seq, dst

    def _release(self, seq: Sequence, reason: str) -> None:
        """Take a running ``seq`` out (lock held): its row and budget come back; the rows stay packed."""
        at, last = seq.slot, len(self.running) - 1
        if at < self.decoding:  # a decoding row: the last decoding one fills its place
            self.decoding -= 1
            if at != self.decoding:
                self._move(self.decoding, at)
            at = self.decoding
        if at != last:  # the last row (prefill) fills the hole
            self._move(last, at)
        self.running.pop()
        self.used_tokens -= seq.reserve
        seq.slot = -1
        seq.state, seq.finish_reason = "done", reason

    def _to_decode(self, seq: Sequence) -> None:
        """``seq`` has read its prompt: it joins the decoding rows (swapping rows with a prefill one)."""
        at, first = seq.slot, self.decoding
        if at != first:
            other = self.running[first]
            keep = self.cache[:, first, :, : other.length].copy()
            self._move(at, first)
            self.cache[:, at, :, : other.length] = keep
            self.running[at], other.slot = other, at
        self.decoding += 1
        seq.state = "decode"

    def _admit(self) -> None:
        with self._lock:
            for seq in [s for s in self.running if s.cancelled]:
                self._release(seq, "cancelled")
            while (
                self.waiting and len(self.running) < self.max_sequences
                and self.used_tokens + self.waiting[0].reserve <= self.kv_budget_tokens
            ):  # fmt: skip
                seq = self.waiting.popleft()
                seq.slot, seq.state = len(self.running), "prefill"
                self.used_tokens += seq.reserve
                self.running.append(seq)

    def _slots(self, first: int, count: int) -> list[np.ndarray]:
        """Every layer's key and value cache for rows ``first`` .. ``first + count`` (contiguous views)."""
        return [self.cache[j, first : first + count] for j in range(2 * self.layers)]

    def _decode_forward(self, n: int) -> np.ndarray:
        """One token for each of the first ``n`` rows, in one call over their cache rows as they lie: their logits.

        Each row attends to its own ``length`` slots plus the new token, whose
        key and value the decoder writes into slot ``length`` of its row.
        """
        seqs = self.running[:n]
        starts = np.fromiter((s.length for s in seqs), np.int64, n)
        ids = np.fromiter((s.next_id for s in seqs), np.int64, n)[:, None]
        logits = self.runner(ids, starts[:, None], starts.astype(np.int32), np.arange(n), self._slots(0, n))
        for s in seqs:
            s.length += 1
        return logits

    def _forward(self, rows: list[tuple[Sequence, np.ndarray]]) -> list[np.ndarray]:
        """Read prompt chunks of several sequences; each row's logits at its last new token, in ``rows``' order.

        Sequences with no history yet whose cache rows are neighbours go in
        one call, their chunks padded on the right to the longest (padding
        comes after a row's real tokens, so the causal order hides it from
        them; the slots it fills lie past the row's length and are written
        over by its next tokens). A sequence with a history goes alone, as
        the attention operator requires of a chunk of several tokens over a
        cache.
        """
        logits = [None] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: rows[i][0].slot)
        groups: list[list[int]] = []
        for i in order:
            seq = rows[i][0]
            last = rows[groups[-1][-1]][0] if groups else None
            if seq.length == 0 and last is not None and last.length == 0 and last.slot + 1 == seq.slot:
                groups[-1].append(i)
            else:
                groups.append([i])
        for group in groups:
            first = rows[group[0]][0]
            counts = np.asarray([rows[i][1].shape[0] for i in group])
            new, start = int(counts.max()), first.length
            ids = np.zeros((len(group), new), np.int64)
            positions = np.empty((len(group), new), np.int64)
            for k, i in enumerate(group):
                chunk = rows[i][1]
                ids[k, : chunk.shape[0]] = chunk
                positions[k] = start + np.minimum(np.arange(new), chunk.shape[0] - 1)  # padding repeats the last
            seqlens = np.full(len(group), start + new - 1, np.int32)
            # Each row's last new token gives its logits; a row that scores its prompt wants every position's.
            wants = [rows[i][0].sampling.prompt_logprobs >= 0 for i in group]
            flat = np.concatenate([np.arange(k * new, k * new + counts[k]) if wants[k] else [k * new + counts[k] - 1]
                                   for k in range(len(group))]) if any(wants) else np.arange(len(group)) * new + counts - 1  # fmt: skip
            out = self.runner(ids, positions, seqlens, flat.astype(np.int64), self._slots(first.slot, len(group)))
            at = 0
            for k, i in enumerate(group):
                seq, chunk = rows[i]
                if wants[k]:
                    self._score_prompt(seq, chunk, out[at : at + int(counts[k])])
                    at += int(counts[k])
                else:
                    at += 1
                logits[i] = out[at - 1]
                seq.length += int(counts[k])
        return logits

    @staticmethod
    def _score_prompt(seq: Sequence, chunk: np.ndarray, logits: np.ndarray) -> None:
        """The log probabilities of ``chunk``'s tokens (``logits``: at each of its positions), the first one's from
        the chunk before (none for the prompt's first token)."""
        before = logits[:-1] if seq.carry is None else np.concatenate([seq.carry[None], logits[:-1]])
        tokens = chunk[1:] if seq.carry is None else chunk
        seq.prompt_logprobs += prompt_log_probabilities(before, tokens, seq.sampling.prompt_logprobs)
        seq.carry = logits[-1].copy()

    def _copy_prefix(self, src: Sequence | Kept, dst: Sequence, count: int) -> None:
        """``dst`` (nothing read yet) takes the first ``count`` keys and values of ``src`` (a running sequence's
        row, or one kept aside) as its own."""
        if isinstance(src, Kept):
            self.cache[:, dst.slot, :, :count] = self.kept_cache[:, src.row, :, :count]
            with self._lock:  # the most recently used now
                self.kept.remove(src)
                self.kept.append(src)
        else:
            self.cache[:, dst.slot, :, :count] = self.cache[:, src.slot, :, :count]
        dst.length = dst.reused = count
        self.reused_tokens += count

    def _retain(self, seq: Sequence) -> None:
        """Keep a finishing sequence's row aside for later prompts that begin alike, in place of the least recently
        used one kept; unless a row kept already holds all of its tokens (one holding a part of them is replaced)."""
        if not self.keep or not seq.head or seq.length < self.share_min_tokens or seq.slot < 0:
            return
        tokens = seq.cached()
        with self._lock:
            for e in self.kept:
                if e.head != seq.head:
                    continue
                n = min(e.tokens.shape[0], tokens.shape[0])
                if (e.tokens[:n] == tokens[:n]).all():
                    if e.tokens.shape[0] >= tokens.shape[0]:
                        self.kept.remove(e)
                        self.kept.append(e)
                        return
                    self.kept.remove(e)
                    row = e.row
                    break
            else:
                row = len(self.kept) if len(self.kept) < self.keep else self.kept.pop(0).row
        n = tokens.shape[0]
        self.kept_cache[:, row, :, :n] = self.cache[:, seq.slot, :, :n]
        with self._lock:
            self.kept.append(Kept(seq.head, tokens.copy(), row))

    def _reuse(self, seq: Sequence, donors: list[Sequence]) -> None:
        """Before ``seq`` reads anything: copy the longest prefix of its prompt that the row of one of ``donors``
        (running sequences that have read at least its first ``share_min_tokens`` tokens) or of a row kept aside
        holds, its last token left to read, so that its logits come out.

        Keys and values at a position depend on the tokens up to it only, so
        the copied ones are those ``seq`` would compute. The other row is read
        as it lies now (this thread is the only one that writes the cache).
        """
        best, donor = 0, None
        for other in [*donors, *(e for e in self.kept if e.head == seq.head)]:
            held = other.tokens if isinstance(other, Kept) else other.cached()
            n = min(held.shape[0], seq.prompt.shape[0] - 1)
            same = held[:n] == seq.prompt[:n]
            common = n if same.all() else int(same.argmin())
            if common > best:
                best, donor = common, other
        if donor is not None and best >= self.share_min_tokens:
            self._copy_prefix(donor, seq, best)

    def _prefill(self, filling: list[Sequence]) -> list[tuple[Sequence, int]]:
        """Feed prompt chunks, at most ``prefill_chunk`` tokens in all, oldest first: (sequence, first token)
        for each whose prompt is now in. A sequence whose whole prompt equals one read whole in this batch
        (both from its start) reads nothing: it copies that one's row and its logits after the call. One that
        only begins as a prompt this batch starts to read waits a step, then copies that beginning
        (:meth:`_reuse`) instead of reading it beside it."""
        rows, budget = [], self.prefill_chunk
        leaders: dict[bytes, int] = {}  # a prompt read whole from its start in this batch -> its row in ``rows``
        followers: list[tuple[Sequence, int]] = []
        donors: dict[bytes, list[Sequence]] = {}
        if any(seq.follows and seq.length == 0 for seq in filling):
            for other in self.running:  # (a sequence that has read nothing is no donor)
                if other.head and other.length >= self.share_min_tokens:
                    donors.setdefault(other.head, []).append(other)
        reading: set[bytes] = set()  # the heads of prompts this batch starts to read (their first tokens at least)
        for seq in filling:
            if seq.length == 0 and seq.follows:
                if seq.head in donors or any(e.head == seq.head for e in self.kept):
                    self._reuse(seq, donors.get(seq.head, []))
                if seq.length == 0:
                    at = leaders.get(self._whole(seq))
                    if at is not None:
                        followers.append((seq, at))
                        continue
                    if seq.head in reading:  # it begins as one read now: it copies that beginning next step
                        continue
            if budget <= 0:
                continue  # a later one may still follow a prompt read in this batch
            chunk = seq.prompt[seq.length : seq.length + budget]
            if seq.length == 0 and seq.head and chunk.shape[0] >= self.share_min_tokens:  # a leader may be scored
                reading.add(seq.head)
                if chunk.shape[0] == seq.prompt.shape[0]:
                    leaders.setdefault(self._whole(seq), len(rows))
            rows.append((seq, chunk))
            budget -= chunk.shape[0]
        if not rows:
            return []
        logits = self._forward(rows)
        for seq, at in followers:  # before any row moves (_to_decode below)
            self._copy_prefix(rows[at][0], seq, seq.prompt.shape[0])
        rows += [(seq, None) for seq, _ in followers]
        logits += [logits[at] for _, at in followers]
        firsts = []
        for (seq, _), row in zip(rows, logits):
            if seq.length >= seq.prompt.shape[0]:
                with self._lock:
                    self._to_decode(seq)
                if seq.heal:
                    row = np.where(self._space_tokens(), row, -np.inf)
                firsts.append((seq, self._sample(seq, row)))
        return firsts

    @staticmethod
    def _sample(seq: Sequence, row: np.ndarray) -> int:
        token = sample(row, seq.sampling, seq.rng)
        if seq.sampling.logprobs >= 0:
            seq.pending = log_probability(row, token, seq.sampling.logprobs)
        return token

    def _decode(self, batch: list[Sequence]) -> list[int]:
        logits = self._decode_forward(len(batch))
        return [self._sample(s, row) for row, s in zip(logits, batch)]

    def _accept(self, seq: Sequence, token: int) -> Event | None:
        """Take ``token`` into ``seq``: the text it releases, and whether the sequence is done."""
        s = seq.sampling
        reason = ""
        if s.max_tokens == 0:  # a prompt scored only (prompt_logprobs): it ends once read, nothing generated
            self._retain(seq)
            with self._lock:
                self._release(seq, "length")
            return Event(seq, "", True, 0)
        if token == self.eos_id and not s.ignore_eos:
            reason = "stop"
        else:
            seq.generated.append(token)
            seq.next_id = token
            if seq.pending is not None:
                seq.logprobs.append(seq.pending)
            if len(seq.generated) >= s.max_tokens:
                reason = "length"
            elif seq.length + 1 >= self.context:
                reason = "length"
        text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        end = len(text)
        for stop in s.stop:
            at = text.find(stop, max(int(seq.heal), seq.emitted - len(stop) + 1))  # not in a healed space
            if at >= 0 and at < end:
                end, reason = at, "stop"
        if not reason:
            end = len(text.rstrip("\ufffd"))  # an incomplete UTF-8 character waits for its next bytes
            for stop in s.stop:  # so does text that may be the start of a stop string
                for k in range(min(len(stop) - 1, end), 0, -1):
                    if text[:end].endswith(stop[:k]):
                        end = min(end, len(text[:end]) - k)
                        break
        piece = text[seq.emitted : max(end, seq.emitted)]
        seq.emitted = max(end, seq.emitted)
        if not reason and not piece:
            return None
        since, seq.reported = seq.reported, len(seq.generated)
        tokens, logprobs = seq.reported - since, tuple(seq.logprobs[since:]) if seq.pending is not None else ()
        if reason:
            self._retain(seq)
            with self._lock:
                self._release(seq, reason)
            return Event(seq, piece, True, tokens, logprobs)
        return Event(seq, piece, False, tokens, logprobs)

    def step(self) -> list[Event]:
        """One iteration (see the module docstring): the text pieces it made."""
        return self.prefill_step() + self.decode_step()

    def prefilling(self) -> bool:
        """Whether the next step has prompt work (sequences waiting or reading their prompts)."""
        return bool(self.waiting) or self.decoding < len(self.running)

    def prefill_step(self) -> list[Event]:
        """A step's first half: admission, one prefill batch, and the first tokens of prompts now read.

        The rows decoding before it are the ones :meth:`decode_step` runs next;
        the sequences it moves to decoding wait for the following step. Its
        events can be handed out before the decode batch runs, so a new
        sequence's first token does not wait for everyone's next one.
        """
        self._admit()
        self._decode_rows = self.decoding
        events = [self._accept(seq, token) for seq, token in self._prefill(self.running[self.decoding :])]
        return [e for e in events if e is not None]

    def decode_step(self) -> list[Event]:
        """A step's second half: one token for each sequence that was decoding when the step began."""
        n, self._decode_rows = self._decode_rows, 0
        events = []
        if n:
            batch = self.running[:n]
            for seq, token in zip(batch, self._decode(batch)):
                events.append(self._accept(seq, token))
        self.steps += 1
        return [e for e in events if e is not None]
