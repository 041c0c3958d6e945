"""Input filtering: refuse what should not reach a model, before it costs quota or a queue slot.

Each rule raises a 4xx whose message names the input, the element where it
applies, and the rule, so a client can fix its request without guessing:

============================  ======  =====================================================
rule                          status  configured by
============================  ======  =====================================================
``max_request_bytes``         413     the gateway's limit, or the tenant's (tenants file)
``max_request_tensors``       413     gateway setting (inputs, and requested outputs)
``max_listed_values``         413     gateway setting (values given one by one)
``max_tensor_elements``       413     gateway setting (one input)
``max_request_elements``      413     gateway setting (all inputs of a request)
``max_string_elements``       413     gateway setting (BYTES elements of a request)
``max_string_bytes``          413     gateway setting (longest BYTES element, in bytes)
datatype and shape            400     the model's metadata (:func:`check_inputs`)
``reject_nonfinite``          400     model config parameter ``reject_nonfinite: "true"``
deny-list                     400     ``filters.deny_patterns`` in the tenants file
============================  ======  =====================================================

The caps down to ``max_string_elements`` are :class:`InputLimits`: they are
checked on what a request declares (its tensor count, the shapes in its
header, how many values its JSON holds) before any of its tensor data is
decoded, so a hostile body costs no more than reading its header.

Nothing is copied to check it: float inputs are read through ``np.frombuffer``
views (the NaN/Inf test allocates one boolean per element, no copy of the
data), and BYTES elements are matched as memoryview slices of the request.
Deny-list patterns are bytes regexes compiled once at start-up (custom ones
with RE2, so matching stays linear in the text whatever the pattern; see
:mod:`aiworks.gateway.masking`); they match the UTF-8 bytes of each element (``\\d``, ``\\w`` and case folding are ASCII;
literal non-ASCII text matches as written).

The scheduler checks inputs against the model again for every gateway; the
gateway's check here only lets a bad request fail before it is admitted.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import numpy as np

from aiworks.core.datatypes import NUMPY_DTYPES, bytes_offsets, element_count, nominal_count
from aiworks.core.errors import InvalidArgument, PayloadTooLarge
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import ModelSpec, check_inputs
from aiworks.gateway.masking import BUILTIN_PATTERNS, TextPattern, builtin_pattern, compile_pattern

PARAM_REJECT_NONFINITE = "reject_nonfinite"
_FLOAT_TYPES = frozenset({"FP16", "FP32", "FP64"})
_TRUE = frozenset({"true", "1", "yes", "on"})

# Defaults of the caps (docs/security.md, "Hostile input", says why each is what it is).
MI = 1 << 20
DEFAULT_MAX_TENSOR_ELEMENTS = 64 * MI
DEFAULT_MAX_REQUEST_ELEMENTS = 128 * MI
DEFAULT_MAX_STRING_ELEMENTS = 1 * MI
DEFAULT_MAX_LISTED_VALUES = 1 * MI
DEFAULT_MAX_REQUEST_TENSORS = 1024
MAX_PARAMETERS = 256  # request parameters; the protocol's clients send a handful


def class_count(value, output: str) -> int:
    """A requested output's ``classification`` parameter (Triton's class count): an integer N > 0."""
    if type(value) is not int or value <= 0:
        raise InvalidArgument(
            f"output '{output[:64]}': parameter 'classification' must be a positive integer, not {str(value)[:40]!r}"
        )
    return value


def _shown(shape) -> list:
    return list(shape) if len(shape) <= 8 else [*shape[:8], "..."]


@dataclass(frozen=True, slots=True)
class InputLimits:
    """Caps on what a request declares, checked before its tensor data is decoded; None: no cap."""

    max_tensor_elements: int | None = DEFAULT_MAX_TENSOR_ELEMENTS
    max_request_elements: int | None = DEFAULT_MAX_REQUEST_ELEMENTS
    max_string_elements: int | None = DEFAULT_MAX_STRING_ELEMENTS
    max_listed_values: int | None = DEFAULT_MAX_LISTED_VALUES
    max_request_tensors: int | None = DEFAULT_MAX_REQUEST_TENSORS

    def check_tensor_count(self, inputs: int, outputs: int = 0) -> None:
        """Refuse more inputs (or requested outputs) than ``max_request_tensors``, before looking at any."""
        limit = self.max_request_tensors
        if limit is not None and max(inputs, outputs) > limit:
            what = "inputs" if inputs > limit else "requested outputs"
            raise PayloadTooLarge(
                f"the request has {max(inputs, outputs)} {what}, more than the limit of {limit} "
                "(rule max_request_tensors)"
            )

    def check_listed(self, values: int, where: str) -> None:
        """Refuse more than ``max_listed_values`` values given one by one (JSON, typed gRPC contents)."""
        limit = self.max_listed_values
        if limit is not None and values > limit:
            raise PayloadTooLarge(
                f"{where} holds {values} values, more than the limit of {limit} (rule max_listed_values); "
                "send large tensors as binary data (raw_input_contents, or Inference-Header-Content-Length)"
            )

    def check_shapes(self, request: InferRequest) -> None:
        """The element caps, on the shapes the request declares (zero dims count as 1, see nominal_count)."""
        total = strings = 0
        per_tensor = self.max_tensor_elements
        for tensor in request.inputs:
            count = nominal_count(tensor.shape)
            if per_tensor is not None and count > per_tensor:
                real = element_count(tensor.shape)
                has = f"{count} elements" if real == count else f"shape {_shown(tensor.shape)}, sized as {count} elements"
                raise PayloadTooLarge(
                    f"input '{tensor.name}' has {has}, more than the limit of {per_tensor} (rule max_tensor_elements)"
                )
            total += count
            if tensor.datatype == "BYTES":
                strings += count
        if self.max_request_elements is not None and total > self.max_request_elements:
            raise PayloadTooLarge(
                f"the request's inputs have {total} elements, more than the limit of {self.max_request_elements} "
                "(rule max_request_elements)"
            )
        if self.max_string_elements is not None and strings > self.max_string_elements:
            raise PayloadTooLarge(
                f"the request's BYTES inputs have {strings} elements, more than the limit of "
                f"{self.max_string_elements} (rule max_string_elements)"
            )


def compile_deny_list(patterns: Mapping[str, str | None], where: str = "deny_patterns") -> dict[str, TextPattern]:
    """Named deny-list patterns, compiled (custom ones with RE2: linear time); a name with no regex is a built-in."""
    compiled: dict[str, TextPattern] = {}
    for name, source in patterns.items():
        if source is None or source == "":
            builtin = builtin_pattern(name)
            if builtin is None:
                raise InvalidArgument(
                    f"{where}: pattern '{name}' has no regex and is not a built-in pattern ({sorted(BUILTIN_PATTERNS)})"
                )
            compiled[name] = builtin
        else:
            compiled[name] = compile_pattern(name, source, where)
    return compiled


def rejects_nonfinite(spec: ModelSpec) -> bool:
    return spec.parameters.get(PARAM_REJECT_NONFINITE, "").strip().lower() in _TRUE


def check_body_size(size: int, limit: int, tenant_id: str = "") -> None:
    """Refuse a body over ``limit`` bytes (the tenant's, when it has a lower one)."""
    if size > limit:
        whose = f" for tenant '{tenant_id}'" if tenant_id else ""
        raise PayloadTooLarge(
            f"request body of {size} bytes exceeds the limit of {limit} bytes{whose} (rule max_request_bytes)"
        )


class InputFilter:
    """The gateway's input rules, compiled once and applied to every request."""

    def __init__(
        self,
        *,
        limits: InputLimits | None = None,
        max_tensor_elements: int | None = DEFAULT_MAX_TENSOR_ELEMENTS,
        max_string_bytes: int | None = None,
        deny_patterns: Mapping[str, TextPattern] | None = None,
    ):
        self.limits = limits if limits is not None else InputLimits(max_tensor_elements=max_tensor_elements)
        self.max_string_bytes = max_string_bytes
        self.deny_patterns = list((deny_patterns or {}).items())

    def check_bounds(self, request: InferRequest) -> None:
        """The caps of :class:`InputLimits` on the request's header; nothing of its data is read."""
        self.limits.check_tensor_count(len(request.inputs), len(request.outputs))
        self.limits.check_shapes(request)

    def check(self, request: InferRequest, spec: ModelSpec, *, against_metadata: bool = True) -> int:
        """Apply every rule to ``request`` for model version ``spec``; return its batch rows.

        ``against_metadata=False`` leaves the datatype and shape check to the
        scheduler, which makes it anyway: the gateway's demo mode, where no
        quota is at stake, does so.
        """
        self.check_bounds(request)  # the data plane checked them before decoding; callers of check alone too
        if against_metadata:
            rows = check_inputs(spec, request.inputs)  # datatype, shape, data size against the metadata
        else:
            shape = request.inputs[0].shape if request.inputs else ()
            rows = shape[0] if spec.max_batch_size > 0 and shape else 1
        nonfinite = rejects_nonfinite(spec)
        scan_bytes = self.max_string_bytes is not None or bool(self.deny_patterns)
        for tensor in request.inputs:
            if nonfinite and tensor.datatype in _FLOAT_TYPES:
                self._check_finite(tensor.name, tensor.raw, tensor.datatype, spec.name)
            elif scan_bytes and tensor.datatype == "BYTES":
                self._check_bytes(tensor.name, tensor.raw)
        return rows

    @staticmethod
    def _check_finite(name: str, raw, datatype: str, model: str) -> None:
        dtype = NUMPY_DTYPES[datatype]
        if len(raw) % dtype.itemsize:  # malformed, and not checked against the metadata: the scheduler says so
            return
        values = np.frombuffer(raw, dtype=dtype)  # a view of the request's bytes
        finite = np.isfinite(values)
        if finite.all():
            return
        index = int(np.argmin(finite))
        value = values[index]
        kind = "NaN" if np.isnan(value) else ("+Inf" if value > 0 else "-Inf")
        raise InvalidArgument(
            f"input '{name}' element {index} is {kind}; model '{model}' rejects non-finite values "
            f"(rule {PARAM_REJECT_NONFINITE})"
        )

    def _check_bytes(self, name: str, raw) -> None:
        view = memoryview(raw)
        offsets = bytes_offsets(view, name=name)
        limit = self.max_string_bytes
        for index, (start, end) in enumerate(zip(offsets, offsets[1:])):
            length = end - start - 4
            if limit is not None and length > limit:
                raise PayloadTooLarge(
                    f"input '{name}' element {index} is {length} bytes, longer than the limit of {limit} bytes "
                    f"(rule max_string_bytes)"
                )
            if self.deny_patterns:
                element = view[start + 4 : end]
                for pattern_name, pattern in self.deny_patterns:
                    if pattern.search(element) is not None:
                        raise InvalidArgument(
                            f"input '{name}' element {index} matches deny-list pattern '{pattern_name}'"
                        )


async def read_body(stream: AsyncIterator[bytes], declared: str | None, limit: int, tenant_id: str = "") -> bytes:
    """The request body, refusing more than ``limit`` bytes before reading them all.

    ``declared`` is the Content-Length header, when there is one.
    """
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise InvalidArgument(f"Content-Length '{declared}' is not an integer") from None
        check_body_size(size, limit, tenant_id)
    chunks = []
    total = 0
    async for chunk in stream:
        total += len(chunk)
        if total > limit:
            whose = f" for tenant '{tenant_id}'" if tenant_id else ""
            raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes{whose} (rule max_request_bytes)")
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
