from aiworks.pb.runtime.v1 import runtime_pb2 as _runtime_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

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

class LoadModelRequest(_message.Message):
    __slots__ = ("name", "config_override", "files")
    class FilesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: bytes
        def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    CONFIG_OVERRIDE_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    name: str
    config_override: str
    files: _containers.ScalarMap[str, bytes]
    def __init__(self, name: _Optional[str] = ..., config_override: _Optional[str] = ..., files: _Optional[_Mapping[str, bytes]] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("versions", "generation")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.ModelSpec]
    generation: int
    def __init__(self, versions: _Optional[_Iterable[_Union[_runtime_pb2.ModelSpec, _Mapping]]] = ..., generation: _Optional[int] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...

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
    __slots__ = ("replica_id", "inflight_batches", "models", "gpus", "queues", "kv", "stopping")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    KV_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    inflight_batches: int
    models: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.ModelSpec]
    gpus: _containers.RepeatedCompositeFieldContainer[GpuInfo]
    queues: _containers.RepeatedCompositeFieldContainer[QueueStatus]
    kv: _containers.RepeatedCompositeFieldContainer[KvStatus]
    stopping: bool
    def __init__(self, replica_id: _Optional[str] = ..., inflight_batches: _Optional[int] = ..., models: _Optional[_Iterable[_Union[_runtime_pb2.ModelSpec, _Mapping]]] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[QueueStatus, _Mapping]]] = ..., kv: _Optional[_Iterable[_Union[KvStatus, _Mapping]]] = ..., stopping: _Optional[bool] = ...) -> None: ...

class KvStatus(_message.Message):
    __slots__ = ("model", "version", "free_tokens", "budget_tokens", "waiting_sequences", "waiting_by_class")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    FREE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    BUDGET_TOKENS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WAITING_BY_CLASS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    free_tokens: int
    budget_tokens: int
    waiting_sequences: int
    waiting_by_class: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., free_tokens: _Optional[int] = ..., budget_tokens: _Optional[int] = ..., waiting_sequences: _Optional[int] = ..., waiting_by_class: _Optional[_Iterable[int]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "address", "device", "live", "outstanding_batches", "outstanding_rows", "last_heartbeat_age_s", "models", "labels", "ejected", "ejected_for_s", "times_ejected", "consecutive_errors", "ewma_latency_ms", "batches_done", "rows_done", "gpus", "kv", "kv_age_s", "stopping")
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
    KV_FIELD_NUMBER: _ClassVar[int]
    KV_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
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
    kv: _containers.RepeatedCompositeFieldContainer[KvStatus]
    kv_age_s: float
    stopping: bool
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., live: _Optional[bool] = ..., outstanding_batches: _Optional[int] = ..., outstanding_rows: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., models: _Optional[_Iterable[str]] = ..., labels: _Optional[_Mapping[str, str]] = ..., ejected: _Optional[bool] = ..., ejected_for_s: _Optional[float] = ..., times_ejected: _Optional[int] = ..., consecutive_errors: _Optional[int] = ..., ewma_latency_ms: _Optional[float] = ..., batches_done: _Optional[int] = ..., rows_done: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuInfo, _Mapping]]] = ..., kv: _Optional[_Iterable[_Union[KvStatus, _Mapping]]] = ..., kv_age_s: _Optional[float] = ..., stopping: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("replicas", "queues", "traffic", "retry_budget", "shadows", "caller_auth", "gateways")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    RETRY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SHADOWS_FIELD_NUMBER: _ClassVar[int]
    CALLER_AUTH_FIELD_NUMBER: _ClassVar[int]
    GATEWAYS_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    queues: _containers.RepeatedCompositeFieldContainer[QueueStatus]
    traffic: _containers.RepeatedCompositeFieldContainer[TrafficPolicy]
    retry_budget: RetryBudgetStatus
    shadows: _containers.RepeatedCompositeFieldContainer[ShadowStatus]
    caller_auth: str
    gateways: _containers.RepeatedCompositeFieldContainer[GatewayStatus]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[QueueStatus, _Mapping]]] = ..., traffic: _Optional[_Iterable[_Union[TrafficPolicy, _Mapping]]] = ..., retry_budget: _Optional[_Union[RetryBudgetStatus, _Mapping]] = ..., shadows: _Optional[_Iterable[_Union[ShadowStatus, _Mapping]]] = ..., caller_auth: _Optional[str] = ..., gateways: _Optional[_Iterable[_Union[GatewayStatus, _Mapping]]] = ...) -> None: ...

class GatewayStatus(_message.Message):
    __slots__ = ("gateway_id", "last_report_age_s", "requests", "retries")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_REPORT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    last_report_age_s: float
    requests: int
    retries: int
    def __init__(self, gateway_id: _Optional[str] = ..., last_report_age_s: _Optional[float] = ..., requests: _Optional[int] = ..., retries: _Optional[int] = ...) -> None: ...

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

class RouteReplica(_message.Message):
    __slots__ = ("replica_id", "address", "device", "labels", "models", "kv", "kv_age_s", "stopping")
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
    KV_FIELD_NUMBER: _ClassVar[int]
    KV_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STOPPING_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    device: str
    labels: _containers.ScalarMap[str, str]
    models: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.ModelSpec]
    kv: _containers.RepeatedCompositeFieldContainer[KvStatus]
    kv_age_s: float
    stopping: bool
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., models: _Optional[_Iterable[_Union[_runtime_pb2.ModelSpec, _Mapping]]] = ..., kv: _Optional[_Iterable[_Union[KvStatus, _Mapping]]] = ..., kv_age_s: _Optional[float] = ..., stopping: _Optional[bool] = ...) -> None: ...

