from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class SubscribeRequest(_message.Message):
    __slots__ = ("name", "group", "consumer", "from_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    FROM_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    group: str
    consumer: str
    from_id: str
    def __init__(self, name: _Optional[str] = ..., group: _Optional[str] = ..., consumer: _Optional[str] = ..., from_id: _Optional[str] = ...) -> None: ...

class StreamEvent(_message.Message):
    __slots__ = ("event", "id", "data")
    EVENT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    event: str
    id: str
    data: bytes
    def __init__(self, event: _Optional[str] = ..., id: _Optional[str] = ..., data: _Optional[bytes] = ...) -> None: ...
