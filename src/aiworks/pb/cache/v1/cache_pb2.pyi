from aiworks.pb.runtime.v1 import runtime_pb2 as _runtime_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CachedResponse(_message.Message):
    __slots__ = ("model", "version", "outputs")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    model: str
    version: str
    outputs: _containers.RepeatedCompositeFieldContainer[_runtime_pb2.Tensor]
    def __init__(self, model: _Optional[str] = ..., version: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[_runtime_pb2.Tensor, _Mapping]]] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("model", "key", "stream_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    key: bytes
    stream_id: int
    def __init__(self, model: _Optional[str] = ..., key: _Optional[bytes] = ..., stream_id: _Optional[int] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("found", "value", "epoch", "bypassed", "stream_id", "error_code", "error_message")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BYPASSED_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    found: bool
    value: bytes
    epoch: int
    bypassed: bool
    stream_id: int
    error_code: int
    error_message: str
    def __init__(self, found: _Optional[bool] = ..., value: _Optional[bytes] = ..., epoch: _Optional[int] = ..., bypassed: _Optional[bool] = ..., stream_id: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("model", "key", "value", "epoch", "ttl_ms", "stream_id")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TTL_MS_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    model: str
    key: bytes
    value: bytes
    epoch: int
    ttl_ms: int
    stream_id: int
    def __init__(self, model: _Optional[str] = ..., key: _Optional[bytes] = ..., value: _Optional[bytes] = ..., epoch: _Optional[int] = ..., ttl_ms: _Optional[int] = ..., stream_id: _Optional[int] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "reason", "stream_id", "error_code", "error_message")
    STORED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    reason: str
    stream_id: int
    error_code: int
    error_message: str
    def __init__(self, stored: _Optional[bool] = ..., reason: _Optional[str] = ..., stream_id: _Optional[int] = ..., error_code: _Optional[int] = ..., error_message: _Optional[str] = ...) -> None: ...

class GetRequestFrame(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GetRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[GetRequest, _Mapping]]] = ...) -> None: ...

class GetResponseFrame(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[GetResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[GetResponse, _Mapping]]] = ...) -> None: ...

class PutRequestFrame(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutRequest]
    def __init__(self, items: _Optional[_Iterable[_Union[PutRequest, _Mapping]]] = ...) -> None: ...

class PutResponseFrame(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[PutResponse]
    def __init__(self, items: _Optional[_Iterable[_Union[PutResponse, _Mapping]]] = ...) -> None: ...

class InvalidateRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class InvalidateResponse(_message.Message):
    __slots__ = ("removed", "epoch")
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    removed: int
    epoch: int
    def __init__(self, removed: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("store", "store_available", "entries", "bytes", "max_bytes", "hits", "misses", "puts", "rejected_puts", "evictions", "expired", "invalidations", "store_errors", "bypassed")
    STORE_FIELD_NUMBER: _ClassVar[int]
    STORE_AVAILABLE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PUTS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_PUTS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    INVALIDATIONS_FIELD_NUMBER: _ClassVar[int]
    STORE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    BYPASSED_FIELD_NUMBER: _ClassVar[int]
    store: str
    store_available: bool
    entries: int
    bytes: int
    max_bytes: int
    hits: int
    misses: int
    puts: int
    rejected_puts: int
    evictions: int
    expired: int
    invalidations: int
    store_errors: int
    bypassed: int
    def __init__(self, store: _Optional[str] = ..., store_available: _Optional[bool] = ..., entries: _Optional[int] = ..., bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., puts: _Optional[int] = ..., rejected_puts: _Optional[int] = ..., evictions: _Optional[int] = ..., expired: _Optional[int] = ..., invalidations: _Optional[int] = ..., store_errors: _Optional[int] = ..., bypassed: _Optional[int] = ...) -> None: ...
