"""Where a step's time goes: attention, gates, waiting on the expert store, sampling.

The model math stays free of clocks: `instrument(model, clock)` wraps each layer's
attention and router objects in timing proxies that add their wall time to a
`PhaseClock`; the expert provider and the batcher add theirs directly. The rest of the
step (embedding, norms, dense MLPs, shared experts, lm_head) is "other". Only the step
thread touches a clock.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from moetier.model.forward import Model

PHASES = ("attention", "gate", "expert", "sampling", "other")


class PhaseClock:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def reset(self) -> None:
        for k in self.seconds:
            self.seconds[k] = 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] += time.perf_counter() - t0

    def split(self, step_s: float) -> dict[str, float]:
        """Seconds per phase of a step that took step_s in all; "other" is the remainder."""
        out = {k: v for k, v in self.seconds.items() if k != "other"}
        out["other"] = max(0.0, step_s - sum(out.values()))
        return out


# The proxies time with perf_counter in a try/finally rather than PhaseClock.measure: they run a
# few times a layer, and a context manager's generator costs more than what it times there.
class _TimedAttention:
    def __init__(self, inner: Any, clock: PhaseClock) -> None:
        self.inner, self.clock = inner, clock

    def __call__(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner(*args)
        finally:
            self.clock.seconds["attention"] += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if name != "block":
            return attr
        seconds = self.clock.seconds

        def block(*args: Any) -> Any:  # the fused layer (GqaAttention.block), its norm and residual add included
            t0 = time.perf_counter()
            try:
                return attr(*args)
            finally:
                seconds["attention"] += time.perf_counter() - t0

        self.__dict__["block"] = block  # made once: later lookups find it without __getattr__
        return block


class _TimedRouter:
    def __init__(self, inner: Any, clock: PhaseClock) -> None:
        self.inner, self.clock = inner, clock

    def route(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.inner.route(*args)
        finally:
            self.clock.seconds["gate"] += time.perf_counter() - t0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def instrument(model: Model, clock: PhaseClock) -> None:
    """Time every layer's attention and router (prediction and choice) into `clock`."""
    for layer in model.layers:
        setattr(layer, "attention", _TimedAttention(layer.attention, clock))  # noqa: B010 (typed field, proxy value)
        if layer.moe is not None:
            setattr(layer.moe, "router", _TimedRouter(layer.moe.router, clock))  # noqa: B010
