from moetier.rpc.v1 import tensor_pb2 as _tensor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DiskInfo(_message.Message):
    __slots__ = ("name", "path", "state", "weight", "files")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    state: str
    weight: float
    files: int
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., state: _Optional[str] = ..., weight: _Optional[float] = ..., files: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("model_id", "arch", "hidden_size", "moe_layers", "n_experts", "top_k", "record_bytes", "budget_bytes", "policy", "expert_dtype", "disks", "store_id", "local_socket", "local_token", "owned", "read_bandwidth")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    RECORD_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    POLICY_FIELD_NUMBER: _ClassVar[int]
    EXPERT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DISKS_FIELD_NUMBER: _ClassVar[int]
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    OWNED_FIELD_NUMBER: _ClassVar[int]
    READ_BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    arch: str
    hidden_size: int
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    n_experts: int
    top_k: int
    record_bytes: int
    budget_bytes: int
    policy: str
    expert_dtype: str
    disks: _containers.RepeatedCompositeFieldContainer[DiskInfo]
    store_id: str
    local_socket: str
    local_token: str
    owned: _containers.RepeatedCompositeFieldContainer[OwnedRange]
    read_bandwidth: float
    def __init__(self, model_id: _Optional[str] = ..., arch: _Optional[str] = ..., hidden_size: _Optional[int] = ..., moe_layers: _Optional[_Iterable[int]] = ..., n_experts: _Optional[int] = ..., top_k: _Optional[int] = ..., record_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., policy: _Optional[str] = ..., expert_dtype: _Optional[str] = ..., disks: _Optional[_Iterable[_Union[DiskInfo, _Mapping]]] = ..., store_id: _Optional[str] = ..., local_socket: _Optional[str] = ..., local_token: _Optional[str] = ..., owned: _Optional[_Iterable[_Union[OwnedRange, _Mapping]]] = ..., read_bandwidth: _Optional[float] = ...) -> None: ...

class OwnedRange(_message.Message):
    __slots__ = ("layer", "first", "last")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    FIRST_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    layer: int
    first: int
    last: int
    def __init__(self, layer: _Optional[int] = ..., first: _Optional[int] = ..., last: _Optional[int] = ...) -> None: ...

class LocalHello(_message.Message):
    __slots__ = ("token", "region_bytes", "shared_experts")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    REGION_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHARED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    token: str
    region_bytes: int
    shared_experts: bool
    def __init__(self, token: _Optional[str] = ..., region_bytes: _Optional[int] = ..., shared_experts: _Optional[bool] = ...) -> None: ...

class LocalReady(_message.Message):
    __slots__ = ("store_id", "shared")
    STORE_ID_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    store_id: str
    shared: SharedExperts
    def __init__(self, store_id: _Optional[str] = ..., shared: _Optional[_Union[SharedExperts, _Mapping]] = ...) -> None: ...

class SharedExperts(_message.Message):
    __slots__ = ("bytes", "records", "model_id")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RECORDS_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    records: _tensor_pb2.Tensor
    model_id: str
    def __init__(self, bytes: _Optional[int] = ..., records: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., model_id: _Optional[str] = ...) -> None: ...

class LocalUsage(_message.Message):
    __slots__ = ("experts", "layers")
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    experts: _tensor_pb2.Tensor
    layers: _tensor_pb2.Tensor
    def __init__(self, experts: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., layers: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ...) -> None: ...

class LocalError(_message.Message):
    __slots__ = ("code", "message", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    retry_after_ms: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class ComputeExpertsRequest(_message.Message):
    __slots__ = ("layer", "hidden", "expert_ids", "weights", "step", "slot_outputs")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    SLOT_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    hidden: _tensor_pb2.Tensor
    expert_ids: _tensor_pb2.Tensor
    weights: _tensor_pb2.Tensor
    step: int
    slot_outputs: bool
    def __init__(self, layer: _Optional[int] = ..., hidden: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., expert_ids: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., weights: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., step: _Optional[int] = ..., slot_outputs: _Optional[bool] = ...) -> None: ...

class ComputeExpertsResponse(_message.Message):
    __slots__ = ("output", "hits", "misses", "load_ns", "compute_ns", "settled")
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    LOAD_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    output: _tensor_pb2.Tensor
    hits: int
    misses: int
    load_ns: int
    compute_ns: int
    settled: bool
    def __init__(self, output: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., load_ns: _Optional[int] = ..., compute_ns: _Optional[int] = ..., settled: _Optional[bool] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("layer", "expert_ids", "step")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    layer: int
    expert_ids: _containers.RepeatedScalarFieldContainer[int]
    step: int
    def __init__(self, layer: _Optional[int] = ..., expert_ids: _Optional[_Iterable[int]] = ..., step: _Optional[int] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("queued", "resident", "dropped")
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    resident: int
    dropped: int
    def __init__(self, queued: _Optional[int] = ..., resident: _Optional[int] = ..., dropped: _Optional[int] = ...) -> None: ...

class HeatRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HeatResponse(_message.Message):
    __slots__ = ("moe_layers", "n_experts", "counts", "tier", "recent", "disks", "resident_bytes", "budget_bytes", "step")
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    N_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    RECENT_FIELD_NUMBER: _ClassVar[int]
    DISKS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    n_experts: int
    counts: _tensor_pb2.Tensor
    tier: _tensor_pb2.Tensor
    recent: _tensor_pb2.Tensor
    disks: _containers.RepeatedScalarFieldContainer[str]
    resident_bytes: int
    budget_bytes: int
    step: int
    def __init__(self, moe_layers: _Optional[_Iterable[int]] = ..., n_experts: _Optional[int] = ..., counts: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., tier: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., recent: _Optional[_Union[_tensor_pb2.Tensor, _Mapping]] = ..., disks: _Optional[_Iterable[str]] = ..., resident_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., step: _Optional[int] = ...) -> None: ...
