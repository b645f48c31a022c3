"""Shared pieces of the property-based fuzzers (tests/test_fuzz_*.py, scripts/fuzz.py).

Every fuzz target states one property: whatever the input, the code under test returns or
raises one of moetier's own errors (naming what is wrong), never another exception, and never
allocates more than a bound that does not grow with a length field the input declares.

In the test suite each target runs a bounded, derandomized number of examples (stable CI
on a busy machine); scripts/fuzz.py runs the same targets with many more, randomized
(MOETIER_FUZZ_EXAMPLES, MOETIER_FUZZ_SEED).
"""

from __future__ import annotations

import json
import os
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from moetier.errors import MoetierError

EXAMPLES = int(os.environ.get("MOETIER_FUZZ_EXAMPLES", "0")) or None
SEED = os.environ.get("MOETIER_FUZZ_SEED")
PEAK_BYTES = 64 << 20  # no single input may make the reader hold more than this
TIMEOUT_S = 0 if EXAMPLES else 300  # per test in the suite; scripts/fuzz.py's long runs have none


def fuzz_settings(examples: int) -> settings:
    """`examples` in the test suite (derandomized, no example database); scripts/fuzz.py's count
    and a random run when it sets MOETIER_FUZZ_EXAMPLES."""
    return settings(max_examples=EXAMPLES or examples, deadline=None, database=None,
                    derandomize=EXAMPLES is None, suppress_health_check=list(HealthCheck), print_blob=True)


def seeded(f: Callable[..., Any]) -> Callable[..., Any]:
    """Apply MOETIER_FUZZ_SEED when scripts/fuzz.py gives one (a reproducible long run)."""
    if SEED is None:
        return f
    from hypothesis import seed

    return seed(int(SEED))(f)


# ---- JSON values and mutations -------------------------------------------------------------
SCALARS = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 4096, -4096, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12), st.sampled_from(["", "..", "../x", "/etc/passwd", "int4", "f32", "F32", "I8"]),
)
JSON_VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=10)


DESCEND = st.integers(0, 3)  # 0: edit here, else go one level down


def _children(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return list(node)
    if isinstance(node, list):
        return list(range(len(node)))
    return []


def mutate(obj: Any, data: st.DataObject, rounds: int = 3) -> Any:
    """A copy of a JSON document with 1..rounds random edits: a value replaced by any JSON
    value, a key deleted, a key added, a list element duplicated or dropped."""
    doc = json.loads(json.dumps(obj))
    for _ in range(data.draw(st.integers(1, rounds), label="edits")):
        parent: Any = None
        key: Any = None
        node = doc
        while _children(node) and data.draw(DESCEND, label="descend") > 0:
            parent, key = node, data.draw(st.sampled_from(_children(node)), label="key")
            node = node[key]
        op = data.draw(st.sampled_from(["replace", "delete", "add", "dup"]), label="op")
        if parent is None:
            if op == "replace":
                doc = data.draw(JSON_VALUES, label="doc")
            continue
        if op == "replace":
            parent[key] = data.draw(JSON_VALUES, label="value")
        elif op == "delete":
            del parent[key]
        elif op == "add" and isinstance(parent, dict):
            parent[data.draw(st.text(max_size=8), label="new key")] = data.draw(JSON_VALUES, label="value")
        elif op == "dup" and isinstance(parent, list):
            parent.insert(key, parent[key])
    return doc


def flip_bytes(raw: bytes, data: st.DataObject, limit: int | None = None) -> bytes:
    """`raw` with a few bytes changed (within the first `limit` bytes), or cut short."""
    b = bytearray(raw)
    end = min(len(b), limit or len(b))
    if data.draw(st.booleans(), label="truncate"):
        return bytes(b[: data.draw(st.integers(0, max(len(b) - 1, 0)), label="cut")])
    for _ in range(data.draw(st.integers(1, 6), label="flips")):
        i = data.draw(st.integers(0, max(end - 1, 0)), label="at")
        if i < len(b):
            b[i] = data.draw(st.integers(0, 255), label="byte")
    return bytes(b)


# ---- the property ----------------------------------------------------------------------------
@contextmanager
def bounded_memory(limit: int = PEAK_BYTES) -> Iterator[None]:
    """Fail when the block's Python and numpy allocations peak above `limit` bytes."""
    tracemalloc.start()
    try:
        yield
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak <= limit, f"an input made the reader allocate {peak} bytes (limit {limit})"


def clean(fn: Callable[[], Any], allowed: tuple[type[BaseException], ...] = (MoetierError,)) -> BaseException | None:
    """Run fn: its return or one of `allowed` (whose message must say something) passes; any
    other exception fails the property, with its type in the message."""
    with bounded_memory():
        try:
            fn()
        except allowed as e:
            assert str(e).strip(), f"{type(e).__name__} without a message"
            return e
    return None


def app_routes(app: Any) -> set[tuple[str, str]]:
    """(method, path) of every route a FastAPI app serves, included routers followed."""
    out: set[tuple[str, str]] = set()

    def walk(routes: Any) -> None:
        for r in routes:
            if hasattr(r, "original_router"):  # an included router
                walk(r.original_router.routes)
            elif hasattr(r, "methods"):
                out.update((m, r.path) for m in r.methods)

    walk(app.routes)
    return out
