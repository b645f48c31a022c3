"""FastOps: the engine's row-invariant kernels behind the `Ops` protocol.

Shapes: T = rows, C = input features, R = output features, H/Hkv = heads, S = cached
positions, dq/dv = key/value width, K = top-k, D = hidden, I = expert intermediate.

Every backend computes the same bits (tests check it):
  * "c-avx512", "c-avx2", "c-neon", "c-portable" -- the C kernels of moetier/kernels/csrc/,
    built by the package install: one generic C implementation (portable) and one file
    per instruction set, chosen at run time by what the CPU has;
  * "numba" -- moetier/kernels/_nbkernels.py, the fallback when the extension is absent.
"auto" picks the process default (`set_default_backend`, from the `kernels.backend`
setting), else the best C path this CPU runs, else numba; "c" is the best C path.
The arithmetic contract that makes every kernel row-invariant, and every backend
bit-identical, is written at the top of csrc/mt.h.

This module validates inputs (ValueError naming the shapes), puts arrays in the layout
the kernels take, and groups MoE rows by expert. Everything numeric happens in a kernel
or in elementwise numpy, which is row-invariant by nature.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from moetier.model.ops import combine_slots, head_linears_by_head, install_c_steps, unique_ids
from moetier.weights.quant import MXFP4_GROUP, QDTYPES, ExpertWeights, QTensor

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]
I32 = npt.NDArray[np.int32]
Backend = Literal["auto", "c", "c-portable", "c-avx2", "c-avx512", "c-neon", "numba"]
BACKENDS: tuple[str, ...] = ("auto", "c", "c-portable", "c-avx2", "c-avx512", "c-neon", "numba")
_DT = {"f32": 0, "bf16": 1, "int8": 2, "int4": 3, "mxfp4": 4}

C_KERNELS_VERSION = 18  # MT_KERNELS_VERSION in csrc/mt.h
_C: ModuleType | None = None
_C_PROBLEM = ""
try:
    from moetier.kernels import _ckernels as _c

    if getattr(_c, "VERSION", None) == C_KERNELS_VERSION:
        _C = _c
    else:
        _C_PROBLEM = (f"the built C kernels are version {getattr(_c, 'VERSION', None)}, this source is "
                      f"{C_KERNELS_VERSION}: rebuild with `pip install -e .`")
except ImportError:  # built by the install; absent when no compiler was available
    _C_PROBLEM = "the C kernels are not built (no C compiler at install time?)"
if _C is not None:
    install_c_steps(_C.combine, _C.rope)


def c_available() -> bool:
    """True when the C extension was built (pip install compiles it) from this source."""
    return _C is not None


def c_problem() -> str:
    """Why the C kernels are not in use ("" when they are)."""
    return _C_PROBLEM


def c_paths() -> dict[str, bool]:
    """Every C kernel path in this build, best first: {"c-avx2": True (this CPU runs it), ...}."""
    return {} if _C is None else {f"c-{name}": bool(ok) for name, ok in _C.isas()}


def c_best() -> str | None:
    """The best C path this CPU runs ("c-avx2", ...), or None without the extension."""
    return next((name for name, ok in c_paths().items() if ok), None)


def c_has_simd() -> bool:
    """True when the C extension runs a SIMD path (anything but c-portable) on this CPU."""
    return c_best() not in (None, "c-portable")


_DEFAULT: Backend = "auto"
Activations = Literal["exact", "int8"]
_DEFAULT_ACTIVATIONS: Activations = "exact"


def set_default_backend(backend: Backend) -> None:
    """The backend `FastOps("auto")` means in this process (the `kernels.backend` setting,
    applied once by each service's main()). Checked now: an unknown name, or a path this
    CPU or build lacks, is a ValueError naming what exists."""
    global _DEFAULT
    if backend != "auto":
        _resolve(backend)
    _DEFAULT = backend


def set_default_activations(activations: Activations) -> None:
    """What `FastOps(activations=None)` means in this process (the `kernels.activations`
    setting). "int8" is lossy (see the int8-activation contract in csrc/mt.h) and logged."""
    global _DEFAULT_ACTIVATIONS
    if activations not in ("exact", "int8"):
        raise ValueError(f"unknown activations {activations!r}; expected exact or int8")
    if activations == "int8":
        log.warning("kernels: int8 activations (LOSSY: activations rounded to int8 per block of 64 in every "
                    "int8/int4 linear; outputs differ from the exact kernels)")
    _DEFAULT_ACTIVATIONS = activations


def set_idle_spin(us: float) -> None:
    """How long an idle kernel thread of this process polls for the next call before it sleeps,
    in microseconds (the `kernels.idle_spin_us` setting; 0: it sleeps at once). A sleeping
    helper joins the next call late, by the wake-up latency of the machine (0.42 ms at p90 on
    a virtual machine whose idle vCPUs halt); a polling one joins at once and yields its CPU
    to any thread with work. Changes no result bit, only which thread computes a chunk."""
    if not us >= 0:  # also NaN
        raise ValueError(f"idle spin must be >= 0 microseconds, got {us}")
    if _C is not None:
        _C.pool_spin(int(us * 1000))


def park_helpers() -> None:
    """The calling thread is about to wait for another process (the dense worker for the expert
    store's answer, the store for the worker's next call): this process's polling kernel threads
    sleep now instead of polling out `kernels.idle_spin_us`, leaving the CPUs to the process that
    computes meanwhile. The next call wakes them. Changes no result bit."""
    if _C is not None:
        _C.pool_park()


def idle_spin_us() -> float:
    """The current idle polling time of the kernel threads (see `set_idle_spin`); 0 without C."""
    return _C.pool_spin() / 1000 if _C is not None else 0.0


def _resolve(backend: str) -> str:
    """A backend request -> the concrete backend name, or ValueError saying why not."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown kernel backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if _DEFAULT != "auto":
            return _resolve(_DEFAULT)
        best = c_best()
        if best is None:
            log.warning("%s; using the numba kernels (same bits, much slower)", _C_PROBLEM)
            return "numba"
        return best
    if backend == "numba":
        return backend
    if _C is None:
        raise ValueError(f"backend {backend!r}: {_C_PROBLEM}")
    if backend == "c":
        best = c_best()
        assert best is not None
        return best
    paths = c_paths()
    if backend not in paths:
        raise ValueError(f"backend {backend!r} is not in this build (built: {', '.join(paths)})")
    if not paths[backend]:
        runs = [n for n, ok in paths.items() if ok]
        raise ValueError(f"backend {backend!r}: this CPU lacks its instructions (it runs: {', '.join(runs)})")
    return backend


def default_threads() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


# ---------------------------------------------------------------- validation


def _i64(a: Any) -> npt.NDArray[np.int64]:
    """a as a C-contiguous int64 array, without np.require's cost when it already is one."""
    if type(a) is np.ndarray and a.dtype == np.int64 and a.flags.c_contiguous and a.flags.aligned:
        return a
    return np.require(a, np.int64, ["C", "A"])


def _f32(a: Any, name: str) -> F32:
    if type(a) is np.ndarray and a.dtype == np.float32 and a.flags.c_contiguous and a.flags.aligned:
        return a  # the common case, without np.require's cost (a decode step makes hundreds of calls)
    arr = np.asarray(a)
    if arr.dtype != np.float32:
        raise ValueError(f"{name} must be float32, got {arr.dtype} with shape {arr.shape}")
    return np.require(arr, np.float32, ["C", "A"])


_SPEC = "_fastops_spec"  # where a QTensor keeps its checked shape and kernel spec (see _spec)
# Rows up to which FastOps.head_linears runs the transposed kernel (linear_t); above, a float32
# copy of each W_h.T and the tiled linear (the same bits). Measured, 2 threads, Intel Xeon
# (AVX-512), MLA's 16 heads x 128 x 512 int8: linear_t 112 / 1627 / 3013 / 6396 us at 1 / 32 /
# 64 / 128 rows, the copy + linear 2492 / 3287 / 5092 us at 32 / 64 / 128.
LINEAR_T_MAX_ROWS = 96


def _spec(w: QTensor, name: str) -> tuple[int, int, tuple[int, np.ndarray, np.ndarray | None, int]]:
    """(rows, cols, the kernels' weight spec), checked once per tensor: a QTensor is
    immutable and its arrays are used in place (only a spec that needed no copy is kept, so
    the kernels always read the tensor's own arrays)."""
    got: tuple[int, int, tuple[int, np.ndarray, np.ndarray | None, int]] | None = w.__dict__.get(_SPEC)
    if got is not None:
        return got
    rows, cols = _matrix_shape(w, name)
    raw = _raw(w)
    out = (rows, cols, raw)
    same_scales = w.scales is None or (raw[2] is not None and raw[2].ctypes.data == w.scales.ctypes.data)
    if raw[1] is w.data and same_scales:
        w.__dict__[_SPEC] = out
    return out


def _matrix_shape(w: QTensor, name: str) -> tuple[int, int]:
    if w.dtype not in QDTYPES:
        raise ValueError(f"{name}: unknown dtype {w.dtype!r}")
    if len(w.shape) != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {w.shape}")
    rows, cols = (int(n) for n in w.shape)
    if w.dtype in ("f32", "bf16"):
        want = np.float32 if w.dtype == "f32" else np.uint16
        if w.data.dtype != want or w.data.shape != (rows, cols):
            raise ValueError(f"{name}: {w.dtype} data must be {np.dtype(want)} {(rows, cols)}, "
                             f"got {w.data.dtype} {w.data.shape}")
        return rows, cols
    g = int(w.group_size)
    if w.dtype == "mxfp4":
        cp = -(-cols // MXFP4_GROUP) * MXFP4_GROUP
        mx_want = ((rows, cp // 2), (rows, cp // MXFP4_GROUP))
        if (g != MXFP4_GROUP or w.scales is None or w.data.dtype != np.uint8 or w.scales.dtype != np.uint8
                or (w.data.shape, w.scales.shape) != mx_want):
            mx_got = (g, w.data.dtype, w.data.shape, None if w.scales is None else (w.scales.dtype, w.scales.shape))
            raise ValueError(f"{name}: mxfp4 for shape {w.shape} must be g={MXFP4_GROUP}, uint8 data {mx_want[0]} "
                             f"and uint8 e8m0 scales {mx_want[1]}, got {mx_got}")
        return rows, cols
    if g <= 0 or (w.dtype == "int4" and g % 2):
        raise ValueError(f"{name}: invalid group size {g} for {w.dtype}")
    cp = -(-cols // g) * g
    want_data = (rows, cp) if w.dtype == "int8" else (rows, cp // 2)
    want_dt = np.int8 if w.dtype == "int8" else np.uint8
    if w.data.dtype != want_dt or w.data.shape != want_data:
        raise ValueError(f"{name}: {w.dtype} data for shape {w.shape} (g={g}) must be "
                         f"{np.dtype(want_dt)} {want_data}, got {w.data.dtype} {w.data.shape}")
    if w.scales is None or w.scales.dtype != np.float16 or w.scales.shape != (rows, cp // g):
        got = None if w.scales is None else (w.scales.dtype, w.scales.shape)
        raise ValueError(f"{name}: {w.dtype} scales for shape {w.shape} (g={g}) must be "
                         f"float16 {(rows, cp // g)}, got {got}")
    return rows, cols


def _raw(w: QTensor) -> tuple[int, np.ndarray, np.ndarray | None, int]:
    """(dtype code, data, float16 scales as uint16 bits, g), contiguous and aligned."""
    data = np.require(w.data, None, ["C", "A"])
    scales = None if w.scales is None else np.require(w.scales, None, ["C", "A"])
    if scales is not None and w.dtype != "mxfp4":  # float16 bits; mxfp4's e8m0 bytes go as they are
        scales = scales.view(np.uint16)
    return _DT[w.dtype], data, scales, int(w.group_size)


def _check_expert(w: ExpertWeights, e: int, d: int) -> int:
    ig, dg, _ = _spec(w.gate, f"expert {e} gate")
    iu, du, _ = _spec(w.up, f"expert {e} up")
    dd, id_, _ = _spec(w.down, f"expert {e} down")
    if not (dg == du == dd == d and ig == iu == id_):
        raise ValueError(f"expert {e}: gate {w.gate.shape}, up {w.up.shape}, down {w.down.shape} "
                         f"do not fit x [T, {d}] (want gate/up [I, {d}], down [{d}, I])")
    for what, b, n in (("gate_bias", w.gate_bias, ig), ("up_bias", w.up_bias, ig), ("down_bias", w.down_bias, d)):
        if b is not None and (b.dtype != np.float32 or b.shape != (n,) or not b.flags.c_contiguous):
            raise ValueError(f"expert {e}: {what} must be float32 [{n}], got {b.dtype} {b.shape}")
    return ig


# ---------------------------------------------------------------- backends


class _CBackend:
    def __init__(self, mod: ModuleType, isa: int, threads: int, int8: bool = False) -> None:
        self.mod, self.isa, self.threads = mod, isa, threads  # isa: the path's index in mod.isas()
        self.int8 = int8  # the int8-activation contract (lossy)

    def linear(self, x: F32, w: QTensor, bias: F32 | None, out: F32) -> None:
        t, c = x.shape
        self.mod.linear(x, t, c, out.shape[1], _spec(w, "w")[2], bias, out, self.isa, self.threads, self.int8)

    def linears(self, x: F32, ws: Sequence[tuple[QTensor, F32 | None, F32]]) -> None:
        t, c = x.shape
        self.mod.linears(x, t, c, [(out.shape[1], _spec(w, "w")[2], bias, out) for w, bias, out in ws],
                         self.isa, self.threads, self.int8)

    def ffn(self, x: F32, w: ExpertWeights, out: F32) -> None:
        t, d = x.shape
        if _plain(w):
            self.mod.ffn(x, t, d, w.gate.shape[0], _spec(w.gate, "gate")[2], _spec(w.up, "up")[2],
                         _spec(w.down, "down")[2], out, self.isa, self.threads, self.int8)
            return
        hg, hu = _hidden(self, x, w)
        self.mod.glu_clamped(hg, hu, hg.size, w.act.alpha, w.act.limit)
        self.linear(hg, w.down, w.down_bias, out)

    def experts(self, x: F32, ids: npt.NDArray[np.int64], out: F32, specs: list[tuple[Any, ...]]) -> None:
        """out[t, k] = FFN_e(x[t]) where ids[t, k] = e, for the listed plain experts (their
        `_expert_spec`s), in one call (their few rows each share the pool's jobs)."""
        t, d = x.shape
        self.mod.experts(x, t, d, ids, ids.shape[1], out, specs, self.isa, self.threads, self.int8)

    def rmsnorm(self, x: F32, weight: F32, eps: float, out: F32) -> None:
        self.mod.rmsnorm(x, x.shape[0], x.shape[1], weight, eps, out, self.isa)

    def softmax(self, x: F32, out: F32) -> None:
        self.mod.softmax(x, x.shape[0], x.shape[1], out, self.isa)

    def attention(self, q: F32, k: F32, v: F32, q_pos: npt.NDArray[np.int64], scale: float, out: F32,
                  sinks: F32 | None, window: int) -> None:
        t, h, dq = q.shape
        s, hkv, dv = v.shape
        self.mod.attention(q, k, v, q_pos, t, h, s, hkv, dq, dv, scale, out, self.isa, self.threads, sinks, window)


_EXPERT_SPEC = "_fastops_expert"  # where an ExpertWeights keeps its checked kernel spec (see _expert_spec)


def _expert_spec(w: ExpertWeights, e: int, d: int) -> tuple[Any, ...]:
    """(e, I, gate, up and down kernel specs) of an expert checked for x [T, d]; checked once
    per expert and width (a decode step passes every expert of a layer each time), kept where
    each of its tensors kept its own spec (see _spec)."""
    got = w.__dict__.get(_EXPERT_SPEC)
    if got is not None and got[0] == d:
        return (e, *got[1])
    i = _check_expert(w, e, d)
    spec = (i, _spec(w.gate, "gate")[2], _spec(w.up, "up")[2], _spec(w.down, "down")[2])
    if all(_SPEC in t.__dict__ for t in (w.gate, w.up, w.down)):
        w.__dict__[_EXPERT_SPEC] = (d, spec)
    return (e, *spec)


def _plain(w: ExpertWeights) -> bool:
    """A SwiGLU expert without biases: the fused ffn kernel."""
    return w.act.kind == "silu" and w.gate_bias is None and w.up_bias is None and w.down_bias is None


def _hidden(k: _CBackend | _NumbaBackend, x: F32, w: ExpertWeights) -> tuple[F32, F32]:
    """gate x + gate_bias, up x + up_bias: [T, I] each (an expert with biases, gpt-oss)."""
    if w.act.kind != "clamped_swiglu":
        raise ValueError(f"expert activation {w.act.kind!r} with biases is not supported (clamped_swiglu)")
    t, i = x.shape[0], w.gate.shape[0]
    hg = np.empty((t, i), dtype=np.float32)
    hu = np.empty((t, i), dtype=np.float32)
    k.linear(x, w.gate, w.gate_bias, hg)
    k.linear(x, w.up, w.up_bias, hu)
    return hg, hu


_NO_SCALES = np.zeros((1, 0), dtype=np.uint16)
_NO_BIAS = np.zeros(0, dtype=np.float32)


class _NumbaBackend:
    def __init__(self, threads: int) -> None:
        # numba and llvmlite are imported here, by the backend that runs on them, not with
        # this module: a process on the C kernels would hold ~60 MB of compiler it never uses
        # (per service, memory the expert cache could have under a cap)
        from moetier.kernels import _nbkernels

        self.nb = _nbkernels
        self.threads = threads

    @staticmethod
    def _bytes(w: QTensor) -> tuple[np.ndarray, np.ndarray, int, int]:
        code, data, scales, g = _raw(w)
        rows = data.shape[0]
        if scales is not None and scales.dtype == np.uint8:  # mxfp4's e8m0 bytes: one signature for all
            scales = scales.astype(np.uint16)
        return data.view(np.uint8).reshape(rows, -1), (_NO_SCALES if scales is None else scales), code, g

    def _threads(self) -> None:
        import numba

        most = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
        numba.set_num_threads(max(1, min(self.threads, most)))

    def linear(self, x: F32, w: QTensor, bias: F32 | None, out: F32) -> None:
        data, scales, code, g = self._bytes(w)
        self._threads()
        self.nb.linear(x, data, scales, code, max(g, 1), x.shape[1], _NO_BIAS if bias is None else bias,
                       bias is not None, out)

    def ffn(self, x: F32, w: ExpertWeights, out: F32) -> None:
        if not _plain(w):
            hg, hu = _hidden(self, x, w)
            self.nb.glu_clamped(hg, hu, np.float32(w.act.alpha), np.float32(w.act.limit))
            self.linear(hg, w.down, w.down_bias, out)
            return
        t, i = x.shape[0], w.gate.shape[0]
        hg = np.empty((t, i), dtype=np.float32)
        hu = np.empty((t, i), dtype=np.float32)
        self.linear(x, w.gate, None, hg)
        self.linear(x, w.up, None, hu)
        self.nb.swiglu(hg, hu)
        self.linear(hg, w.down, None, out)

    def rmsnorm(self, x: F32, weight: F32, eps: float, out: F32) -> None:
        self.nb.rmsnorm(x, weight, np.float32(eps), out)

    def softmax(self, x: F32, out: F32) -> None:
        self.nb.softmax(x, out)

    def attention(self, q: F32, k: F32, v: F32, q_pos: npt.NDArray[np.int64], scale: float, out: F32,
                  sinks: F32 | None, window: int) -> None:
        self._threads()
        self.nb.attention(q, k, v, q_pos, np.float32(scale), out, _NO_BIAS if sinks is None else sinks,
                          sinks is not None, int(window))


class ExpertTable:
    """A layer's experts held by the kernels for FastOps.moe_block (FastOps.expert_table)."""

    __slots__ = ("d", "experts", "handle")

    def __init__(self, handle: object, experts: int, d: int) -> None:
        self.handle, self.experts, self.d = handle, experts, d


# ---------------------------------------------------------------- FastOps


class FastOps:
    """The `Ops` protocol on row-invariant kernels (see the module docstring).

    backend: "auto" (the process default, else the best C path, else numba), "c" (the
    best C path this CPU runs), one C path by name ("c-avx2", "c-avx512", "c-neon",
    "c-portable": the same bits, for tests and benchmarks), "numba".
    threads: worker threads per call (default: the CPUs this process may run on).
    activations: "exact" (the contract; default) or "int8" (lossy: int8 and int4 linears
    quantize their inputs per block of 64 and multiply in integers, see the int8-activation
    contract in csrc/mt.h; C kernels only); None: the process default.
    """

    def __init__(self, backend: Backend = "auto", threads: int | None = None,
                 activations: Activations | None = None) -> None:
        self.threads = threads if threads is not None else default_threads()
        if self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        self.backend = _resolve(backend)
        self.activations: Activations = activations or _DEFAULT_ACTIVATIONS
        if self.activations not in ("exact", "int8"):
            raise ValueError(f"unknown activations {self.activations!r}; expected exact or int8")
        if self.backend == "numba":
            if self.activations != "exact":
                raise ValueError("int8 activations need the C kernels; the numba backend computes exact only")
            self._k: _CBackend | _NumbaBackend = _NumbaBackend(self.threads)
        else:
            assert _C is not None
            index = [f"c-{name}" for name, _ in _C.isas()].index(self.backend)
            self._k = _CBackend(_C, index, self.threads, self.activations == "int8")

    def __repr__(self) -> str:
        return f"FastOps(backend={self.backend!r}, threads={self.threads}, activations={self.activations!r})"

    def linear(self, x: F32, w: QTensor, bias: F32 | None = None) -> F32:
        """x [T, C] @ w[R, C].T (+ bias [R]) -> [T, R]."""
        x = _f32(x, "x")
        bias, out = _linear_args(x, w, bias, "linear")
        if x.shape[0] and out.shape[1]:
            self._k.linear(x, w, bias, out)
        return out

    def head_linears(self, x: F32, w: QTensor, stride: int, offset: int, rows: int, *, transposed: bool,
                     out: F32 | None = None) -> F32:
        """moetier.model.ops.head_linears: per head, the stored rows w[h * stride + offset :
        + rows], one kernel call for every head, no float32 copy (transposed: used as inputs),
        exact activations in either setting."""
        x = _f32(x, "x")
        _, cols, spec = _spec(w, "w")
        if x.ndim != 3:
            raise ValueError(f"head_linears: x must be [T, H, *], got {x.shape}")
        t, heads, xw = x.shape
        n_in, n_out = (rows, cols) if transposed else (cols, rows)
        if stride < rows or offset < 0 or (heads - 1) * stride + offset + rows > w.shape[0] or xw < n_in:
            raise ValueError(f"head_linears: {heads} heads of {rows} rows (stride {stride}, offset {offset}) "
                             f"of w {w.shape} with x {x.shape}")
        if out is None:
            out = np.empty((t, heads, n_out), dtype=np.float32)
        elif (out.dtype != np.float32 or not out.flags.c_contiguous or out.ndim != 3
              or out.shape[:2] != (t, heads) or out.shape[2] < n_out):
            raise ValueError(f"head_linears: out must be C-contiguous float32 [{t}, {heads}, >= {n_out}], "
                             f"got {out.dtype} {out.shape}")
        if not t:
            return out
        if not isinstance(self._k, _CBackend) or (transposed and t > LINEAR_T_MAX_ROWS):
            return head_linears_by_head(self.linear, x, w, stride, offset, rows, transposed=transposed, out=out)
        k = self._k
        if transposed:
            k.mod.linear_t(x, heads * xw, xw, t, heads, rows, spec, w.shape[0], cols, stride, offset, out,
                           heads * out.shape[2], out.shape[2], k.threads)
            return out
        # exact: the int8-activation contract is for the model's own linears
        k.mod.head_linears(x, heads * xw, xw, t, heads, rows, spec, w.shape[0], cols, stride, offset, out,
                           heads * out.shape[2], out.shape[2], k.isa, k.threads)
        return out

    def linears(self, x: F32, ws: Sequence[tuple[QTensor, F32 | None]]) -> list[F32]:
        """[linear(x, w, bias) for (w, bias) in ws], computed together (one job of the kernels'
        pool: an attention layer's q, k and v); the same bits as one by one."""
        x = _f32(x, "x")
        if not isinstance(self._k, _CBackend) or not 1 <= len(ws) <= 64:
            return [self.linear(x, w, b) for w, b in ws]
        todo = [(w, *_linear_args(x, w, bias, "linears")) for w, bias in ws]
        if x.shape[0] and all(out.shape[1] for _, _, out in todo):
            self._k.linears(x, todo)
        elif x.shape[0]:
            for w, bias, out in todo:
                if out.shape[1]:
                    self._k.linear(x, w, bias, out)
        return [out for _, _, out in todo]

    def rmsnorm(self, x: F32, weight: F32, eps: float) -> F32:
        """Row-wise x / sqrt(mean(x^2) + eps) * weight; x [T, C] -> [T, C]."""
        x = _f32(x, "x")
        weight = _f32(weight, "weight")
        if x.ndim != 2 or weight.shape != (x.shape[1],):
            raise ValueError(f"rmsnorm: x {x.shape} and weight {weight.shape} do not fit (want x [T, C], weight [C])")
        out = np.empty_like(x)
        if x.size:
            self._k.rmsnorm(x, weight, float(eps), out)
        return out

    def softmax(self, x: F32) -> F32:
        """Row-wise softmax over the last axis; x [T, N] -> [T, N] (any leading shape)."""
        x = _f32(x, "x")
        if x.ndim < 1 or x.shape[-1] == 0:
            raise ValueError(f"softmax: x {x.shape} has no last axis to normalise")
        flat = x.reshape(-1, x.shape[-1])
        out = np.empty_like(flat)
        if flat.shape[0]:
            self._k.softmax(flat, out)
        return out.reshape(x.shape)

    def attention(self, q: F32, k: F32, v: F32, q_pos: npt.NDArray[np.int64], scale: float,
                  sinks: F32 | None = None, window: int = 0) -> F32:
        """q [T, H, dq], k [S, Hkv, dq], v [S, Hkv, dv], q_pos [T] -> [T, H, dv] (causal by q_pos;
        sinks [H]: a learned logit per head in the softmax; window W: keys q_pos - W + 1 .. q_pos)."""
        q, k, v = _f32(q, "q"), _f32(k, "k"), _f32(v, "v")
        pos = np.asarray(q_pos)
        if q.ndim != 3 or k.ndim != 3 or v.ndim != 3:
            raise ValueError(f"attention: want q [T, H, dq], k [S, Hkv, dq], v [S, Hkv, dv]; "
                             f"got q {q.shape}, k {k.shape}, v {v.shape}")
        t, h, dq = q.shape
        s, hkv, dv = v.shape
        if k.shape[:2] != (s, hkv) or k.shape[2] != dq:
            raise ValueError(f"attention: k {k.shape} does not fit q {q.shape} and v {v.shape}")
        if hkv < 1 or h % hkv:
            raise ValueError(f"attention: {h} query heads (q {q.shape}) are not a multiple of "
                             f"{hkv} key/value heads (k {k.shape})")
        if pos.shape != (t,) or pos.dtype.kind not in "iu":
            raise ValueError(f"attention: q_pos must be integers of shape ({t},), got {pos.dtype} {pos.shape}")
        pos = _i64(pos)
        if t:
            # a decode step's few positions: min and max of the list, without numpy's cost per call
            few = pos.tolist() if t <= 64 else None
            lo, hi = (min(few), max(few)) if few is not None else (int(pos.min()), int(pos.max()))
            if lo < 0 or hi >= s:
                raise ValueError(f"attention: q_pos {lo}..{hi} outside the {s} cached positions")
        if sinks is not None:
            sinks = _f32(sinks, "sinks")
            if sinks.shape != (h,):
                raise ValueError(f"attention: sinks {sinks.shape} do not fit {h} query heads (want [{h}])")
        if window < 0:
            raise ValueError(f"attention: sliding window {window} must be >= 0 (0: none)")
        out = np.empty((t, h, dv), dtype=np.float32)
        if t and h and dv:
            self._k.attention(q, k, v, pos, float(scale), out, sinks, int(window))
        return out

    def route_softmax(self, h: F32, w: QTensor, bias: F32 | None, k: int) -> tuple[I32, F32] | None:
        """The softmax router's choice (moetier.model.router.select_experts without a correction
        bias or expert groups): scores = softmax(h @ w.T + bias) [T, E]; ids [T, k] int32, the k
        best of each row, best first, the lower expert on ties (a NaN after every number); and
        their scores [T, k]. One kernel call running the linear and softmax the Python path
        runs, so the same bits. None where this backend has no such call."""
        if not isinstance(self._k, _CBackend):
            return None
        h = _f32(h, "h")
        rows, cols, spec = _spec(w, "w")
        if h.ndim != 2 or h.shape[1] != cols or not 1 <= k <= rows:
            raise ValueError(f"route_softmax: h {h.shape}, router {w.shape} and {k} experts a row do not fit")
        t = h.shape[0]
        ids, chosen = np.empty((t, k), np.int32), np.empty((t, k), np.float32)
        if t:
            b = self._k
            b.mod.route_softmax(h, t, cols, rows, spec, None if bias is None else _f32(bias, "bias"), k, ids, chosen,
                                b.isa, b.threads, b.int8)
        return ids, chosen

    def gqa_block(self, x: F32, norm: F32, eps: float, qkv: Sequence[tuple[QTensor, F32 | None]], wo: QTensor,
                  bo: F32 | None, q_norm: F32 | None, k_norm: F32 | None, qk_mode: int, clip: float | None,
                  heads: int, kv_heads: int, head_dim: int, cos: F32, sin: F32, interleave: bool, k_cache: F32,
                  v_cache: F32, q_pos: npt.NDArray[np.int64], scale: float, sinks: F32 | None,
                  window: int) -> F32 | None:
        """One GQA attention layer over one sequence's rows, residual stream in and out
        (moetier.model.attention.GqaAttention.block): x [T, D] -> x + o(attention(...)) [T, D].
        The rows' k and v (after the q/k norms of qk_mode -- 0 none, 1 over the whole
        projection, 2 per head --, q, k and v clipped to [-clip, clip] where clip is not None, and
        the rotation of q and k by cos, sin [T, P]) go to the last T rows of k_cache, v_cache
        [S, Hkv, hd] (float32, C-contiguous, written in place); attention reads all S at q_pos
        [T] (positions in the cache). One kernel call running what rmsnorm, linears, rmsnorm,
        Rope.apply, KVCache.put, attention and linear run one by one, so the same bits. None
        where this backend has no such call (the caller runs those steps). `gqa_layer` checks
        the layer's own arguments once, for a layer called every step."""
        run = self.gqa_layer(norm, eps, qkv, wo, bo, q_norm, k_norm, qk_mode, clip, heads, kv_heads, head_dim,
                             interleave, scale, sinks, window)
        return None if run is None else run(x, cos, sin, k_cache, v_cache, q_pos)

    def gqa_layer(self, norm: F32, eps: float, qkv: Sequence[tuple[QTensor, F32 | None]], wo: QTensor,
                  bo: F32 | None, q_norm: F32 | None, k_norm: F32 | None, qk_mode: int, clip: float | None,
                  heads: int, kv_heads: int, head_dim: int, interleave: bool, scale: float, sinks: F32 | None,
                  window: int) -> Callable[[F32, F32, F32, F32, F32, npt.NDArray[np.int64]], F32] | None:
        """`gqa_block` with the layer's own arguments checked once: run(x, cos, sin, k_cache,
        v_cache, q_pos) -> [T, D], checking only those. None where this backend has no such call."""
        if not isinstance(self._k, _CBackend):
            return None
        norm = _f32(norm, "norm")
        d = norm.shape[0]
        specs = []
        for w, b, rows, cols in ((*qkv[0], heads * head_dim, d), (*qkv[1], kv_heads * head_dim, d),
                                 (*qkv[2], kv_heads * head_dim, d), (wo, bo, d, heads * head_dim)):
            r, c, spec = _spec(w, "w")
            if (r, c) != (rows, cols):
                raise ValueError(f"gqa_block: a projection of shape {w.shape} where the layer needs ({rows}, {cols})")
            specs.append((r, spec, None if b is None else _f32(b, "bias")))
        k = self._k
        mid = (None if q_norm is None else _f32(q_norm, "q_norm"), None if k_norm is None else _f32(k_norm, "k_norm"),
               qk_mode, clip is not None, 0.0 if clip is None else float(np.float32(clip)), heads, kv_heads, head_dim)
        tail = (float(scale), None if sinks is None else _f32(sinks, "sinks"), int(window))
        gqa, eps = k.mod.gqa_block, float(eps)
        cache_shape = (kv_heads, head_dim)

        def run(x: F32, cos: F32, sin: F32, k_cache: F32, v_cache: F32, q_pos: npt.NDArray[np.int64]) -> F32:
            x, cos, sin = _f32(x, "x"), _f32(cos, "cos"), _f32(sin, "sin")
            for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
                if not (type(cache) is np.ndarray and cache.dtype == np.float32 and cache.flags.c_contiguous
                        and cache.flags.writeable):
                    raise ValueError(f"gqa_block: {name} must be a writeable C-contiguous float32 array")
            pos = _i64(q_pos)
            t = x.shape[0]
            if (x.ndim != 2 or x.shape[1] != d or pos.shape != (t,) or k_cache.shape != v_cache.shape
                    or k_cache.shape[1:] != cache_shape or cos.ndim != 2 or cos.shape != sin.shape
                    or cos.shape[0] != t):
                raise ValueError(f"gqa_block: x {x.shape}, q_pos {pos.shape}, cos {cos.shape}, sin {sin.shape}, "
                                 f"k_cache {k_cache.shape} and v_cache {v_cache.shape} do not fit a layer of width "
                                 f"{d} with {kv_heads} key/value heads of {head_dim}")
            out = np.empty_like(x)
            gqa(x, t, d, norm, eps, *specs, *mid, cos, sin, cos.shape[1], interleave, k_cache, v_cache,
                k_cache.shape[0], pos, *tail, out, k.isa, k.threads, k.int8)
            return out

        return run

    def expert_ffn(self, x: F32, w: ExpertWeights) -> F32:
        """One SwiGLU expert: down(silu(gate x) * up x); x [T, D] -> [T, D]."""
        x = _f32(x, "x")
        if x.ndim != 2:
            raise ValueError(f"expert_ffn: x must be [T, D], got {x.shape}")
        _check_expert(w, -1, x.shape[1])
        out = np.empty_like(x)
        if x.shape[0]:
            self._k.ffn(x, w, out)
        return out

    def moe(self, x: F32, ids: npt.NDArray[np.int32], weights: F32, experts: Mapping[int, ExpertWeights]) -> F32:
        """out[t] = sum_k weights[t, k] * FFN_{ids[t, k]}(x[t]), the sum in k order; x [T, D] -> [T, D].

        Rows routed to one expert are computed in one call; each row's result is
        independent of its companions (the linear kernels are row-invariant) and the
        combine is elementwise, in k order, exactly as the reference writes it
        (`combine_slots`). Exactly `expert_outputs` over every routed expert, then
        `combine_slots`: computing the experts in waves gives the same bits.
        """
        x, ids_a = self._moe_rows(x, ids, "moe")
        weights = _f32(weights, "weights")
        if weights.shape != ids_a.shape:
            raise ValueError(f"moe: want x [T, D], ids [T, K], weights [T, K]; got x {x.shape}, "
                             f"ids {ids_a.shape}, weights {weights.shape}")
        for e in np.unique(ids_a).tolist():
            if e not in experts:
                raise ValueError(f"moe: expert {e} is routed to but not among the {len(experts)} experts given")
        ys = np.zeros((*ids_a.shape, x.shape[1]), dtype=np.float32)  # [T, K, D]
        self._expert_outputs(x, ids_a, experts, ys)
        return combine_slots(ys, weights)

    def moe_plain(self, x: F32, ids: npt.NDArray[np.int32], weights: F32,
                  experts: Mapping[int, ExpertWeights]) -> F32 | None:
        """`moe` in one kernel call -- every routed expert's slots, then the k-ordered combine --
        where every id of `ids` is in `experts` and each is a plain SwiGLU expert (no biases) on
        the C kernels: the same bits as `expert_outputs` into zeros and `combine_slots`. None
        otherwise (the caller takes those two)."""
        if not isinstance(self._k, _CBackend):
            return None
        x, ids_a = self._moe_rows(x, ids, "moe_plain")
        weights = _f32(weights, "weights")
        if weights.shape != ids_a.shape:
            raise ValueError(f"moe_plain: want x [T, D], ids [T, K], weights [T, K]; got x {x.shape}, "
                             f"ids {ids_a.shape}, weights {weights.shape}")
        t, d = x.shape
        specs = []
        for e in unique_ids(ids_a):
            w = experts.get(e)
            if w is None or not _plain(w):
                return None
            specs.append(_expert_spec(w, e, d))
        out = np.empty((t, d), dtype=np.float32)
        if t:
            k = self._k
            slots = np.zeros((*ids_a.shape, d), dtype=np.float32)  # [T, K, D]
            k.mod.experts(x, t, d, np.ascontiguousarray(ids_a, dtype=np.int64), ids_a.shape[1], slots, specs, k.isa,
                          k.threads, k.int8, weights, out)
        return out

    def expert_table(self, experts: Sequence[ExpertWeights | None], d: int) -> ExpertTable | None:
        """A layer's experts (`experts[e]`: expert e, None where it is not given) held for
        `moe_block` on x [T, d]; None where this backend has no such call or a given expert is
        not a plain SwiGLU expert. The table holds the experts' arrays until it is dropped."""
        if not isinstance(self._k, _CBackend):
            return None
        specs: list[tuple[Any, ...] | None] = []
        for e, w in enumerate(experts):
            if w is None:
                specs.append(None)
                continue
            if not _plain(w):
                return None
            specs.append(_expert_spec(w, e, d)[1:])
        return ExpertTable(self._k.mod.expert_table(d, specs), len(specs), d)

    def moe_block(self, x: F32, norm: F32, eps: float, router: QTensor, bias: F32 | None, k: int, renorm: bool,
                  scale: float, table: ExpertTable) -> tuple[F32, I32, F32]:
        """A MoE layer of the table's experts under a softmax router, residual stream in and out
        (moetier.model.ffn.MoeBlock.block): h = rmsnorm(x); ids, chosen = `route_softmax`(h,
        router, bias, k); weights = `routing_weights`(chosen) (renormalised where renorm, times
        scale); x + `moe_plain`(h, ids, weights). Returns (x [T, D], ids [T, k] int32, weights
        [T, k]). One kernel call running what those calls run, so the same bits. A routed expert
        the table lacks is a ValueError."""
        x = _f32(x, "x")
        b = self._k
        if not isinstance(b, _CBackend):
            raise ValueError("moe_block: this backend has no such call (see expert_table)")
        rows, cols, spec = _spec(router, "router")
        t = x.shape[0]
        if x.ndim != 2 or x.shape[1] != table.d or cols != table.d or rows != table.experts or not 1 <= k <= rows:
            raise ValueError(f"moe_block: x {x.shape}, router {router.shape}, {k} experts a row and a table of "
                             f"{table.experts} experts of width {table.d} do not fit")
        out = np.empty_like(x)
        ids, weights = np.empty((t, k), np.int32), np.empty((t, k), np.float32)
        if t:
            b.mod.moe_block(x, t, table.d, _f32(norm, "norm"), float(eps), spec, None if bias is None else
                            _f32(bias, "bias"), k, renorm, float(scale), table.handle, out, ids, weights, b.isa,
                            b.threads, b.int8)
        return out, ids, weights

    def expert_outputs(self, x: F32, ids: npt.NDArray[np.int32], experts: Mapping[int, ExpertWeights],
                       out: F32) -> None:
        """out[t, k] = FFN_{ids[t, k]}(x[t]) for every (row, slot) routed to an expert in
        `experts`; other slots are left as they are. x [T, D], ids [T, K], out [T, K, D] float32
        C-contiguous. Each slot's bits are those `moe` computes for it (see `Ops.expert_outputs`)."""
        x, ids_a = self._moe_rows(x, ids, "expert_outputs")
        want = (*ids_a.shape, x.shape[1])
        if not (isinstance(out, np.ndarray) and out.dtype == np.float32 and out.shape == want
                and out.flags.c_contiguous and out.flags.writeable):
            got = (out.dtype, out.shape) if isinstance(out, np.ndarray) else type(out)
            raise ValueError(f"expert_outputs: out must be a writeable C-contiguous float32 {want} "
                             f"([T, K, D]), got {got}")
        self._expert_outputs(x, ids_a, experts, out)

    @staticmethod
    def _moe_rows(x: F32, ids: npt.NDArray[np.int32], what: str) -> tuple[F32, npt.NDArray[np.integer[Any]]]:
        x = _f32(x, "x")
        ids_a = np.asarray(ids)
        if x.ndim != 2 or ids_a.ndim != 2 or ids_a.shape[0] != x.shape[0]:
            raise ValueError(f"{what}: want x [T, D], ids [T, K]; got x {x.shape}, ids {ids_a.shape}")
        if ids_a.dtype.kind not in "iu":
            raise ValueError(f"{what}: ids must be integers, got {ids_a.dtype}")
        return x, ids_a

    def _expert_outputs(self, x: F32, ids: npt.NDArray[np.integer[Any]], experts: Mapping[int, ExpertWeights],
                        out: F32) -> None:
        t, d = x.shape
        k = ids.shape[1]
        ys = out.reshape(t * k, d)  # a view: row t*K + j = slot j of row t
        flat = ids.reshape(-1)
        plain: list[tuple[Any, ...]] = []
        c_backend = isinstance(self._k, _CBackend)
        for e in unique_ids(flat):
            w = experts.get(e)
            if w is None:
                continue
            if c_backend and _plain(w):
                plain.append(_expert_spec(w, e, d))
                continue
            _check_expert(w, e, d)
            slots = np.flatnonzero(flat == e)  # flat (row, slot) positions, rows ascending
            xe = np.ascontiguousarray(x[slots // k])  # [n, D]
            ye = np.empty_like(xe)
            self._k.ffn(xe, w, ye)
            ys[slots] = ye
        if plain:
            assert isinstance(self._k, _CBackend)
            self._k.experts(x, np.ascontiguousarray(ids, dtype=np.int64), out, plain)


def _linear_args(x: F32, w: QTensor, bias: F32 | None, what: str) -> tuple[F32 | None, F32]:
    """A linear's checked bias and its output [T, R] (empty), or ValueError naming the misfit."""
    rows, cols, _ = _spec(w, "w")
    if x.ndim != 2 or x.shape[1] != cols:
        raise ValueError(f"{what}: x {x.shape} does not fit w {w.shape} (want x [T, {cols}])")
    if bias is not None:
        bias = _f32(bias, "bias")
        if bias.shape != (rows,):
            raise ValueError(f"{what}: bias {bias.shape} does not fit w {w.shape} (want [{rows}])")
    return bias, np.empty((x.shape[0], rows), dtype=np.float32)


def _probe_isa(ops: FastOps) -> int:
    if not isinstance(ops._k, _CBackend):
        raise ValueError(f"the machine probes run on the C kernels; {ops.backend} has none")
    return ops._k.isa


def fma_peak_gflops(ops: FastOps, seconds: float = 0.3) -> float:
    """The FMA peak of `ops`' path on its threads: twelve independent fma chains per thread,
    GFLOP/s (an fma counts 2), best of three runs of about `seconds` each."""
    assert _C is not None
    isa, rounds, best = _probe_isa(ops), 200_000, 0.0
    while True:  # size the run to about `seconds`
        t = time.perf_counter()
        flops = float(_C.fma_probe(isa, ops.threads, rounds))
        dt = time.perf_counter() - t
        if dt >= seconds / 4 or rounds > 1 << 40:
            break
        rounds *= 4
    best = flops / dt
    for _ in range(2):
        t = time.perf_counter()
        flops = float(_C.fma_probe(isa, ops.threads, rounds))
        best = max(best, flops / (time.perf_counter() - t))
    return best / 1e9


def read_bandwidth_gbps(ops: FastOps, buf: np.ndarray, rounds: int = 3) -> float:
    """Memory read bandwidth on `ops`' threads and path: every byte of `buf` read once per
    round with vector loads, split between the threads; GB/s, best round."""
    assert _C is not None
    isa, best = _probe_isa(ops), 0.0
    for _ in range(max(1, rounds)):
        t = time.perf_counter()
        _C.read_probe(buf, isa, ops.threads)
        best = max(best, buf.nbytes / (time.perf_counter() - t))
    return best / 1e9


def warmup(backend: Backend = "auto") -> None:
    """Compile (numba) or touch (C) every kernel for the common dtypes.

    Services call this at start-up so the first request does not pay for JIT; numba's
    compiled code is cached on disk (cache=True), so later processes load it.
    """
    ops = FastOps(backend, threads=1)
    rng = np.random.default_rng(0)
    from moetier.weights.quant import quantize

    x = rng.standard_normal((2, 40), dtype=np.float32)
    for dt in QDTYPES:
        w = quantize(rng.standard_normal((6, 40), dtype=np.float32), dt, 32)
        ops.linear(x, w, np.zeros(6, dtype=np.float32))
    gate, up, down = (quantize(rng.standard_normal(s, dtype=np.float32), "int4", 32)
                      for s in ((8, 40), (8, 40), (40, 8)))
    ew = ExpertWeights(gate, up, down)
    ops.moe(x, np.array([[0], [0]], dtype=np.int32), np.ones((2, 1), dtype=np.float32), {0: ew})
    ops.rmsnorm(x, np.ones(40, dtype=np.float32), 1e-6)
    ops.softmax(x)
    q = rng.standard_normal((2, 2, 16), dtype=np.float32)
    kv = rng.standard_normal((3, 1, 16), dtype=np.float32)
    ops.attention(q, kv, kv, np.array([1, 2]), 0.25)
