"""Transport-neutral inference request and response, as the services pass them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiworks.core.datatypes import Tensor


@dataclass(slots=True)
class InferRequest:
    """One client request: a model, optional version, named input tensors."""

    model: str
    version: str = ""
    inputs: list[Tensor] = field(default_factory=list)
    # Names of outputs to return; empty means all.
    outputs: list[str] = field(default_factory=list)
    id: str = ""
    parameters: dict = field(default_factory=dict)
    # The authenticated tenant, set at the gateway by the tenancy layer; "" when tenancy is off.
    tenant: str = ""
    # Triton's classification extension: output name -> N, for outputs to answer with their top N classes.
    classification: dict[str, int] = field(default_factory=dict)
    # True once ``version`` is the one routing chose (the gateway's metrics label failures with it then).
    resolved: bool = False


@dataclass(slots=True)
class InferResponse:
    model: str
    version: str
    outputs: list[Tensor]
    id: str = ""
    parameters: dict = field(default_factory=dict)
    # Accounting that never reaches a client: the runtime time spent on this request (its share of its
    # batches), and whether the result cache answered it (docs/tenancy.md, docs/cache.md).
    compute_s: float = 0.0
    cache_hit: bool = False
    # False on a decoupled model's responses but the last (the OIP's triton_final_response).
    final: bool = True


@dataclass(slots=True)
class Answer:
    """A runtime replica's answer to one request (or one of a decoupled model's answers).

    Its outputs, its share of the compute of the batch it ran in, its wait in
    the replica's queue, response parameters, and whether it is the request's
    last answer (``final``; a decoupled model's earlier answers have it unset).
    """

    outputs: list[Tensor]
    compute_ns: int = 0
    queue_ns: int = 0
    parameters: dict = field(default_factory=dict)
    final: bool = True


@dataclass(slots=True)
class ModelStatistics:
    """Counters of one model version on one replica, like Triton's statistics extension."""

    name: str = ""
    version: str = ""
    inference_count: int = 0  # rows executed
    execution_count: int = 0  # batches executed
    success_count: int = 0
    failure_count: int = 0
    compute_ns: int = 0
    last_inference_ms: int = 0
    # Residency and cold start (services/model-runtime/residency.py).
    resident: bool = False
    resident_bytes: int = 0
    preloaded: bool = False
    load_ns: int = 0
    warmup_ns: int = 0
    cold_start_ns: int = 0
    first_request_ns: int = 0
    load_count: int = 0
    eviction_count: int = 0


@dataclass(slots=True)
class PendingInputs:
    """Tensor data a front end has read but not decoded: ``decode()`` fills each input's ``raw``.

    The gateway's front ends parse only the request's header (names,
    datatypes, shapes) and hand this over, so the caller is authorized and
    the element caps are checked before any tensor data costs work.
    ``slow_elements`` counts the elements ``decode`` handles one at a time
    (JSON ``data``, typed gRPC ``contents``, BYTES elements): a large count is
    decoded off the event loop. Fixed-size binary data costs nothing here.
    """

    decode: Callable[[], None]
    slow_elements: int = 0
