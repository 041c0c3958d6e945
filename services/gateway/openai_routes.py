"""OpenAI-compatible routes: ``/v1/models`` (and ``/v1/models/{model}``), ``/v1/completions``,
``/v1/chat/completions``, ``/v1/embeddings``.

Completions run on the ``llm`` backend; embeddings on a text-embedding model
(one BYTES input, one FP32 output: ``minilm``), ``encoding_format`` float or
base64, at most 64 strings a request. The model tokenizes inside its graph;
one that also answers an INT64 ``token_count`` output (``minilm`` does: its
attention mask's sum per text) gives ``usage.prompt_tokens``, else it is 0.

The official ``openai`` client works unchanged with ``base_url=<gateway>/v1``
and ``api_key`` a tenant's API key (any string in demo mode): the key
arrives as ``Authorization: Bearer``, which the gateway's tenancy checks as
on every other inference route.

- Sampling fields map onto the backend's parameters (``max_tokens``,
  ``temperature`` (OpenAI's default 1), ``top_p``, ``stop``, ``seed``; and
  ``top_k`` and ``ignore_eos``, vLLM's extensions, which the client sends in
  ``extra_body``). Non-zero penalties are refused, as is any field this
  route does not know.
- Log probabilities: chat's ``logprobs`` / ``top_logprobs`` and
  completions' ``logprobs``, in each API's own answer format
  (:mod:`aiworks.gateway.openai_logprobs`). A completion's ``echo`` puts
  its prompt before its text, and with ``logprobs`` its tokens' entries
  before the text's.
- ``n`` (at most :data:`MAX_CHOICES`) runs that many generations of the
  prompt side by side, each its own sequence in the engine (with a
  ``seed``, choice ``i`` samples with ``seed + i``, so they differ and
  repeat). A completion's ``prompt`` may be a list of strings: ``n``
  choices for each, choice ``j`` of prompt ``p`` at index ``p * n + j``, as
  OpenAI numbers them (at most :data:`MAX_GENERATIONS` generations in all).
  Each is metered, limited and audited as a generation of its own (its id
  is the request's with ``-index``); ``usage`` counts each prompt once and
  every choice's tokens, as OpenAI's does, while the tenant's metering and
  tokens-per-minute count each choice's prompt, which its engine reads. Streamed, the choices' chunks interleave as they
  are made, each with its ``index``; one choice's failure ends the answer
  with an error event.
- ``stream: true`` answers as server-sent events of ``text_completion`` /
  ``chat.completion.chunk`` objects ending in ``data: [DONE]``;
  ``stream_options: {"include_usage": true}`` adds the usage chunk.
- ``usage`` counts prompt and completion tokens as the model counted them.
- Errors come as OpenAI's ``{"error": {"message", "type", "param", "code"}}``
  with the status from the one error table.

The chat template is plain: ``"<role>: <content>\\n"`` per message, then
``"assistant:"``; generation stops at a new line that starts another turn.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import numpy as np
import orjson
from fastapi import FastAPI, Request
from starlette.responses import Response, StreamingResponse

from aiworks.core.datatypes import Tensor, serialize_items
from aiworks.core.errors import AIWorksError, InvalidArgument, UnknownModel
from aiworks.core.inference import InferRequest
from aiworks.gateway import generate, openai_logprobs
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.filters import read_body
from aiworks.gateway.http_codec import error_headers
from aiworks.gateway.telemetry import REQUEST_ID_HEADER
from aiworks.gateway.tenancy_layer import request_limit
from aiworks.gateway.token_budget import TOKEN_COUNT_OUTPUT, counted_tokens

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "stream_options", "n",
           "user", "presence_penalty", "frequency_penalty", "logprobs", "ignore_eos"}  # fmt: skip
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "echo"})
CHAT_FIELDS = frozenset(_COMMON | {"messages", "max_completion_tokens", "top_logprobs"})
EMBEDDING_FIELDS = frozenset({"model", "input", "encoding_format", "user"})
MAX_EMBEDDING_INPUTS = 64
MAX_CHOICES = 8  # n: each choice is a generation of its own; the cap bounds what one request may start
MAX_GENERATIONS = 16  # prompts x n in one completions request
CHAT_ROLES = ("system", "user", "assistant")
CHAT_STOP = ["\nuser:", "\nsystem:", "\nassistant:"]

_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "invalid_request_error", 429: "rate_limit_error", 431: "invalid_request_error", 501: "invalid_request_error",
}  # fmt: skip


def openai_error_body(status: int, message: str, code: str = "") -> bytes:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``, the type from the status."""
    return orjson.dumps({"error": {"message": message, "type": _ERROR_TYPES.get(status, "server_error"),
                                   "param": None, "code": code or None}})  # fmt: skip


