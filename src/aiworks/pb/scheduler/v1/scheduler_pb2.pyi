from aiworks.pb.runtime.v1 import runtime_pb2 as _runtime_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InferRequest(_message.Message):
    __slots__ = ("id", "model", "version", "inputs", "outputs", "parameters", "stream_id", "timeout_us", "trace_context")
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    version: str
    inputs: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.Tensor]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    parameters: _containers.ScalarMap[str, str]
    stream_id: int
    timeout_us: int
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[_runtime_pb2.Tensor, _Mapping]]] = ..., outputs: _Optional[_Iterable[str]] = ..., parameters: _Optional[_Mapping[str, str]] = ..., stream_id: _Optional[int] = ..., timeout_us: _Optional[int] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("id", "model", "version", "outputs", "stream_id", "error_code", "error_message", "retry_after_s", "compute_us")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    version: str
    outputs: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.Tensor]
    stream_id: int
    error_code: int
    error_message: str
    retry_after_s: float
    compute_us: int
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[_runtime_pb2.Tensor, _Mapping]]] = ..., stream_id: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., compute_us: _Optional[int] = ...) -> None: ...

class InferRequestFrame(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[InferRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[InferRequest, _Mapping]]] = ...) -> None: ...

class InferResponseFrame(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[InferResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[InferResponse, _Mapping]]] = ...) -> None: ...

class ServerReadyRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerReadyResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: _Optional[bool] = ...) -> None: ...

class ModelRef(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class ModelReadyResponse(_message.Message):
    __slots__ = ("ready",)
    READY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    def __init__(self, ready: _Optional[bool] = ...) -> None: ...

class ModelMetadataResponse(_message.Message):
    __slots__ = ("spec", "versions")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    spec: _runtime_pb2.ModelSpec
    versions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, spec: _Optional[_Union[_runtime_pb2.ModelSpec, _Mapping]] = ..., versions: _Optional[_Iterable[str]] = ...) -> None: ...

class RepositoryIndexRequest(_message.Message):
    __slots__ = ("ready_only",)
    READY_ONLY_FIELD_NUMBER: _ClassVar[int]
    ready_only: bool
    def __init__(self, ready_only: _Optional[bool] = ...) -> None: ...

class RepositoryIndexResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.ModelSpec]
    def __init__(self, models: _Optional[_Iterable[_Union[_runtime_pb2.ModelSpec, _Mapping]]] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.ModelSpec]
    def __init__(self, versions: _Optional[_Iterable[_Union[_runtime_pb2.ModelSpec, _Mapping]]] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatistics(_message.Message):
    __slots__ = ("replica_id", "models")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    models: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.ModelStatistics]
    def __init__(self, replica_id: _Optional[str] = ..., models: _Optional[_Iterable[_Union[_runtime_pb2.ModelStatistics, _Mapping]]] = ...) -> None: ...

class ModelStatisticsResponse(_message.Message):
    __slots__ = ("replicas",)
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatistics]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatistics, _Mapping]]] = ...) -> None: ...

class ReplicaInfo(_message.Message):
    __slots__ = ("replica_id", "address", "device", "labels", "models", "gpus")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    device: str
    labels: _containers.ScalarMap[str, str]
    models: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.ModelSpec]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., models: _Optional[_Iterable[_Union[_runtime_pb2.ModelSpec, _Mapping]]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ...) -> None: ...

class GpuInfo(_message.Message):
    __slots__ = ("index", "uuid", "name", "memory_total_bytes", "memory_used_bytes", "utilization_ratio")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_RATIO_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_ratio: float
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., name: _Optional[str] = ..., memory_total_bytes: _Optional[int] = ..., memory_used_bytes: _Optional[int] = ..., utilization_ratio: _Optional[float] = ...) -> None: ...

class RegisterReplicaResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("replica_id", "inflight_batches", "models", "gpus")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    inflight_batches: int
    models: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.ModelSpec]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    def __init__(self, replica_id: _Optional[str] = ..., inflight_batches: _Optional[int] = ..., models: _Optional[_Iterable[_Union[_runtime_pb2.ModelSpec, _Mapping]]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "address", "device", "live", "outstanding_batches", "outstanding_rows", "last_heartbeat_age_s", "models", "labels", "ejected", "ejected_for_s", "times_ejected", "consecutive_errors", "ewma_latency_ms", "batches_done", "rows_done", "gpus")
    class LabelsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_BATCHES_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_ROWS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    EJECTED_FIELD_NUMBER: _ClassVar[int]
    EJECTED_FOR_S_FIELD_NUMBER: _ClassVar[int]
    TIMES_EJECTED_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    EWMA_LATENCY_MS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_DONE_FIELD_NUMBER: _ClassVar[int]
    ROWS_DONE_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    device: str
    live: bool
    outstanding_batches: int
    outstanding_rows: int
    last_heartbeat_age_s: float
    models: _containers.RepeatedScalarFieldContainer[str]
    labels: _containers.ScalarMap[str, str]
    ejected: bool
    ejected_for_s: float
    times_ejected: int
    consecutive_errors: int
    ewma_latency_ms: float
    batches_done: int
    rows_done: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., live: _Optional[bool] = ..., outstanding_batches: _Optional[int] = ..., outstanding_rows: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., models: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., ejected: _Optional[bool] = ..., ejected_for_s: _Optional[float] = ..., times_ejected: _Optional[int] = ..., consecutive_errors: _Optional[int] = ..., ewma_latency_ms: _Optional[float] = ..., batches_done: _Optional[int] = ..., rows_done: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ...) -> None: ...

