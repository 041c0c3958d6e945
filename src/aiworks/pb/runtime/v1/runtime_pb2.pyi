from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MODEL_STATE_UNSPECIFIED: _ClassVar[ModelState]
    MODEL_STATE_READY: _ClassVar[ModelState]
    MODEL_STATE_UNAVAILABLE: _ClassVar[ModelState]
    MODEL_STATE_LOADING: _ClassVar[ModelState]
MODEL_STATE_UNSPECIFIED: ModelState
MODEL_STATE_READY: ModelState
MODEL_STATE_UNAVAILABLE: ModelState
MODEL_STATE_LOADING: ModelState

class Tensor(_message.Message):
    __slots__ = ("name", "datatype", "shape", "raw")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    RAW_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    raw: bytes
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., raw: _Optional[bytes] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "datatype", "dims", "reshape", "has_reshape", "format", "label_filename")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DATATYPE_FIELD_NUMBER: _ClassVar[int]
    DIMS_FIELD_NUMBER: _ClassVar[int]
    RESHAPE_FIELD_NUMBER: _ClassVar[int]
    HAS_RESHAPE_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    LABEL_FILENAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    datatype: str
    dims: _containers.RepeatedScalarFieldContainer[int]
    reshape: _containers.RepeatedScalarFieldContainer[int]
    has_reshape: bool
    format: str
    label_filename: str
    def __init__(self, name: _Optional[str] = ..., datatype: _Optional[str] = ..., dims: _Optional[_Iterable[int]] = ..., reshape: _Optional[_Iterable[int]] = ..., has_reshape: _Optional[bool] = ..., format: _Optional[str] = ..., label_filename: _Optional[str] = ...) -> None: ...

class BatchingSpec(_message.Message):
    __slots__ = ("enabled", "max_queue_delay_us", "preferred_batch_sizes")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    MAX_QUEUE_DELAY_US_FIELD_NUMBER: _ClassVar[int]
    PREFERRED_BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    max_queue_delay_us: int
    preferred_batch_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, enabled: _Optional[bool] = ..., max_queue_delay_us: _Optional[int] = ..., preferred_batch_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("name", "version", "platform", "max_batch_size", "inputs", "outputs", "batching", "instance_count", "parameters", "state", "reason", "decoupled", "sequence")
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    PLATFORM_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    BATCHING_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_COUNT_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECOUPLED_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    platform: str
    max_batch_size: int
    inputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    outputs: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    batching: BatchingSpec
    instance_count: int
    parameters: _containers.ScalarMap[str, str]
    state: ModelState
    reason: str
    decoupled: bool
    sequence: SequenceSpec
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., platform: _Optional[str] = ..., max_batch_size: _Optional[int] = ..., inputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., outputs: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., batching: _Optional[_Union[BatchingSpec, _Mapping]] = ..., instance_count: _Optional[int] = ..., parameters: _Optional[_Mapping[str, str]] = ..., state: _Optional[_Union[ModelState, str]] = ..., reason: _Optional[str] = ..., decoupled: _Optional[bool] = ..., sequence: _Optional[_Union[SequenceSpec, _Mapping]] = ...) -> None: ...

class SequenceSpec(_message.Message):
    __slots__ = ("strategy", "max_idle_us")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    MAX_IDLE_US_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    max_idle_us: int
    def __init__(self, strategy: _Optional[str] = ..., max_idle_us: _Optional[int] = ...) -> None: ...

class SequenceRef(_message.Message):
    __slots__ = ("number", "text", "start", "end")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    number: int
    text: str
    start: bool
    end: bool
    def __init__(self, number: _Optional[int] = ..., text: _Optional[str] = ..., start: _Optional[bool] = ..., end: _Optional[bool] = ...) -> None: ...

class Parameter(_message.Message):
    __slots__ = ("bool_param", "int64_param", "string_param", "double_param", "uint64_param")
    BOOL_PARAM_FIELD_NUMBER: _ClassVar[int]
    INT64_PARAM_FIELD_NUMBER: _ClassVar[int]
    STRING_PARAM_FIELD_NUMBER: _ClassVar[int]
    DOUBLE_PARAM_FIELD_NUMBER: _ClassVar[int]
    UINT64_PARAM_FIELD_NUMBER: _ClassVar[int]
    bool_param: bool
    int64_param: int
    string_param: str
    double_param: float
    uint64_param: int
    def __init__(self, bool_param: _Optional[bool] = ..., int64_param: _Optional[int] = ..., string_param: _Optional[str] = ..., double_param: _Optional[float] = ..., uint64_param: _Optional[int] = ...) -> None: ...

class RequestOptions(_message.Message):
    __slots__ = ("priority", "timeout_us", "tenant", "request_id", "trace_context", "sequence")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    priority: int
    timeout_us: int
    tenant: str
    request_id: str
    trace_context: _containers.ScalarMap[str, str]
    sequence: SequenceRef
    def __init__(self, priority: _Optional[int] = ..., timeout_us: _Optional[int] = ..., tenant: _Optional[str] = ..., request_id: _Optional[str] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., sequence: _Optional[_Union[SequenceRef, _Mapping]] = ...) -> None: ...

