from aiworks.pb.runtime.v1 import runtime_pb2 as _runtime_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InferRequest(_message.Message):
    __slots__ = ("id", "model", "version", "inputs", "outputs", "parameters", "stream_id")
    class ParametersEntry(_message.Message):
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
    id: str
    model: str
    version: str
    inputs: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.Tensor]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    parameters: _containers.ScalarMap[str, str]
    stream_id: int
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[_runtime_pb2.Tensor, _Mapping]]] = ..., outputs: _Optional[_Iterable[str]] = ..., parameters: _Optional[_Mapping[str, str]] = ..., stream_id: _Optional[int] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("id", "model", "version", "outputs", "stream_id", "error_code", "error_message")
    ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    id: str
    model: str
    version: str
    outputs: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.Tensor]
    stream_id: int
    error_code: int
    error_message: str
    def __init__(self, id: _Optional[str] = ..., model: _Optional[str] = ..., version: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[_runtime_pb2.Tensor, _Mapping]]] = ..., stream_id: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("replica_id", "address", "device", "labels", "models")
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
    replica_id: str
    address: str
    device: str
    labels: _containers.ScalarMap[str, str]
    models: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.ModelSpec]
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., labels: _Optional[_Mapping[str, str]] = ..., models: _Optional[_Iterable[_Union[_runtime_pb2.ModelSpec, _Mapping]]] = ...) -> None: ...

class RegisterReplicaResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s",)
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("replica_id", "inflight_batches", "models")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INFLIGHT_BATCHES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    inflight_batches: int
    models: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.ModelSpec]
    def __init__(self, replica_id: _Optional[str] = ..., inflight_batches: _Optional[int] = ..., models: _Optional[_Iterable[_Union[_runtime_pb2.ModelSpec, _Mapping]]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReplicaStatus(_message.Message):
    __slots__ = ("replica_id", "address", "device", "live", "outstanding_batches", "outstanding_rows", "last_heartbeat_age_s", "models")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_BATCHES_FIELD_NUMBER: _ClassVar[int]
    OUTSTANDING_ROWS_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    address: str
    device: str
    live: bool
    outstanding_batches: int
    outstanding_rows: int
    last_heartbeat_age_s: float
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, replica_id: _Optional[str] = ..., address: _Optional[str] = ..., device: _Optional[str] = ..., live: _Optional[bool] = ..., outstanding_batches: _Optional[int] = ..., outstanding_rows: _Optional[int] = ..., last_heartbeat_age_s: _Optional[float] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class QueueStatus(_message.Message):
    __slots__ = ("model", "version", "queued_requests", "queued_rows", "batches", "rows")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    QUEUED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_ROWS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    queued_requests: int
    queued_rows: int
    batches: int
    rows: int
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., queued_requests: _Optional[int] = ..., queued_rows: _Optional[int] = ..., batches: _Optional[int] = ..., rows: _Optional[int] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("replicas", "queues")
    REPLICAS_FIELD_NUMBER: _ClassVar[int]
    QUEUES_FIELD_NUMBER: _ClassVar[int]
    replicas: _containers.RepeatedCompositeFieldContainer[ReplicaStatus]
    queues: _containers.RepeatedCompositeFieldContainer[QueueStatus]
    def __init__(self, replicas: _Optional[_Iterable[_Union[ReplicaStatus, _Mapping]]] = ..., queues: _Optional[_Iterable[_Union[QueueStatus, _Mapping]]] = ...) -> None: ...
