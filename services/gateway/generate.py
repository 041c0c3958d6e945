"""Triton's generate extension: ``POST /v2/models/{m}[/versions/{v}]/generate`` and ``/generate_stream``.

The request is ``{"text_input": "...", "parameters": {...}}``; any other
top-level field is a parameter too (as the extension allows). Parameters are
the model's (the ``llm`` backend's sampling settings: ``max_tokens``,
``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop``, ``ignore_eos``)
besides the gateway's own (``priority``, ``timeout``); ``stream`` is
accepted and ignored, the route decides. A ``stop`` list travels as JSON.

``/generate`` answers once: ``{"model_name", "model_version", "text_output"}``
with the whole text (and ``logprobs`` and ``prompt_logprobs``, the backend's
per-token entries, when those parameters asked for them). ``/generate_stream`` answers as server-sent events, one
``data:`` object of that shape per piece of text, as it is made. An error
before the first piece is a plain JSON error with its status (400 for bad
input); one after it is a last ``data: {"error": ...}`` event.

The generation runs in a task of its own (:class:`Generation`), which owns
the request's telemetry; closing the event stream (the client went away)
cancels the task, which cancels the sequence at its replica. A non-streamed
call (``/generate``, the OpenAI routes without ``stream``) watches its
connection while it waits (:func:`cancel_on_disconnect`): a client that goes
away before the answer cancels the sequence as well, and gets no answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping

import orjson

from aiworks.core.datatypes import Tensor, deserialize_bytes, serialize_items
from aiworks.core.errors import AIWorksError, InvalidArgument
from aiworks.core.inference import InferRequest, InferResponse
from aiworks.gateway.dataplane import GatewayDataPlane
from aiworks.gateway.filters import read_body
from aiworks.gateway.telemetry import REQUEST_ID_HEADER
from aiworks.gateway.tenancy_layer import request_limit
from aiworks.gateway.token_budget import TokenCount

TEXT_INPUT, TEXT_OUTPUT = "text_input", "text_output"
ROUTE_PARAMETERS = frozenset({"stream"})  # the route says whether it streams
SCORES = ("logprobs", "prompt_logprobs")  # the llm backend's per-token entries, answered as they come


def parse_generate(body: bytes, model: str, version: str) -> InferRequest:
    """A generate request body as an inference request with one BYTES input."""
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidArgument(f"the generate request is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise InvalidArgument("the generate request must be a JSON object")
    text = doc.pop(TEXT_INPUT, None)
    if not isinstance(text, str):
        raise InvalidArgument(f"the generate request needs '{TEXT_INPUT}', a string")
    params = doc.pop("parameters", None) or {}
    if not isinstance(params, dict):
        raise InvalidArgument("'parameters' must be a JSON object")
    params = {**doc, **params}
    for name in ROUTE_PARAMETERS:
        params.pop(name, None)
    for name, value in params.items():
        if name == "stop" and isinstance(value, list):
            params[name] = orjson.dumps(value).decode()
        elif not isinstance(value, (str, int, float, bool)):
            raise InvalidArgument(f"parameter '{name}' must be a string, number or boolean")
    raw = serialize_items([text.encode("utf-8")])
    return InferRequest(model, version, [Tensor(TEXT_INPUT, "BYTES", (1,), raw)], parameters=params)


def text_of(response: InferResponse) -> str:
    for t in response.outputs:
        if t.name == TEXT_OUTPUT and t.datatype == "BYTES":
            return b"".join(deserialize_bytes(t.raw, 1, name=TEXT_OUTPUT).tolist()).decode("utf-8", "replace")
    return ""


class Generation:
    """One generation running in its own task; its responses come out of :meth:`responses`."""

    def __init__(self, dataplane: GatewayDataPlane, principal, request: InferRequest, headers: Mapping[str, str]):
        self._out: asyncio.Queue = asyncio.Queue()
        self.request = request
        self._task = asyncio.get_running_loop().create_task(self._run(dataplane, principal, request, headers))

    async def _run(self, dataplane, principal, request, headers) -> None:
        try:
            with dataplane.telemetry.infer("http", request.model, request.version, headers) as call:
                call.request_id = headers.get(REQUEST_ID_HEADER, "")
                call.tenant = principal.tenant_id
                call.request = request
                tokens = TokenCount()
                call.generation(tokens)  # its audit line: tokens, finish reason, time to first token
                stream = dataplane.infer_stream(request, principal, None, request_id=call.request_id, tokens=tokens)
                async with contextlib.aclosing(stream) as answers:
                    async for response in answers:
                        if response.final and not response.outputs:
                            call.response = response
                            continue  # the stream's bare final flag: the routes end on their own
                        call.streamed(response)
                        self._out.put_nowait(response)
            self._out.put_nowait(None)
        except AIWorksError as exc:
            self._out.put_nowait(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a failure the table does not know: a 500 without details
            self._out.put_nowait(AIWorksError(f"generation failed: {type(exc).__name__}"))

    async def responses(self) -> AsyncIterator[InferResponse]:
        """The responses as they come; an error raises here. Closing it cancels the generation."""
        try:
            while True:
                item = await self._out.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self.cancel()

    def cancel(self) -> None:
        if not self._task.done():
            self._task.cancel()

    def abandon(self) -> None:
        """The client went away: cancel the generation and end :meth:`responses` with :class:`ClientGone`."""
        self.cancel()
        self._out.put_nowait(ClientGone())


class ClientGone(Exception):
    """A non-streamed call's client closed its connection before the answer."""


