from moetier.rpc.v1 import dense_worker_pb2 as _dense_worker_pb2
from moetier.rpc.v1 import generate_pb2 as _generate_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_KIND_UNSPECIFIED: _ClassVar[MemberKind]
    MEMBER_KIND_DENSE_WORKER: _ClassVar[MemberKind]
    MEMBER_KIND_EXPERT_STORE: _ClassVar[MemberKind]
MEMBER_KIND_UNSPECIFIED: MemberKind
MEMBER_KIND_DENSE_WORKER: MemberKind
MEMBER_KIND_EXPERT_STORE: MemberKind

class ExpertRange(_message.Message):
    __slots__ = ("layer", "first", "last")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first: int
    last: int
    def __init__(self, layer: _Optional[int] = ..., first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("kind", "member_id", "address", "metrics_address", "model_id", "owned", "read_bandwidth")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    READ_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    kind: MemberKind
    member_id: str
    address: str
    metrics_address: str
    model_id: str
    owned: _containers.RepeatedCompositeFieldContainer[ExpertRange]
    read_bandwidth: float
    def __init__(self, kind: _Optional[_Union[MemberKind, str]] = ..., member_id: _Optional[str] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., model_id: _Optional[str] = ..., owned: _Optional[_Iterable[_Union[ExpertRange, _Mapping]]] = ..., read_bandwidth: _Optional[float] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("heartbeat_interval_s", "expiry_s")
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    EXPIRY_S_FIELD_NUMBER: _ClassVar[int]
    heartbeat_interval_s: float
    expiry_s: float
    def __init__(self, heartbeat_interval_s: _Optional[float] = ..., expiry_s: _Optional[float] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("member_id", "load", "draining")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    load: _dense_worker_pb2.WorkerLoad
    draining: bool
    def __init__(self, member_id: _Optional[str] = ..., load: _Optional[_Union[_dense_worker_pb2.WorkerLoad, _Mapping]] = ..., draining: _Optional[bool] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class ClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Member(_message.Message):
    __slots__ = ("kind", "member_id", "address", "metrics_address", "model_id", "last_seen_s", "load", "owned", "in_flight", "read_bandwidth", "placed_experts")
    KIND_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_S_FIELD_NUMBER: _ClassVar[int]
    LOAD_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    READ_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    PLACED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    kind: MemberKind
    member_id: str
    address: str
    metrics_address: str
    model_id: str
    last_seen_s: float
    load: _dense_worker_pb2.WorkerLoad
    owned: _containers.RepeatedCompositeFieldContainer[ExpertRange]
    in_flight: int
    read_bandwidth: float
    placed_experts: int
    def __init__(self, kind: _Optional[_Union[MemberKind, str]] = ..., member_id: _Optional[str] = ..., address: _Optional[str] = ..., metrics_address: _Optional[str] = ..., model_id: _Optional[str] = ..., last_seen_s: _Optional[float] = ..., load: _Optional[_Union[_dense_worker_pb2.WorkerLoad, _Mapping]] = ..., owned: _Optional[_Iterable[_Union[ExpertRange, _Mapping]]] = ..., in_flight: _Optional[int] = ..., read_bandwidth: _Optional[float] = ..., placed_experts: _Optional[int] = ...) -> None: ...

class ClusterStatusResponse(_message.Message):
    __slots__ = ("members", "queued", "queue_capacity")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    QUEUE_CAPACITY_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[Member]
    queued: int
    queue_capacity: int
    def __init__(self, members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., queued: _Optional[int] = ..., queue_capacity: _Optional[int] = ...) -> None: ...

class PlacementRequest(_message.Message):
    __slots__ = ("known_version",)
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    known_version: int
    def __init__(self, known_version: _Optional[int] = ...) -> None: ...

class StorePlacement(_message.Message):
    __slots__ = ("member_id", "address", "weight", "owned")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    address: str
    weight: float
    owned: _containers.RepeatedCompositeFieldContainer[ExpertRange]
    def __init__(self, member_id: _Optional[str] = ..., address: _Optional[str] = ..., weight: _Optional[float] = ..., owned: _Optional[_Iterable[_Union[ExpertRange, _Mapping]]] = ...) -> None: ...

class PlacementResponse(_message.Message):
    __slots__ = ("version", "stores", "changed")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STORES_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    version: int
    stores: _containers.RepeatedCompositeFieldContainer[StorePlacement]
    changed: bool
    def __init__(self, version: _Optional[int] = ..., stores: _Optional[_Iterable[_Union[StorePlacement, _Mapping]]] = ..., changed: _Optional[bool] = ...) -> None: ...
