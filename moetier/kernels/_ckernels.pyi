"""Types of the C extension built from csrc/*.c (see moetier/kernels/fast.py for use).

A weight spec is (dtype code, data, float16 scales as uint16 or None, group size) with
dtype codes f32 = 0, bf16 = 1, int8 = 2, int4 = 3. isa is the index of a kernel path in
isas() that this CPU supports. Every buffer must be C-contiguous; its size is checked.
"""

from typing import Any

import numpy as np

VERSION: int

WSpec = tuple[int, np.ndarray, np.ndarray | None, int]

def linear(x: Any, t: int, c: int, r: int, w: WSpec, bias: Any, out: Any, isa: int, threads: int,
           int8_activations: bool = False) -> None: ...
def ffn(x: Any, t: int, d: int, i: int, gate: WSpec, up: WSpec, down: WSpec, out: Any, isa: int,
        threads: int, int8_activations: bool = False) -> None: ...
def rmsnorm(x: Any, t: int, c: int, weight: Any, eps: float, out: Any, isa: int) -> None: ...
def softmax(x: Any, t: int, n: int, out: Any, isa: int) -> None: ...
def attention(q: Any, k: Any, v: Any, q_pos: Any, t: int, h: int, s: int, hkv: int, dq: int, dv: int,
              scale: float, out: Any, isa: int, threads: int) -> None: ...
def exp(x: Any, n: int, out: Any, isa: int) -> None: ...
def isas() -> list[tuple[str, bool]]: ...
