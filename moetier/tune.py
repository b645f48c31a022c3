"""`moetier tune`'s domain: measure this machine's fastest safe settings on a model and keep
them as its profile (moetier/profile.py).

Each setting's candidates are measured one after the other, the others at their defaults, and
each candidate is checked on the way: it must give the default's bits (kernel threads: the
expert FFN's output bytes; prefetch depth: the greedy tokens of a decode; queue depth and
O_DIRECT: every record read is verified against its checksum by the I/O engine). A candidate
that differs is refused loudly, never chosen.

    results = tune(settings, model_dir, seconds=1.0, tokens=8)   # list[Result]
    profile = to_profile(results, rates)

Tuned: kernel threads of the dense worker (FastOps at batch 1 on the model's expert shape), the
expert store's I/O queue depth (= its read workers; random record reads, the smallest depth within
5% of the best), O_DIRECT on the primary disk (against buffered reads from a cold cache: the record
files' pages evicted with posix_fadvise first; buffered only when it is faster), and the prefetch
depth (the in-process engine's decode tok/s at the configured expert cache). Not tunable here:
prefetch lookahead (the model's fixed PREFETCH_PLAN hints this MoE layer and the next two; there is
no setting), the store's inline-compute threshold (a constant of the expert store,
services/expert_store/core.py INLINE_ROWS), and speculation (this project has no MTP drafting yet).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from moetier import probe
from moetier.errors import DataCorruption
from moetier.kernels.fast import FastOps, default_threads, warmup
from moetier.settings import Settings

log = logging.getLogger(__name__)

DEPTHS = (1, 2, 4, 8, 16, 32, 64)
PREFETCH_DEPTHS = (0, 16, 64, 256)
DEPTH_SLACK = 0.95  # the smallest depth within 5% of the best: fewer threads for the same GB/s


@dataclass
class Result:
    setting: str
    default: Any
    chosen: Any
    unit: str
    figures: dict[str, float] = field(default_factory=dict)  # candidate (as str) -> measured figure
    note: str = ""

    @property
    def gain(self) -> float:
        """The chosen candidate's figure over the default's, minus one (0: the default is best)."""
        d, c = self.figures.get(str(self.default)), self.figures.get(str(self.chosen))
        return c / d - 1 if d and c else 0.0


def tune_threads(model: Path, seconds: float, say: Callable[[str], None]) -> tuple[Result, probe.KernelRate]:
    from moetier.weights.container import Container

    with Container.open(model) as c:
        a, q = c.args, c.quantization
    experts = probe.random_experts(a.hidden_size, a.moe_intermediate_size, q["experts"], q["group_size"], 64 << 20)
    n = default_threads()
    candidates = sorted({1, *range(2, n + 1, max(1, n // 4)), n})
    x = np.random.default_rng(2).standard_normal((16, a.hidden_size), dtype=np.float32)
    want = FastOps(threads=n).expert_ffn(x, experts[0]).tobytes()
    res = Result("kernel_threads (dense worker)", n, n, "GB/s of expert weights at batch 1")
    rates: dict[int, probe.KernelRate] = {}
    for t in candidates:
        ops = FastOps(threads=t)
        if ops.expert_ffn(x, experts[0]).tobytes() != want:
            raise DataCorruption(f"FastOps with {t} threads gives other bits than with {n}: the kernels' "
                                 "thread invariance is broken; nothing is saved")
        rates[t] = probe.kernel_gbps(experts, 1, seconds, ops)
        res.figures[str(t)] = rates[t].gbps
        say(f"  kernel threads {t}: {rates[t].gbps:.2f} GB/s (bits equal)")
    res.chosen = max(rates, key=lambda t: rates[t].gbps)
    return res, rates[res.chosen]


def tune_depth(model: Path, default: int, seconds: float, say: Callable[[str], None]) -> tuple[Result, float]:
    from moetier.weights.index import ExpertIndex

    index = ExpertIndex.load(model)
    res = Result("storage.queue_depth", default, default, "GB/s of random record reads")
    for d in sorted({*DEPTHS, default}):
        r = probe.disk_gbps(index, d, seconds)
        res.figures[str(d)] = r.gbps
        say(f"  queue depth {d}: {r.gbps:.2f} GB/s ({'O_DIRECT' if r.direct else 'buffered'}, {r.reads} reads, "
            "checksums verified)")
    best = max(res.figures.values())
    res.chosen = min(int(d) for d, g in res.figures.items() if g >= DEPTH_SLACK * best)
    return res, res.figures[str(res.chosen)]


def tune_direct(model: Path, depth: int, seconds: float, say: Callable[[str], None]) -> Result:
    from moetier.weights.index import ExpertIndex

    res = Result("storage.direct_io", True, True, "GB/s of random record reads from a cold cache")
    index = ExpertIndex.load(model)
    r = probe.disk_gbps(index, depth, seconds)
    res.figures["True"] = r.gbps
    if not r.direct:
        res.note = "O_DIRECT is refused on this filesystem: reads are buffered either way"
        return res
    b = probe.disk_gbps(index, depth, seconds, direct=False)  # the files' cached pages evicted first
    probe.evict_cached([index.root / f for f in index.files])  # leave no copy behind
    res.figures["False"] = b.gbps
    say(f"  O_DIRECT: {r.gbps:.2f} GB/s, buffered (from a cold cache): {b.gbps:.2f} GB/s")
    res.chosen = b.gbps <= r.gbps  # O_DIRECT unless buffered reads are faster even cold
    return res


def tune_prefetch(settings: Settings, model: Path, default: int, tokens: int, threads: int,
                  say: Callable[[str], None]) -> Result:
    from moetier.engine import Engine, load_dense, make_ops
    from moetier.model.forward import Model
    from moetier.model.sampling import SamplingParams
    from moetier.store.provider import TieredExperts
    from moetier.store.tier import tier_config
    from moetier.weights.container import Container

    res = Result("storage.prefetch_depth", default, default, "decode tok/s, in-process engine")
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 200, 24)]
    ref: list[int] | None = None
    warmup()  # the kernels' one-time set-up is nobody's cost
    others = sorted(set(PREFETCH_DEPTHS) - {default})
    for depth in [default, *others, default]:  # the default first and last: order effects show, best kept
        container = Container.open(model)
        try:
            config = tier_config(settings, container.expert_bytes)
            config.history_path, config.prefetch_limit = None, depth
            ops = make_ops(False, threads)
            experts = TieredExperts.open(container, ops, config, depth=settings.storage.queue_depth,
                                         direct=settings.storage.direct_io)
            engine = Engine(container, Model(container.args, load_dense(container), ops, experts), experts)
        except BaseException:
            container.close()
            raise
        with engine:
            t0 = time.perf_counter()
            toks = [g.token for g in engine.generate(prompt, params)]
            rate = len(toks) / (time.perf_counter() - t0)
        if ref is None:
            ref = toks
        elif toks != ref:
            raise DataCorruption(f"prefetch depth {depth} changed the greedy tokens: placement must never change "
                                 "a bit; nothing is saved")
        res.figures[str(depth)] = max(rate, res.figures.get(str(depth), 0.0))
        say(f"  prefetch depth {depth}: {rate:.2f} tok/s (tokens equal)")
    res.chosen = int(max(res.figures, key=lambda d: res.figures[d]))
    return res


def tune(settings: Settings, model: Path, *, seconds: float = 1.0, tokens: int = 8,
         say: Callable[[str], None] = lambda s: None) -> tuple[list[Result], dict[str, float]]:
    """Every tunable setting, and the rates measured on the way (for the profile and `plan`)."""
    st = settings.storage
    say("kernel threads")
    threads, kernel = tune_threads(model, seconds, say)
    say("I/O queue depth")
    depth, disk = tune_depth(model, st.queue_depth, seconds, say)
    say("O_DIRECT")
    direct = tune_direct(model, int(depth.chosen), seconds, say)
    say("prefetch depth")
    prefetch = tune_prefetch(settings, model, st.prefetch_depth, tokens, int(threads.chosen), say)
    rates = {"memory_gbps": probe.memory_gbps(), "compute_gbps": kernel.gbps, "disk_gbps": disk}
    with_rows = probe.random_experts(*_shape(model), 64 << 20)
    rates["compute_gbps_batched"] = probe.kernel_gbps(with_rows, 16, seconds, FastOps(threads=kernel.threads)).gbps
    return [threads, depth, direct, prefetch], rates


def _shape(model: Path) -> tuple[int, int, Any, int]:
    from moetier.weights.container import Container

    with Container.open(model) as c:
        return c.args.hidden_size, c.args.moe_intermediate_size, c.quantization["experts"], c.quantization["group_size"]
