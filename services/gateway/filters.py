"""Input filtering: refuse what should not reach a model, before it costs quota or a queue slot.

Each rule raises a 4xx whose message names the input, the element where it
applies, and the rule, so a client can fix its request without guessing:

============================  ======  =====================================================
rule                          status  configured by
============================  ======  =====================================================
``max_request_bytes``         413     the gateway's limit, or the tenant's (tenants file)
``max_tensor_elements``       413     gateway setting
``max_string_bytes``          413     gateway setting (longest BYTES element, in bytes)
datatype and shape            400     the model's metadata (:func:`check_inputs`)
``reject_nonfinite``          400     model config parameter ``reject_nonfinite: "true"``
deny-list                     400     ``filters.deny_patterns`` in the tenants file
============================  ======  =====================================================

Nothing is copied to check it: float inputs are read through ``np.frombuffer``
views (the NaN/Inf test allocates one boolean per element, no copy of the
data), and BYTES elements are matched as memoryview slices of the request.
Deny-list patterns are bytes regexes compiled once at start-up; they match
the UTF-8 bytes of each element (``\\d``, ``\\w`` and case folding are ASCII;
literal non-ASCII text matches as written).

The scheduler checks inputs against the model again for every gateway; the
gateway's check here only lets a bad request fail before it is admitted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import numpy as np
from aiworks.gateway.masking import BUILTIN_PATTERNS, builtin_pattern, compile_pattern

from aiworks.core.datatypes import NUMPY_DTYPES, bytes_offsets, element_count
from aiworks.core.errors import InvalidArgument, PayloadTooLarge
from aiworks.core.inference import InferRequest
from aiworks.core.model_config import ModelSpec, check_inputs

PARAM_REJECT_NONFINITE = "reject_nonfinite"
_FLOAT_TYPES = frozenset({"FP16", "FP32", "FP64"})
_TRUE = frozenset({"true", "1", "yes", "on"})


def compile_deny_list(patterns: Mapping[str, str | None], where: str = "deny_patterns") -> dict[str, re.Pattern[bytes]]:
    """Named deny-list patterns, compiled; a name with no regex refers to a built-in pattern."""
    compiled: dict[str, re.Pattern[bytes]] = {}
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
        max_tensor_elements: int | None = None,
        max_string_bytes: int | None = None,
        deny_patterns: Mapping[str, re.Pattern[bytes]] | None = None,
    ):
        self.max_tensor_elements = max_tensor_elements
        self.max_string_bytes = max_string_bytes
        self.deny_patterns = list((deny_patterns or {}).items())

    def check(self, request: InferRequest, spec: ModelSpec, *, against_metadata: bool = True) -> int:
        """Apply every rule to ``request`` for model version ``spec``; return its batch rows.

        ``against_metadata=False`` leaves the datatype and shape check to the
        scheduler, which makes it anyway: the gateway's demo mode, where no
        quota is at stake, does so.
        """
        if self.max_tensor_elements is not None:
            for tensor in request.inputs:
                count = element_count(tensor.shape)
                if count > self.max_tensor_elements:
                    raise PayloadTooLarge(
                        f"input '{tensor.name}' has {count} elements, more than the limit of "
                        f"{self.max_tensor_elements} (rule max_tensor_elements)"
                    )
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
