"""Triton's formats, as the triton backend speaks them: no connection state here.

- the ``config.pbtxt`` a replica writes into Triton's model repository for a suite config;
- KServe v2 ``ModelInferRequest`` / ``ModelInferResponse`` messages (the
  protocol's stubs that tritonclient ships), tensors as raw bytes;
- Triton's Prometheus device metrics;
- Triton's errors as the suite's (one table).
"""

from __future__ import annotations

import copy
import shutil
from collections.abc import Iterable
from pathlib import Path

import grpc
import numpy as np

from aiworks.core.datatypes import NUMPY_DTYPES, datatype_of, deserialize_bytes, element_count, serialize_bytes
from aiworks.core.errors import AIWorksError, DeadlineExceeded, Internal, InvalidArgument, Unavailable
from aiworks.core.model_config import ModelConfig

BACKEND_PARAMETER = "triton_backend"
"""Config parameter naming a Triton backend (``python``) for models without a platform."""

DEVICE_METRIC_PREFIXES = ("nv_gpu_", "nv_cpu_", "nv_energy_")

_GRPC_ERRORS = {
    "INVALID_ARGUMENT": InvalidArgument,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
    # Triton answers UNAVAILABLE and NOT_FOUND for a model it has not (or no
    # longer) loaded: for the scheduler, this replica cannot serve it right now.
    "UNAVAILABLE": Unavailable,
    "NOT_FOUND": Unavailable,
    "CANCELLED": Unavailable,
}
# Codes that say the server, not the request, failed: worth asking whether it is still there.
TRANSPORT_CODES = ("UNAVAILABLE", "CANCELLED", "UNKNOWN", "INTERNAL")


def as_error(exc: Exception, what: str) -> AIWorksError:
    """An error from tritonclient or grpc as the suite's error, keeping Triton's class of failure."""
    from tritonclient.utils import InferenceServerException

    if isinstance(exc, AIWorksError):
        return exc
    if isinstance(exc, InferenceServerException):
        kind = _GRPC_ERRORS.get(str(exc.status()).removeprefix("StatusCode."), Internal)
        return kind(f"{what}: Triton says: {exc.message()}")
    if isinstance(exc, grpc.aio.AioRpcError):
        kind = _GRPC_ERRORS.get(exc.code().name, Internal)
        return kind(f"{what}: Triton says: {exc.details()}")
    return Internal(f"{what}: {exc}")


def parse_device_metrics(text: str) -> dict[str, dict[str, float]]:
    """Triton's device metrics from its Prometheus text: ``{name: {gpu_uuid or "": value}}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(DEVICE_METRIC_PREFIXES):
            continue
        for sample in family.samples:
            # Keep Triton's names: the parser calls a counter's sample <name>_total.
            if sample.name in (family.name, f"{family.name}_total"):
                out.setdefault(family.name, {})[sample.labels.get("gpu_uuid", "")] = float(sample.value)
    return out


def remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)


def link(path: Path, target: Path) -> None:
    target = target.resolve()
    if path.is_symlink() and path.resolve() == target:
        return
    remove(path)
    path.symlink_to(target, target_is_directory=True)


def infer_request(name: str, version: int, feeds: dict[str, np.ndarray], outputs: list[str]):
    """The KServe v2 ``ModelInferRequest`` for ``feeds``, tensors as raw bytes."""
    from tritonclient.grpc import service_pb2

    request = service_pb2.ModelInferRequest(model_name=name, model_version=str(version))
    for input_name, array in feeds.items():
        datatype = datatype_of(array)
        tensor = request.inputs.add(name=input_name, datatype=datatype)
        tensor.shape.extend(array.shape)
        request.raw_input_contents.append(serialize_bytes(array) if datatype == "BYTES" else array.tobytes())
    for output in outputs:
        request.outputs.add(name=output)
    return request


def response_arrays(response) -> dict[str, np.ndarray]:
    """A ``ModelInferResponse``'s outputs as numpy arrays (views of its bytes where the type allows)."""
    out = {}
    for tensor, raw in zip(response.outputs, response.raw_output_contents):
        shape = tuple(int(d) for d in tensor.shape)
        if tensor.datatype == "BYTES":
            out[tensor.name] = deserialize_bytes(raw, element_count(shape), name=tensor.name).reshape(shape)
        else:
            out[tensor.name] = np.frombuffer(raw, dtype=NUMPY_DTYPES[tensor.datatype]).reshape(shape)
    return out


def triton_config(config: ModelConfig, versions: Iterable[int], instance_kind: str | None = None) -> str:
    """Triton's ``config.pbtxt`` for a suite model config, serving ``versions``."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    doc = copy.deepcopy(config.document)
    doc.pop("backend", None)  # "triton" selects this backend; Triton must not see it
    params = doc.pop("parameters", {})
    triton_backend = params.pop(BACKEND_PARAMETER, {}).get("string_value", "")
    if params:
        doc["parameters"] = params
    if triton_backend:
        doc.pop("platform", None)
        doc["backend"] = triton_backend
    else:
        doc["platform"] = config.platform
    doc["version_policy"] = {"specific": {"versions": sorted(set(versions))}}
    # The suite's cache service answers repeated requests before they reach a replica.
    doc.pop("response_cache", None)
    # dynamic_batching stays as written: Triton holds the batch window, with microsecond timers, and the
    # replica advertises a window of 0 to the scheduler (TritonModel.batch_window_in_backend), which
    # sends at once and still merges what queues while the replica is busy.
    if instance_kind:
        groups = doc.get("instance_group") or [{"count": 1}]
        doc["instance_group"] = [{**g, "kind": instance_kind} for g in groups]
    try:
        message = json_format.ParseDict(doc, model_config_pb2.ModelConfig())
    except json_format.ParseError as exc:
        raise InvalidArgument(f"model '{config.name}': cannot write Triton's config: {exc}") from None
    return text_format.MessageToString(message)
