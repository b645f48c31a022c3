"""The expert tier: RAM budget + policies over an aligned, checksummed, mirrored NVMe reader.

Used in-process (`TieredExperts`, the forward pass's expert provider) and by the
expert-store service, over the container's one expert index (moetier.weights.index:
ExpertIndex, RecordLocation). Modules:
    io        IOEngine: O_DIRECT preadv worker pool, single-flight, checksums, priorities
    copies    primary + mirror directories: validation, weighted placement, degradation
    tier      ExpertTier: byte budget, pins (acquire), eviction, prefetch hints
    policy    lru, lfu, learned (history.py persists the learned policy's usage history)
    stats     plain stats dataclasses and the per-expert heat snapshot
    provider  TieredExperts: moe(layer, x, ids, weights) over a tier
    trace     routing trace format and synthetic generators; sim: offline hit rates, Belady
"""

from moetier.store.io import DEMAND, PREFETCH, IOEngine
from moetier.store.stats import DiskStats, HeatSnapshot, Histogram, IOStats, TierStats
from moetier.store.tier import ExpertTier, HintOutcome, Lease, TierConfig

__all__ = [
    "DEMAND",
    "PREFETCH",
    "DiskStats",
    "ExpertTier",
    "HeatSnapshot",
    "HintOutcome",
    "Histogram",
    "IOEngine",
    "IOStats",
    "Lease",
    "TierConfig",
    "TierStats",
]
