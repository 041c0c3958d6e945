"""HTTP compression of inference bodies: ``Content-Encoding`` in, ``Accept-Encoding`` out (gzip, deflate).

tritonclient's ``request_compression_algorithm`` compresses a request's
whole body (JSON header and binary data) and says so in ``Content-Encoding``;
``response_compression_algorithm`` asks for a compressed answer with
``Accept-Encoding``. ``Inference-Header-Content-Length`` always counts the
decompressed body, both ways.

A compressed body is inflated in steps of at most :data:`STEP_BYTES` of
output (``zlib.decompressobj`` with ``max_length``): once the output passes
the caller's body limit the request is refused with 413, so a decompression
bomb costs at most the limit in memory and CPU, never its full size.
Large bodies are inflated, and large answers compressed, in a worker thread:
the event loop keeps answering others (docs/security.md, "Hostile input").
"""

from __future__ import annotations

import zlib

from aiworks.core.errors import AIWorksError, PayloadTooLarge, Status
from aiworks.core.looplag import offload

# Bodies (compressed in, plain out) larger than this are (de)compressed in a worker thread.
OFF_LOOP_BYTES = 64 * 1024
# Most output one inflate step produces; the limit check runs after each.
STEP_BYTES = 1 << 20
# zlib level for answers: speed over ratio, as the answer is on the request's latency.
RESPONSE_LEVEL = 1

ENCODINGS = ("gzip", "deflate")


def _wbits(encoding: str, body: bytes | memoryview) -> int:
    if encoding == "gzip":
        return 16 + zlib.MAX_WBITS
    # "deflate" is the zlib format (RFC 9110), as zlib.compress writes it; some clients send raw deflate.
    if len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] * 256 + body[1]) % 31 == 0:
        return zlib.MAX_WBITS
    return -zlib.MAX_WBITS


def request_encoding(value: str | None) -> str | None:
    """The request's ``Content-Encoding`` as gzip or deflate; None for none or identity; 415 for the rest."""
    if value is None:
        return None
    encoding = value.strip().lower()
    if encoding in ("", "identity"):
        return None
    if encoding in ENCODINGS:
        return encoding
    raise AIWorksError(
        f"Content-Encoding '{value[:40]}' is not supported; use gzip, deflate or identity",
        Status.UNSUPPORTED_MEDIA_TYPE,
    )


def response_encoding(accept: str | None) -> str | None:
    """The encoding to answer with for an ``Accept-Encoding`` header: gzip, then deflate, or None."""
    if not accept:
        return None
    offered = {}
    for item in accept.lower().split(","):
        name, _, params = item.partition(";")
        quality = 1.0
        params = params.strip()
        if params.startswith("q="):
            try:
                quality = float(params[2:])
            except ValueError:
                quality = 0.0
        offered[name.strip()] = quality
    for encoding in ENCODINGS:
        if offered.get(encoding, offered.get("*", 0.0)) > 0:
            return encoding
    return None


def _inflate(body: bytes, encoding: str, limit: int, tenant_id: str) -> bytes:
    inflater = zlib.decompressobj(_wbits(encoding, body))
    chunks = []
    total = 0
    pending = body
    try:
        while True:
            chunk = inflater.decompress(pending, STEP_BYTES)
            total += len(chunk)
            if total > limit:
                whose = f" for tenant '{tenant_id}'" if tenant_id else ""
                raise PayloadTooLarge(
                    f"request body inflates past the limit of {limit} bytes{whose} (rule max_request_bytes; "
                    f"the limit applies to the decompressed body)"
                )
            if chunk:
                chunks.append(chunk)
            pending = inflater.unconsumed_tail
            if inflater.eof or (not pending and not chunk):
                break
        if not inflater.eof:
            raise zlib.error("the compressed data ends early")
    except zlib.error as exc:
        raise AIWorksError(f"request body is not valid {encoding} data: {exc}", Status.INVALID_ARGUMENT) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def inflate(body: bytes, encoding: str, limit: int, tenant_id: str = "") -> bytes:
    """``body`` decompressed, refused with 413 as soon as it passes ``limit`` bytes; 400 if it is not ``encoding``."""
    return await offload(_inflate, body, encoding, limit, tenant_id, large=len(body) > OFF_LOOP_BYTES)


def _deflate(payload: bytes, encoding: str) -> bytes:
    wbits = 16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS
    packer = zlib.compressobj(RESPONSE_LEVEL, zlib.DEFLATED, wbits)
    return packer.compress(payload) + packer.flush()


async def compress(payload: bytes, encoding: str) -> bytes:
    """``payload`` as ``encoding`` (gzip or deflate, zlib format), in a worker thread when it is large."""
    return await offload(_deflate, payload, encoding, large=len(payload) > OFF_LOOP_BYTES)