class QueueStatus(_message.Message):
    __slots__ = ("model", "version", "queued_requests", "queued_rows", "batches", "rows", "queued_realtime", "queued_standard", "queued_batch", "queued_bytes", "rejected", "expired", "retries", "draining")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REALTIME_FIELD_NUMBER: _ClassVar[int]
    QUEUED_STANDARD_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BATCH_FIELD_NUMBER: _ClassVar[int]
    QUEUED_BYTES_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    queued_requests: int
    queued_rows: int
    batches: int
    rows: int
    queued_realtime: int
    queued_standard: int
    queued_batch: int
    queued_bytes: int
    rejected: int
    expired: int
    retries: int
    draining: bool
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., queued_requests: _Optional[int] = ..., queued_rows: _Optional[int] = ..., batches: _Optional[int] = ..., rows: _Optional[int] = ..., queued_realtime: _Optional[int] = ..., queued_standard: _Optional[int] = ..., queued_batch: _Optional[int] = ..., queued_bytes: _Optional[int] = ..., rejected: _Optional[int] = ..., expired: _Optional[int] = ..., retries: _Optional[int] = ..., draining: _Optional[bool] = ...) -> None: ...

class RetryBudgetStatus(_message.Message):
    __slots__ = ("active", "active_retries", "allowed", "denied")
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_RETRIES_FIELD_NUMBER: _ClassVar[int]
    ALLOWED_FIELD_NUMBER: _ClassVar[int]
    DENIED_FIELD_NUMBER: _ClassVar[int]
    active: int
    active_retries: int
    allowed: int
    denied: int
    def __init__(self, active: _Optional[int] = ..., active_retries: _Optional[int] = ..., allowed: _Optional[int] = ..., denied: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("replicas", "queues", "traffic", "retry_budget", "shadows", "caller_auth")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    RETRY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SHADOWS_FIELD_NUMBER: _ClassVar[int]
    CALLER_AUTH_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    queues: _containers.RepeatedCompositeFieldContainer[QueueStatus]
    traffic: _containers.RepeatedCompositeFieldContainer[TrafficPolicy]
    retry_budget: RetryBudgetStatus
    shadows: _containers.RepeatedCompositeFieldContainer[ShadowStatus]
    caller_auth: str
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[QueueStatus, _Mapping]]] = ..., traffic: _Optional[_Iterable[_Union[TrafficPolicy, _Mapping]]] = ..., retry_budget: _Optional[_Union[RetryBudgetStatus, _Mapping]] = ..., shadows: _Optional[_Iterable[_Union[ShadowStatus, _Mapping]]] = ..., caller_auth: _Optional[str] = ...) -> None: ...

class ShadowStatus(_message.Message):
    __slots__ = ("model", "shadow_version", "active", "mirrored", "compared", "agreed", "errors", "dropped", "agreement", "inflight", "compare")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    SHADOW_VERSION_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    MIRRORED_FIELD_NUMBER: _ClassVar[int]
    COMPARED_FIELD_NUMBER: _ClassVar[int]
    AGREED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    COMPARE_FIELD_NUMBER: _ClassVar[int]
    model: str
    shadow_version: str
    active: bool
    mirrored: int
    compared: int
    agreed: int
    errors: int
    dropped: int
    agreement: float
    inflight: int
    compare: str
    def __init__(self, model: _Optional[str] = ..., shadow_version: _Optional[str] = ..., active: _Optional[bool] = ..., mirrored: _Optional[int] = ..., compared: _Optional[int] = ..., agreed: _Optional[int] = ..., errors: _Optional[int] = ..., dropped: _Optional[int] = ..., agreement: _Optional[float] = ..., inflight: _Optional[int] = ..., compare: _Optional[str] = ...) -> None: ...

class TrafficPolicy(_message.Message):
    __slots__ = ("model", "weights", "shadow")
    class WeightsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_FIELD_NUMBER: _ClassVar[int]
    model: str
    weights: _containers.ScalarMap[str, int]
    shadow: ShadowPolicy
    def __init__(self, model: _Optional[str] = ..., weights: _Optional[_Mapping[str, int]] = ..., shadow: _Optional[_Union[ShadowPolicy, _Mapping]] = ...) -> None: ...

class ShadowPolicy(_message.Message):
    __slots__ = ("version", "fraction", "compare", "tolerance")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FRACTION_FIELD_NUMBER: _ClassVar[int]
    COMPARE_FIELD_NUMBER: _ClassVar[int]
    TOLERANCE_FIELD_NUMBER: _ClassVar[int]
    version: str
    fraction: float
    compare: str
    tolerance: float
    def __init__(self, version: _Optional[str] = ..., fraction: _Optional[float] = ..., compare: _Optional[str] = ..., tolerance: _Optional[float] = ...) -> None: ...

class SetTrafficPolicyRequest(_message.Message):
    __slots__ = ("policy",)
    POLICY_FIELD_NUMBER: _ClassVar[int]
    policy: TrafficPolicy
    def __init__(self, policy: _Optional[_Union[TrafficPolicy, _Mapping]] = ...) -> None: ...

class GetTrafficPolicyRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class EjectReplicaRequest(_message.Message):
    __slots__ = ("replica_id", "duration_s", "reason")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    duration_s: float
    reason: str
    def __init__(self, replica_id: _Optional[str] = ..., duration_s: _Optional[float] = ..., reason: _Optional[str] = ...) -> None: ...

class EjectReplicaResponse(_message.Message):
    __slots__ = ("ejected", "ejected_for_s", "message")
    EJECTED_FIELD_NUMBER: _ClassVar[int]
    EJECTED_FOR_S_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ejected: bool
    ejected_for_s: float
    message: str
    def __init__(self, ejected: _Optional[bool] = ..., ejected_for_s: _Optional[float] = ..., message: _Optional[str] = ...) -> None: ...