def openai_error(status: int, message: str, code: str = "", headers: dict | None = None) -> Response:
    return Response(openai_error_body(status, message, code), status_code=status, media_type="application/json",
                    headers=headers)  # fmt: skip


def error_response(exc: AIWorksError) -> Response:
    status, code = exc.status.http, exc.status.name.lower()
    if isinstance(exc, UnknownModel):  # OpenAI answers an unknown model with 404 (Triton's APIs with 400)
        status, code = 404, "model_not_found"
    return openai_error(status, exc.message, code, error_headers(exc))


def _refuse(doc: dict, allowed: frozenset) -> None:
    unknown = sorted(set(doc) - allowed)
    if unknown:
        raise InvalidArgument(f"unrecognized request argument(s): {', '.join(unknown[:4])}")
    n = doc.get("n")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES):
        raise InvalidArgument(f"'n' must be an integer from 1 to {MAX_CHOICES}")
    if doc.get("echo") is not None and not isinstance(doc["echo"], bool):
        raise InvalidArgument("'echo' must be a boolean")
    for name in ("presence_penalty", "frequency_penalty"):
        if doc.get(name):
            raise InvalidArgument(f"'{name}' is not supported (only 0)")


def sampling_parameters(doc: dict, extra_stop: list[str] | None = None) -> dict:
    """The backend's parameters from an OpenAI request's fields."""
    params: dict = {"temperature": doc["temperature"] if doc.get("temperature") is not None else 1.0}
    max_tokens = doc.get("max_completion_tokens", doc.get("max_tokens"))
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    for name in ("top_p", "top_k", "seed", "ignore_eos"):
        if doc.get(name) is not None:
            params[name] = doc[name]
    stop = doc.get("stop")
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    stops += extra_stop or []
    if stops:
        params["stop"] = orjson.dumps(stops).decode()
    for name, value in params.items():
        if isinstance(value, (list, dict)) or value is None:
            raise InvalidArgument(f"'{name}' must be a number")
    return params


def chat_prompt(messages) -> str:
    if not isinstance(messages, list) or not messages:
        raise InvalidArgument("'messages' must be a non-empty list")
    lines = []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES or not isinstance(m.get("content"), str):
            raise InvalidArgument(f"each message needs a role in {list(CHAT_ROLES)} and a string content")
        lines.append(f"{m['role']}: {m['content']}\n")
    return "".join(lines) + "assistant:"


def _request(model: str, prompt: str, params: dict, ident: str) -> InferRequest:
    raw = serialize_items([prompt.encode("utf-8")])
    return InferRequest(model, "", [Tensor(generate.TEXT_INPUT, "BYTES", (1,), raw)], id=ident, parameters=params)


