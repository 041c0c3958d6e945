"""Tokens a tenant's generations and text requests draw on its ``max_tokens_per_minute`` (docs/tenancy.md):
the estimate reserved at admission, the count a model reports, and a generation's counts from its
responses. Plain functions of the request, the model's spec and the answers: no transport, no state."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from aiworks.core.datatypes import element_count
from aiworks.core.errors import InvalidArgument
from aiworks.core.inference import InferRequest, InferResponse
from aiworks.core.model_config import ModelSpec


def check_max_tokens(tenant, parameters: dict) -> None:
    """A generation asking for more new tokens than its tenant's ``max_tokens`` cap is refused (400)."""
    cap = tenant.max_tokens
    asked = parameters.get("max_tokens")
    if cap is None or asked is None or isinstance(asked, bool):
        return
    try:
        asked = int(asked)
    except (TypeError, ValueError):
        return  # the model says what is wrong with it
    if asked > cap:
        raise InvalidArgument(f"max_tokens {asked} exceeds tenant '{tenant.id}''s cap of {cap} (rule max_tokens)")


TEXT_INPUT = "text_input"  # a generation's prompt (the llm backend's input, Triton's generate convention)
DEFAULT_MAX_TOKENS = 16  # a generation that names no max_tokens, on a model whose config names no default
PROMPT_BYTES_PER_TOKEN = 4  # the prompt's estimate at admission, before the model has tokenized it


def token_reserve(tenant, spec: ModelSpec, request: InferRequest) -> int:
    """Tokens a generation reserves from its tenant's tokens-per-minute bucket at admission (0: none).

    The prompt's UTF-8 bytes / 4 (rounded up; the model's tokenizer has not
    run yet) plus the ``max_tokens`` it asks for (else the model's
    ``default_max_tokens``), each at most what the model's config allows
    (``context_tokens``, ``max_tokens_cap``): a request the model will refuse
    cannot sink the bucket. The release settles it to what the model counted.
    """
    if tenant.max_tokens_per_minute is None:
        return 0
    prompt = [t for t in request.inputs if t.name == TEXT_INPUT and t.datatype == "BYTES"]
    if not prompt:
        return 0
    # Serialized BYTES: a 4-byte length before each element.
    text_bytes = sum(max(0, len(t.raw) - 4 * element_count(t.shape)) for t in prompt)
    asked = _count(request.parameters.get("max_tokens", spec.parameters.get("default_max_tokens", DEFAULT_MAX_TOKENS)))
    prompt_tokens, asked = -(-text_bytes // PROMPT_BYTES_PER_TOKEN), asked or DEFAULT_MAX_TOKENS
    context, cap = _count(spec.parameters.get("context_tokens")), _count(spec.parameters.get("max_tokens_cap"))
    if context:
        prompt_tokens = min(prompt_tokens, context)
    if cap or context:
        asked = min(asked, cap or context)
    return prompt_tokens + asked


TOKEN_COUNT_OUTPUT = "token_count"  # a text model's tokens per input row (minilm's), metered as prompt tokens
TEXT_MARKS = 2  # tokens a tokenizer adds to each text ([CLS] and [SEP]), in a text's estimate


def text_token_reserve(tenant, spec: ModelSpec, request: InferRequest) -> int:
    """Tokens a request to a text model reserves from its tenant's tokens-per-minute bucket (0: none).

    Only models that count their input's tokens (an INT64 ``token_count``
    output: ``minilm``) draw on the bucket, on every front end. The estimate
    is the BYTES inputs' UTF-8 bytes / 4 (rounded up) plus 2 per text; the
    release settles it to the model's count.
    """
    if tenant.max_tokens_per_minute is None:
        return 0
    if not any(t.name == TOKEN_COUNT_OUTPUT and t.datatype == "INT64" for t in spec.outputs):
        return 0
    texts = [t for t in request.inputs if t.datatype == "BYTES"]
    elements = sum(element_count(t.shape) for t in texts)
    text_bytes = sum(max(0, len(t.raw) - 4 * element_count(t.shape)) for t in texts)  # less each length prefix
    return -(-text_bytes // PROMPT_BYTES_PER_TOKEN) + TEXT_MARKS * elements


def counted_tokens(response: InferResponse) -> int:
    """The tokens a text model says its inputs were: the sum of its INT64 ``token_count`` output (0 without)."""
    for t in response.outputs:
        if t.name == TOKEN_COUNT_OUTPUT and t.datatype == "INT64":
            return int(np.frombuffer(t.raw, dtype="<i8").sum()) if len(t.raw) % 8 == 0 else 0
    return 0


class TokenCount:
    """A generation's token counts from its responses' parameters (the ``llm`` backend's contract).

    ``prompt_tokens`` comes on the first response, ``completion_tokens`` on
    the last. A stream stopped before its last response (the client went
    away) counts the completion tokens of the responses that carried output:
    one each, as each of the backend's responses is one decoding step's text,
    or its ``tokens`` parameter when it joined several steps.
    """

    __slots__ = ("prompt", "completion", "_steps", "_final")

    def __init__(self) -> None:
        self.prompt = self.completion = self._steps = 0
        self._final = False

    def see(self, parameters: Mapping, has_output: bool) -> None:
        if "prompt_tokens" in parameters:
            self.prompt = _count(parameters["prompt_tokens"])
        if has_output:
            self._steps += _count(parameters["tokens"]) if "tokens" in parameters else 1
        if "completion_tokens" in parameters:
            self.completion, self._final = _count(parameters["completion_tokens"]), True
        elif not self._final:
            self.completion = self._steps


def _count(value) -> int:
    try:
        return max(0, int(value))
    except (TypeError, ValueError):
        return 0