class DrainingVersion(_message.Message):
    __slots__ = ("model", "version", "closing", "retiring_on", "spec")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CLOSING_FIELD_NUMBER: _ClassVar[int]
    RETIRING_ON_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    closing: bool
    retiring_on: _containers.RepeatedScalarFieldContainer[str]
    spec: _runtime_pb2.ModelSpec
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., closing: _Optional[bool] = ..., retiring_on: _Optional[_Iterable[str]] = ..., spec: _Optional[_Union[_runtime_pb2.ModelSpec, _Mapping]] = ...) -> None: ...

class Ejection(_message.Message):
    __slots__ = ("replica_id", "remaining_s", "reason", "id")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REMAINING_S_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    remaining_s: float
    reason: str
    id: int
    def __init__(self, replica_id: _Optional[str] = ..., remaining_s: _Optional[float] = ..., reason: _Optional[str] = ..., id: _Optional[int] = ...) -> None: ...

class RoutingTable(_message.Message):
    __slots__ = ("generation", "replicas", "traffic", "draining", "ejections", "known", "policy")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    TRAFFIC_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    EJECTIONS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    replicas: _containers.RepeatedCompositeFieldContainer[RouteReplica]
    traffic: _containers.RepeatedCompositeFieldContainer[TrafficPolicy]
    draining: _containers.RepeatedCompositeFieldContainer[DrainingVersion]
    ejections: _containers.RepeatedCompositeFieldContainer[Ejection]
    known: _containers.RepeatedCompositeFieldContainer[ModelRef]
    policy: RoutingPolicy
    def __init__(self, generation: _Optional[int] = ..., replicas: _Optional[_Iterable[_Union[RouteReplica, _Mapping]]] = ..., traffic: _Optional[_Iterable[_Union[TrafficPolicy, _Mapping]]] = ..., draining: _Optional[_Iterable[_Union[DrainingVersion, _Mapping]]] = ..., ejections: _Optional[_Iterable[_Union[Ejection, _Mapping]]] = ..., known: _Optional[_Iterable[_Union[ModelRef, _Mapping]]] = ..., policy: _Optional[_Union[RoutingPolicy, _Mapping]] = ...) -> None: ...

class RoutingPolicy(_message.Message):
    __slots__ = ("default_priority", "max_retries", "per_try_timeout_s", "retry_budget_percent", "retry_min_concurrency", "outlier_consecutive_errors", "outlier_base_ejection_s", "outlier_max_ejection_s", "outlier_max_ejection_percent", "latency_ewma_alpha", "class_pools", "shadow_max_inflight", "shadow_timeout_s", "pipeline_micro_batch_rows")
    class ClassPoolsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DEFAULT_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    MAX_RETRIES_FIELD_NUMBER: _ClassVar[int]
    PER_TRY_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RETRY_BUDGET_PERCENT_FIELD_NUMBER: _ClassVar[int]
    RETRY_MIN_CONCURRENCY_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_CONSECUTIVE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_BASE_EJECTION_S_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_MAX_EJECTION_S_FIELD_NUMBER: _ClassVar[int]
    OUTLIER_MAX_EJECTION_PERCENT_FIELD_NUMBER: _ClassVar[int]
    LATENCY_EWMA_ALPHA_FIELD_NUMBER: _ClassVar[int]
    CLASS_POOLS_FIELD_NUMBER: _ClassVar[int]
    SHADOW_MAX_INFLIGHT_FIELD_NUMBER: _ClassVar[int]
    SHADOW_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_MICRO_BATCH_ROWS_FIELD_NUMBER: _ClassVar[int]
    default_priority: str
    max_retries: int
    per_try_timeout_s: float
    retry_budget_percent: float
    retry_min_concurrency: int
    outlier_consecutive_errors: int
    outlier_base_ejection_s: float
    outlier_max_ejection_s: float
    outlier_max_ejection_percent: float
    latency_ewma_alpha: float
    class_pools: _containers.ScalarMap[str, str]
    shadow_max_inflight: int
    shadow_timeout_s: float
    pipeline_micro_batch_rows: int
    def __init__(self, default_priority: _Optional[str] = ..., max_retries: _Optional[int] = ..., per_try_timeout_s: _Optional[float] = ..., retry_budget_percent: _Optional[float] = ..., retry_min_concurrency: _Optional[int] = ..., outlier_consecutive_errors: _Optional[int] = ..., outlier_base_ejection_s: _Optional[float] = ..., outlier_max_ejection_s: _Optional[float] = ..., outlier_max_ejection_percent: _Optional[float] = ..., latency_ewma_alpha: _Optional[float] = ..., class_pools: _Optional[_Mapping[str, str]] = ..., shadow_max_inflight: _Optional[int] = ..., shadow_timeout_s: _Optional[float] = ..., pipeline_micro_batch_rows: _Optional[int] = ...) -> None: ...

class RoutingReport(_message.Message):
    __slots__ = ("gateway_id", "replicas", "retry_budget", "shadows", "retries", "requests")
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    RETRY_BUDGET_FIELD_NUMBER: _ClassVar[int]
    SHADOWS_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    gateway_id: str
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    retry_budget: RetryBudgetStatus
    shadows: _containers.RepeatedCompositeFieldContainer[ShadowStatus]
    retries: _containers.RepeatedCompositeFieldContainer[QueueStatus]
    requests: int
    def __init__(self, gateway_id: _Optional[str] = ..., replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., retry_budget: _Optional[_Union[RetryBudgetStatus, _Mapping]] = ..., shadows: _Optional[_Iterable[_Union[ShadowStatus, _Mapping]]] = ..., retries: _Optional[_Iterable[_Union[QueueStatus, _Mapping]]] = ..., requests: _Optional[int] = ...) -> None: ...