def _usage(firsts: list, lasts: list, n: int = 1) -> dict:
    """Each prompt's tokens once (its ``n`` choices read the same prompt), and every choice's completion tokens;
    the choices of prompt ``p`` are ``firsts[p * n : (p + 1) * n]``. ``prompt_tokens_details.cached_tokens``, as
    OpenAI reports it: of each prompt, the tokens that every one of its choices copied instead of reading
    (docs/generation.md, "Shared prompts"), so the choice that read it for the others counts it as read."""
    prompt = cached = 0
    for at in range(0, len(firsts), n):
        choices = [f for f in firsts[at : at + n] if f is not None]
        prompt += int(choices[0].parameters.get("prompt_tokens", 0)) if choices else 0
        cached += min((int(f.parameters.get("cached_prompt_tokens", 0)) for f in choices), default=0)
    completion = sum(int(last.parameters.get("completion_tokens", 0)) for last in lasts if last is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip


def _choice_parameters(params: dict, index: int) -> dict:
    """Choice ``index``'s parameters: with a seed, its own (``seed + index``), so the choices differ and repeat."""
    if index and "seed" in params:
        return {**params, "seed": int(params["seed"]) + index}
    return params


def _reason(last) -> str:
    return str(last.parameters.get("finish_reason", "stop")) if last is not None else "stop"


async def _merged(starts: list) -> AsyncIterator[tuple[int, object]]:
    """``(choice, response)`` of each choice's rest as it comes, ``(choice, None)`` at a choice's end; an error
    of any choice raises. One choice is read as it is; several are read by a task each, all closed on exit."""
    if len(starts) == 1:
        async with contextlib.aclosing(starts[0][1]) as responses:
            async for r in responses:
                yield 0, r
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, rest) -> None:
        try:
            async with contextlib.aclosing(rest) as responses:
                async for r in responses:
                    queue.put_nowait((index, r))
            queue.put_nowait((index, None))
        except AIWorksError as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.get_running_loop().create_task(pump(i, rest)) for i, (_, rest) in enumerate(starts)]
    try:
        for _ in range(len(starts)):
            while True:
                index, item = await queue.get()
                if isinstance(item, AIWorksError):
                    raise item
                yield index, item
                if item is None:
                    break
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def add_openai_routes(app: FastAPI, dataplane: GatewayDataPlane, max_request_bytes: int) -> None:
    """Register the ``/v1`` routes on the gateway's FastAPI app."""

    async def parse(request: Request, allowed: frozenset):
        principal = dataplane.authenticate(request.headers)  # before a byte of the body is read
        limit = request_limit(principal, max_request_bytes)
        body = await read_body(request.stream(), request.headers.get("content-length"), limit, principal.tenant_id)
        try:
            doc = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise InvalidArgument(f"the request is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("model"), str):
            raise InvalidArgument("the request must be a JSON object with 'model', a string")
        _refuse(doc, allowed)
        dataplane.authorize(principal, doc["model"])
        return principal, doc

    async def run(request: Request, chat: bool) -> Response:
        principal, doc = await parse(request, CHAT_FIELDS if chat else COMPLETION_FIELDS)
        if chat:
            prompts, extra = [chat_prompt(doc.get("messages"))], CHAT_STOP
        else:
            prompt = doc.get("prompt", "")
            prompts = [prompt] if isinstance(prompt, str) else prompt
            if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
                raise InvalidArgument("'prompt' must be a string or a non-empty list of strings")
            extra = None
        params, n = sampling_parameters(doc, extra), doc.get("n") or 1
        top = openai_logprobs.requested(doc, chat)
        if top is not None:
            params["logprobs"] = top
            if doc.get("echo"):  # the prompt is scored too
                params["prompt_logprobs"] = top
        echoes = [prompt for prompt in prompts for _ in range(n)] if doc.get("echo") else None  # by choice index
        if len(prompts) * n > MAX_GENERATIONS:
            raise InvalidArgument(f"{len(prompts)} prompt(s) x n = {n} asks for {len(prompts) * n} generations; at "
                                  f"most {MAX_GENERATIONS} in one request")  # fmt: skip
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"  # the audit's request id without a header
        runs = [
            generate.Generation(dataplane, principal,
                                _request(doc["model"], prompt, _choice_parameters(params, j),
                                         ident if len(prompts) * n == 1 else f"{ident}-{p * n + j}"),
                                request.headers)
            for p, prompt in enumerate(prompts)
            for j in range(n)
        ]  # fmt: skip
        created = int(time.time())
        if doc.get("stream"):
            starts = []
            try:
                for running in runs:  # each choice's first response, or the error that came before it
                    starts.append(await generate.first_and_rest(running))
            except BaseException:
                for _, rest in starts:
                    await rest.aclose()
                for running in runs:  # one choice failed (or was refused): the others stop too
                    running.cancel()
                raise
            include_usage = bool((doc.get("stream_options") or {}).get("include_usage"))
            events = _stream(ident, created, doc["model"], chat, starts, include_usage, n, top is not None, echoes)
            return StreamingResponse(events, media_type="text/event-stream; charset=utf-8")
        tasks = [asyncio.ensure_future(_collect(running, top is not None, bool(echoes))) for running in runs]
        try:
            async with generate.cancel_on_disconnect(runs, request.receive):
                answers = await asyncio.gather(*tasks)
        except generate.ClientGone:  # the sequences are cancelled; nobody reads an answer
            return Response(status_code=generate.CLIENT_GONE_STATUS)
        finally:
            for task in tasks:  # one choice failed (or was refused): closing the others' reads stops them too
                task.cancel()
        choices = []
        for index, (text, _, last, items) in enumerate(answers):
            if chat:
                message = {"role": "assistant", "content": text}
                logprobs = openai_logprobs.chat_logprobs(items) if top is not None else None
                choices.append({"index": index, "message": message, "logprobs": logprobs,
                                "finish_reason": _reason(last)})  # fmt: skip
            else:
                logprobs = openai_logprobs.CompletionLogprobs().chunk(items) if top is not None else None
                text = echoes[index] + text if echoes else text
                choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": _reason(last)})
        usage = _usage([a[1] for a in answers], [a[2] for a in answers], n)
        doc_out = {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": created,
                   "model": doc["model"], "choices": choices, "usage": usage}  # fmt: skip
        return Response(orjson.dumps(doc_out), media_type="application/json")

    async def _collect(running: generate.Generation, logprobs: bool, echo: bool) -> tuple[str, object, object, list]:
        """One choice's whole text, its first and last responses, and (``logprobs``) its tokens' entries (after
        its prompt's, with ``echo``)."""
        pieces, first, last, items = [], None, None, []
        async with contextlib.aclosing(running.responses()) as responses:
            async for r in responses:
                if logprobs and echo and first is None:
                    items += openai_logprobs.entries(r, "prompt_logprobs")
                first = first or r
                last = r
                pieces.append(generate.text_of(r))
                if logprobs:
                    items += openai_logprobs.entries(r)
        return "".join(pieces), first, last, items

    async def _stream(ident, created, model, chat, starts, include_usage, n, logprobs: bool,
                      echoes: list[str] | None) -> AsyncIterator[bytes]:  # fmt: skip
        kind = "chat.completion.chunk" if chat else "text_completion"
        offsets = [openai_logprobs.CompletionLogprobs() for _ in starts] if logprobs and not chat else None

        def chunk(index: int, r, reason: str | None = None, role: bool = False, before: str | None = None) -> bytes:
            text = (before or "") + (generate.text_of(r) if r is not None else "")
            lp = None
            if logprobs and r is not None:
                items = openai_logprobs.entries(r)
                if before is not None:  # the echoed prompt's entries come first
                    items = openai_logprobs.entries(r, "prompt_logprobs") + items
                lp = openai_logprobs.chat_logprobs(items) if chat else offsets[index].chunk(items)
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
                choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": reason}
            else:
                choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": reason}
            doc = {"id": ident, "object": kind, "created": created, "model": model, "choices": [choice]}
            return b"data: " + orjson.dumps(doc) + b"\n\n"

        firsts = [first for first, _ in starts]
        lasts = list(firsts)
        async with contextlib.aclosing(_merged(starts)) as responses:
            try:
                for index, first in enumerate(firsts):
                    if chat:
                        yield chunk(index, None, role=True)
                    if first is not None or echoes:
                        yield chunk(index, first, before=echoes[index] if echoes else None)
                async for index, r in responses:
                    if r is None:  # this choice is done
                        yield chunk(index, None, _reason(lasts[index]))
                        continue
                    lasts[index] = r
                    yield chunk(index, r)
            except AIWorksError as exc:
                yield b"data: " + error_response(exc).body + b"\n\n"
                return
        if include_usage:
            doc = {"id": ident, "object": kind, "created": created, "model": model, "choices": [],
                   "usage": _usage(firsts, lasts, n)}  # fmt: skip
            yield b"data: " + orjson.dumps(doc) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def guarded(call) -> Response:
        try:
            return await call()
        except AIWorksError as exc:
            return error_response(exc)

    def model_object(name: str) -> dict:
        return {"id": name, "object": "model", "created": 0, "owned_by": "aiworks"}

    @app.get("/v1/models")
    async def models(request: Request):
        async def listing():
            index = await dataplane.repository_index(True, request.headers)
            names = dict.fromkeys(m["name"] for m in index)  # one entry per model, not per version
            data = [model_object(name) for name in names]
            return Response(orjson.dumps({"object": "list", "data": data}), media_type="application/json")

        return await guarded(listing)

    @app.get("/v1/models/{model}")
    async def one_model(model: str, request: Request):
        """``client.models.retrieve``: the model if it is ready here for this caller, else OpenAI's 404."""

        async def retrieve():
            index = await dataplane.repository_index(True, request.headers)
            if not any(m["name"] == model for m in index):
                return openai_error(404, f"The model '{model[:200]}' does not exist", "model_not_found")
            return Response(orjson.dumps(model_object(model)), media_type="application/json")

        return await guarded(retrieve)

    async def embed(request: Request) -> Response:
        principal, doc = await parse(request, EMBEDDING_FIELDS)
        texts = doc.get("input")
        texts = [texts] if isinstance(texts, str) else texts
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise InvalidArgument("'input' must be a string or a non-empty list of strings")
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise InvalidArgument(f"'input' has {len(texts)} strings; at most {MAX_EMBEDDING_INPUTS} at once")
        fmt = doc.get("encoding_format") or "float"
        if fmt not in ("float", "base64"):
            raise InvalidArgument("'encoding_format' must be 'float' or 'base64'")
        meta = await dataplane.model_metadata(doc["model"], "", request.headers)
        vectors_out = [o["name"] for o in meta["outputs"] if o["name"] != TOKEN_COUNT_OUTPUT]
        if len(meta["inputs"]) != 1 or meta["inputs"][0]["datatype"] != "BYTES" or len(vectors_out) != 1:
            raise InvalidArgument(f"model '{doc['model']}' is not a text-embedding model (one BYTES input, one output)")
        raw = serialize_items([t.encode("utf-8") for t in texts])
        infer = InferRequest(doc["model"], "", [Tensor(meta["inputs"][0]["name"], "BYTES", (len(texts), 1), raw)])
        with dataplane.telemetry.infer("http", doc["model"], "", request.headers) as call:  # metrics, audit line
            call.request_id = request.headers.get(REQUEST_ID_HEADER, "")
            call.tenant, call.request = principal.tenant_id, infer
            call.response = response = await dataplane.infer(infer, principal, None, api="/v1/embeddings")
        out = next((t for t in response.outputs if t.name == vectors_out[0]), None)
        if out is None or out.datatype != "FP32":
            raise InvalidArgument(f"model '{doc['model']}' does not answer FP32 embeddings")
        vectors = np.frombuffer(out.raw, dtype="<f4").reshape(len(texts), -1)
        data = [
            {"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.tobytes()).decode() if fmt == "base64" else v.tolist()}
            for i, v in enumerate(vectors)
        ]  # fmt: skip
        tokens = counted_tokens(response)  # the model's own count (0 when it gives none)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        body = {"object": "list", "data": data, "model": doc["model"], "usage": usage}
        return Response(orjson.dumps(body), media_type="application/json")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await guarded(lambda: embed(request))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await guarded(lambda: run(request, chat=False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await guarded(lambda: run(request, chat=True))