CLIENT_GONE_STATUS = 499  # nobody reads it (nginx's "client closed request"); the handler still answers something


@contextlib.asynccontextmanager
async def cancel_on_disconnect(generation: Generation | list[Generation], receive) -> AsyncIterator[None]:
    """While in the block, a disconnect (ASGI ``receive`` answers ``http.disconnect``) abandons ``generation``
    (each of them, given several: the choices of one OpenAI request).

    Use it after the request's body has been read: ``receive`` then answers
    only when the connection closes (or the response is complete).
    """

    async def watch() -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                for one in generation if isinstance(generation, list) else [generation]:
                    one.abandon()
                return

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        yield
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


async def start(dataplane: GatewayDataPlane, max_request_bytes: int, model: str, version: str,
                headers: Mapping[str, str], body_stream) -> Generation:  # fmt: skip
    """Authenticate, authorize, read and parse: a running :class:`Generation`."""
    principal = dataplane.authenticate(headers)  # before a byte of the body is read
    dataplane.authorize(principal, model, version)
    limit = request_limit(principal, max_request_bytes)
    body = await read_body(body_stream, headers.get("content-length"), limit, principal.tenant_id)
    return Generation(dataplane, principal, parse_generate(body, model, version), headers)


async def generate_once(generation: Generation, receive=None) -> dict:
    """The whole text as one generate response; with ``receive`` (ASGI), a disconnect cancels it (ClientGone)."""
    pieces, last = [], None
    scores: dict[str, list] = {name: [] for name in SCORES if name in generation.request.parameters}
    watching = cancel_on_disconnect(generation, receive) if receive is not None else contextlib.nullcontext()
    async with watching, contextlib.aclosing(generation.responses()) as responses:
        async for response in responses:
            pieces.append(text_of(response))
            last = response
            for name, entries in scores.items():
                if name in response.parameters:
                    entries += orjson.loads(response.parameters[name])
    if last is None:
        raise AIWorksError("the model sent no response")
    return {"model_name": last.model, "model_version": last.version, TEXT_OUTPUT: "".join(pieces), **scores}


async def first_and_rest(generation: Generation):
    """(the first response or None, the iterator of the rest): errors before the first raise here."""
    responses = generation.responses()
    try:
        first = await anext(responses)
    except StopAsyncIteration:
        first = None
    except BaseException:
        await responses.aclose()
        raise
    return first, responses


async def sse_events(first: InferResponse | None, rest) -> AsyncIterator[bytes]:
    """``data:`` events of generate responses; a failure after the first is a last error event."""

    def event(doc: dict) -> bytes:
        return b"data: " + orjson.dumps(doc) + b"\n\n"

    def piece(r: InferResponse) -> bytes:
        doc = {"model_name": r.model, "model_version": r.version, TEXT_OUTPUT: text_of(r)}
        for name in SCORES:
            if name in r.parameters:
                doc[name] = orjson.loads(r.parameters[name])
        return event(doc)

    async with contextlib.aclosing(rest) as responses:
        try:
            if first is not None:
                yield piece(first)
            async for r in responses:
                yield piece(r)
        except AIWorksError as exc:
            yield event({"error": exc.message})
