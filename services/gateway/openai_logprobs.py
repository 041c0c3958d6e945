"""Log probabilities on the OpenAI routes: the request's fields, and the answers' ``logprobs`` objects.

The ``llm`` backend lists, when asked (its ``logprobs`` parameter, the number
of likeliest tokens to add beside each chosen one), a ``[text, bytes,
logprob, top]`` entry per token on each response (``top``: ``[text, bytes,
logprob]`` each). This module turns the two APIs' request fields into that
parameter and those entries into their answers:

- chat: ``logprobs: true`` and ``top_logprobs`` 0..20; a choice's (or a
  chunk's) ``logprobs`` is ``{"content": [{"token", "logprob", "bytes",
  "top_logprobs": [...]}], "refusal": null}``;
- completions: ``logprobs`` 0..5; a choice's (or a chunk's) ``logprobs`` is
  ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where
  ``top_logprobs`` maps the likeliest tokens and the chosen one to their log
  probabilities (so ``logprobs + 1`` of them at most, as OpenAI's) and
  ``text_offset`` is each token's character offset in the choice's text.

A completion's ``echo`` with ``logprobs`` also scores the prompt: the
backend's ``prompt_logprobs`` parameter, whose entries come first, the
prompt's first token with ``null`` (nothing predicts it), as OpenAI's; with
``max_tokens`` 1 (or 0, the prompt alone) that is how evaluation harnesses read a text's likelihood.
"""

from __future__ import annotations

import orjson

from aiworks.core.errors import InvalidArgument

MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETIONS = 5


def _whole(value, name: str, high: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= high:
        raise InvalidArgument(f"'{name}' must be an integer from 0 to {high}")
    return value


def requested(doc: dict, chat: bool) -> int | None:
    """The backend's ``logprobs`` parameter an OpenAI request asks for, or None for none."""
    if chat:
        asked, top = doc.get("logprobs"), doc.get("top_logprobs")
        if asked is not None and not isinstance(asked, bool):
            raise InvalidArgument("'logprobs' must be a boolean")
        if top is not None and not asked:
            raise InvalidArgument("'top_logprobs' needs 'logprobs': true")
        return _whole(top, "top_logprobs", MAX_TOP_LOGPROBS_CHAT) if top is not None else (0 if asked else None)
    asked = doc.get("logprobs")
    if asked is None:
        return None
    return _whole(asked, "logprobs", MAX_LOGPROBS_COMPLETIONS)


def entries(response, name: str = "logprobs") -> list:
    """The backend's per-token entries on one response (none when it carries none); ``prompt_logprobs``: the
    prompt's, on the first."""
    raw = response.parameters.get(name) if response is not None else None
    return orjson.loads(raw) if raw else []


def chat_logprobs(items: list) -> dict:
    def one(text: str, raw: list, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": raw}

    return {"content": [{**one(t, b, lp), "top_logprobs": [one(*alt) for alt in top]} for t, b, lp, top in items],
            "refusal": None}  # fmt: skip


class CompletionLogprobs:
    """One completion choice's ``logprobs`` objects, chunk by chunk: each token's offset follows the last's."""

    def __init__(self, offset: int = 0):
        self.offset = offset

    def chunk(self, items: list) -> dict:
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for text, _, lp, top in items:
            out["tokens"].append(text)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({**{alt[0]: alt[2] for alt in top}, text: lp} if lp is not None else None)
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