class InferRequest(_message.Message):
    __slots__ = ("stream_id", "model", "version", "inputs", "outputs", "id", "options", "parameters", "classification")
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Parameter
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Parameter, _Mapping]] = ...) -> None: ...
    class ClassificationEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    CLASSIFICATION_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    model: str
    version: str
    inputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    outputs: _containers.RepeatedScalarFieldContainer[str]
    id: str
    options: RequestOptions
    parameters: _containers.MessageMap[str, Parameter]
    classification: _containers.ScalarMap[str, int]
    def __init__(self, stream_id: _Optional[int] = ..., model: _Optional[str] = ..., version: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., outputs: _Optional[_Iterable[str]] = ..., id: _Optional[str] = ..., options: _Optional[_Union[RequestOptions, _Mapping]] = ..., parameters: _Optional[_Mapping[str, Parameter]] = ..., classification: _Optional[_Mapping[str, int]] = ...) -> None: ...

class InferResponse(_message.Message):
    __slots__ = ("stream_id", "outputs", "error_code", "error_message", "retry_after_s", "compute_us", "queue_us", "more", "parameters")
    class ParametersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: Parameter
        def __init__(self, key: _Optional[str] = ..., value: _Optional[_Union[Parameter, _Mapping]] = ...) -> None: ...
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_US_FIELD_NUMBER: _ClassVar[int]
    QUEUE_US_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    outputs: _containers.RepeatedCompositeFieldContainer[Tensor]
    error_code: int
    error_message: str
    retry_after_s: float
    compute_us: int
    queue_us: int
    more: bool
    parameters: _containers.MessageMap[str, Parameter]
    def __init__(self, stream_id: _Optional[int] = ..., outputs: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ..., retry_after_s: _Optional[float] = ..., compute_us: _Optional[int] = ..., queue_us: _Optional[int] = ..., more: _Optional[bool] = ..., parameters: _Optional[_Mapping[str, Parameter]] = ...) -> None: ...

class InferRequestFrame(_message.Message):
    __slots__ = ("items", "cancel")
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[InferRequest]
    cancel: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, items: _Optional[_Iterable[_Union[InferRequest, _Mapping]]] = ..., cancel: _Optional[_Iterable[int]] = ...) -> None: ...

class InferResponseFrame(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[InferResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[InferResponse, _Mapping]]] = ...) -> None: ...

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
    __slots__ = ("versions",)
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedCompositeFieldContainer[ModelSpec]
    def __init__(self, versions: _Optional[_Iterable[_Union[ModelSpec, _Mapping]]] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ("ready_only",)
    READY_ONLY_FIELD_NUMBER: _ClassVar[int]
    ready_only: bool
    def __init__(self, ready_only: _Optional[bool] = ...) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelSpec]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelSpec, _Mapping]]] = ...) -> None: ...

class ModelMetadataRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class ModelMetadataResponse(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: ModelSpec
    def __init__(self, spec: _Optional[_Union[ModelSpec, _Mapping]] = ...) -> None: ...

class ModelStatistics(_message.Message):
    __slots__ = ("name", "version", "inference_count", "execution_count", "success_count", "failure_count", "compute_ns", "last_inference_ms", "resident", "resident_bytes", "preloaded", "load_ns", "warmup_ns", "cold_start_ns", "first_request_ns", "load_count", "eviction_count")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_COUNT_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_COUNT_FIELD_NUMBER: _ClassVar[int]
    FAILURE_COUNT_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_INFERENCE_MS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    PRELOADED_FIELD_NUMBER: _ClassVar[int]
    LOAD_NS_FIELD_NUMBER: _ClassVar[int]
    WARMUP_NS_FIELD_NUMBER: _ClassVar[int]
    COLD_START_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_REQUEST_NS_FIELD_NUMBER: _ClassVar[int]
    LOAD_COUNT_FIELD_NUMBER: _ClassVar[int]
    EVICTION_COUNT_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    inference_count: int
    execution_count: int
    success_count: int
    failure_count: int
    compute_ns: int
    last_inference_ms: int
    resident: bool
    resident_bytes: int
    preloaded: bool
    load_ns: int
    warmup_ns: int
    cold_start_ns: int
    first_request_ns: int
    load_count: int
    eviction_count: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., inference_count: _Optional[int] = ..., execution_count: _Optional[int] = ..., success_count: _Optional[int] = ..., failure_count: _Optional[int] = ..., compute_ns: _Optional[int] = ..., last_inference_ms: _Optional[int] = ..., resident: _Optional[bool] = ..., resident_bytes: _Optional[int] = ..., preloaded: _Optional[bool] = ..., load_ns: _Optional[int] = ..., warmup_ns: _Optional[int] = ..., cold_start_ns: _Optional[int] = ..., first_request_ns: _Optional[int] = ..., load_count: _Optional[int] = ..., eviction_count: _Optional[int] = ...) -> None: ...

class StatisticsRequest(_message.Message):
    __slots__ = ("name", "version")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ...) -> None: ...

class StatisticsResponse(_message.Message):
    __slots__ = ("replica_id", "models")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    models: _containers.RepeatedCompositeFieldContainer[ModelStatistics]
    def __init__(self, replica_id: _Optional[str] = ..., models: _Optional[_Iterable[_Union[ModelStatistics, _Mapping]]] = ...) -> None: ...
