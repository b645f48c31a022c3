from moetier.rpc.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerLoad(_message.Message):
    __slots__ = ("running", "waiting", "kv_bytes", "max_batch", "max_waiting", "prefix_hashes", "prefix_block")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    MAX_WAITING_FIELD_NUMBER: _ClassVar[int]
    PREFIX_HASHES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_BLOCK_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    kv_bytes: int
    max_batch: int
    max_waiting: int
    prefix_hashes: _containers.RepeatedScalarFieldContainer[int]
    prefix_block: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., max_batch: _Optional[int] = ..., max_waiting: _Optional[int] = ..., prefix_hashes: _Optional[_Iterable[int]] = ..., prefix_block: _Optional[int] = ...) -> None: ...
