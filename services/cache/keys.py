"""Cache keys: a digest of everything that decides a response, and of who may see it.

The key hashes the tenant (unless the model's policy shares entries across
tenants: ``cache_scope: shared``), the model, its *resolved* version, the policy's mode, every
input's name, datatype, shape and bytes (inputs in name order, since their
order in a request does not change the result), the requested outputs in
order, and the request parameters that can change the result (all but
:data:`aiworks.cache.policy.NEUTRAL_PARAMETERS`). Every field is length-prefixed,
so no two different requests can feed the hash the same bytes; per-tenant
and shared keys use different personalisations of the hash, so they never
meet either.

In ``similar`` mode inputs are normalized before hashing:

- FP16/FP32/FP64: rounded to ``round_decimals`` decimals (and -0.0 made 0.0);
- BYTES elements that are UTF-8 text: trimmed, lower-cased, runs of
  whitespace collapsed to one space (other elements are kept as they are);
- every other datatype: exact.

Two inputs share an entry when they normalize to the same bytes. Rounding
bins values, so two values closer than 10^-N can still land in different
bins (0.1234 and 0.1236 at N=3): similar mode hits more often, never on
inputs that differ by more than the rounding.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import orjson

from aiworks.cache.policy import NEUTRAL_PARAMETERS, SIMILAR, CachePolicy
from aiworks.core.datatypes import Tensor, decode, deserialize_bytes, element_count, serialize_bytes

KEY_BYTES = 20
_SHARED_PERSON = b"aiworks-cache-1"  # the keys before tenancy reached the cache: shared entries keep them
_TENANT_PERSON = b"aiworks-cache-t1"
_FLOATS = ("FP16", "FP32", "FP64")


def _field(h, data: bytes | memoryview) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def normalize_text(value: bytes) -> bytes:
    """Trimmed, lower-cased, whitespace collapsed; bytes that are not UTF-8 are kept as they are."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        return value
    return " ".join(text.split()).lower().encode("utf-8")


def normalized_bytes(tensor: Tensor, round_decimals: int) -> bytes | memoryview:
    """The tensor's bytes as similar mode hashes them."""
    if tensor.datatype in _FLOATS:
        array = decode(tensor.raw, tensor.datatype, tensor.shape, name=tensor.name)
        rounded = np.round(array, round_decimals) + array.dtype.type(0.0)
        return rounded.astype(array.dtype, copy=False).tobytes()
    if tensor.datatype == "BYTES":
        elements = deserialize_bytes(tensor.raw, element_count(tensor.shape), name=tensor.name)
        return serialize_bytes(np.array([normalize_text(e) for e in elements], dtype=np.object_))
    return tensor.raw


def request_key(
    model: str,
    version: str,
    inputs: list[Tensor],
    outputs: list[str],
    parameters: dict,
    policy: CachePolicy,
    tenant: str | None = None,
    classification: dict[str, int] | None = None,
) -> bytes:
    """The cache key of one request to ``model`` at its resolved ``version``, within ``tenant``'s entries.

    ``tenant`` None (or a policy with ``shared``) gives the key every tenant
    shares; ``""`` is the anonymous tenant of demo mode, a tenant like any other.
    """
    if tenant is None or policy.shared:
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=_SHARED_PERSON)
    else:
        h = hashlib.blake2b(digest_size=KEY_BYTES, person=_TENANT_PERSON)
        _field(h, tenant.encode())
    _field(h, model.encode())
    _field(h, version.encode())
    _field(h, policy.tag.encode())
    similar = policy.mode == SIMILAR
    _field(h, len(inputs).to_bytes(4, "little"))
    for t in sorted(inputs, key=lambda t: t.name):
        _field(h, t.name.encode())
        _field(h, t.datatype.encode())
        _field(h, struct.pack(f"<{len(t.shape)}q", *t.shape))
        _field(h, normalized_bytes(t, policy.round_decimals) if similar else t.raw)
    _field(h, len(outputs).to_bytes(4, "little"))
    for name in outputs:
        _field(h, name.encode())
    relevant = {k: v for k, v in parameters.items() if k not in NEUTRAL_PARAMETERS}
    _field(h, orjson.dumps(relevant, option=orjson.OPT_SORT_KEYS, default=str) if relevant else b"")
    if classification:  # an output answered as its top classes is another answer than the tensor
        _field(h, orjson.dumps(classification, option=orjson.OPT_SORT_KEYS))
    return h.digest()
