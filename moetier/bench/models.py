"""The models benchmarks run on, and routing traces recorded from them.

The benchmark model is mini-glm unless told otherwise: `benchmark_model(preset, settings)`
builds a synth preset once into `data_dir/models/<preset>` (into a temporary sibling that is
renamed into place, so an interrupted build is never taken for a model) and reuses it
whenever that directory holds a complete container (`moetier.json` is written last). A
benchmark's `--model DIR` replaces it.

`recorded_trace(model_dir, ...)` runs the reference forward (the in-process Engine) of a
container over the shipped text with a `TraceRecorder` on its expert provider and saves the
routing trace next to the model (`<dir>.routing-p<P>-g<G>-<text>-<manifest hash>.npz`), so a
rerun reads the file instead of running the model again.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetier.errors import InvalidArgument
from moetier.settings import Settings, load_settings
from moetier.weights.format import xxh3_hex

if TYPE_CHECKING:
    from moetier.text.tokenizer import TextTokenizer

log = logging.getLogger(__name__)

BENCHMARK_PRESET = "mini-glm"
SEED = 0
MANIFEST = "moetier.json"
# routing traces: prompt tokens of shipped text, then greedy tokens; the texts recorded (the
# second is the "previous traffic" the learned policy's usage history comes from)
TRACE_PROMPT_TOKENS = 128
TRACE_TOKENS = 128
TRACE_TEXTS = (5, 1)


def add_model_args(p: argparse.ArgumentParser, what: str = "container directory") -> None:
    """`--model DIR` and `--config FILE`, the way every benchmark names its model."""
    p.add_argument("--model", type=Path, help=f"{what} (default: the benchmark model, {BENCHMARK_PRESET}, "
                   "built once under data_dir/models/)")
    p.add_argument("--config", type=Path, help="YAML config file (data_dir: where the benchmark model lives)")


def is_complete(path: Path) -> bool:
    """A container directory whose manifest (written last) is there."""
    return (path / MANIFEST).is_file()


def model_cache_dir(settings: Settings) -> Path:
    return settings.data_path / "models"


def benchmark_model(preset: str = BENCHMARK_PRESET, settings: Settings | None = None, say: bool = True) -> Path:
    """data_dir/models/<preset>: built once with synth (seed 0, synth's default quantization:
    int4 g64 experts, int8 dense), reused whenever it holds a complete container."""
    settings = settings if settings is not None else load_settings()
    target = model_cache_dir(settings) / preset
    if is_complete(target):
        _check_preset(target, preset)
        return target
    from moetier.convert.synth import describe, write_container

    size = describe(preset)["expert_bytes_int4"]
    if say:
        print(f"building the benchmark model {preset} in {target} (once; {size / 1e9:.1f} GB of experts)",
              file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{preset}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_container(preset, tmp, SEED, progress=say and size > (256 << 20))  # int4 experts, int8 dense
        if target.exists() and not is_complete(target):
            shutil.rmtree(target)  # left by an interrupted build of an older version
        try:
            tmp.rename(target)
        except OSError:
            if not is_complete(target):  # not merely another process finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _check_preset(path: Path, preset: str) -> None:
    source = json.loads((path / MANIFEST).read_text()).get("source", {})
    if source.get("kind") == "synth" and source.get("preset") != preset:
        raise InvalidArgument(f"{path} holds synth preset {source.get('preset')!r}, not {preset!r}; "
                              "move it away or give --model")


def resolve_model(args: argparse.Namespace, preset: str = BENCHMARK_PRESET) -> Path:
    """--model DIR (must be a complete container), else the benchmark model (built if missing)."""
    if getattr(args, "model", None) is not None:
        path = Path(args.model).expanduser()
        if not is_complete(path):
            raise InvalidArgument(f"{path} is not a complete moetier container (no {MANIFEST})")
        return path
    return benchmark_model(preset, load_settings(getattr(args, "config", None)))


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "models", help="build the benchmark model once (if missing) and record its routing traces; print where")
    p.add_argument("--preset", default=BENCHMARK_PRESET, help=f"synth preset (default {BENCHMARK_PRESET})")
    p.add_argument("--config", type=Path, help="YAML config file (data_dir: where the models live)")
    p.add_argument("--traces", action="store_true", help="also record the routing traces `bench cache` uses")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    path = benchmark_model(args.preset, load_settings(args.config))
    manifest = json.loads((path / MANIFEST).read_text())
    print(f"{args.preset}: {path} ({manifest['expert_bytes'] / 1e9:.2f} GB of experts)")
    if args.traces:
        for text in TRACE_TEXTS:
            print(f"  trace: {recorded_trace(path, TRACE_PROMPT_TOKENS, TRACE_TOKENS, text)}")
    return 0


# ---- text and routing traces -------------------------------------------------------------
def shipped_text(which: int = 0) -> str:
    """One of the shipped corpus texts (moetier/data/corpus-*.txt), by position, wrapping."""
    from moetier.convert.tokenizer import corpus_texts

    texts = corpus_texts()
    return texts[which % len(texts)]


def prompt_ids(tokenizer: TextTokenizer, n: int, which: int = 0) -> list[int]:
    """The first `n` tokens of a shipped text (texts joined, wrapping, if one is too short)."""
    encode = tokenizer.encode
    ids: list[int] = []
    k = which
    while len(ids) < n:
        ids.extend(encode(shipped_text(k)))
        k += 1
        if k - which > 64:
            raise InvalidArgument(f"the shipped text does not give {n} tokens")
    return ids[:n]


def manifest_hash(path: Path) -> str:
    """xxh3_64 of the container's manifest: it names every file's checksum, so any change of
    the weights (routing included) changes it."""
    return xxh3_hex((path / MANIFEST).read_bytes())


def trace_path(model: Path, prompt_tokens: int, tokens: int, text: int) -> Path:
    model = model.expanduser().resolve()
    return model.parent / f"{model.name}.routing-p{prompt_tokens}-g{tokens}-t{text}-{manifest_hash(model)}.npz"


def recorded_trace(model: Path, prompt_tokens: int, tokens: int, text: int = 0, *, budget: str = "50%",
                   say: bool = True) -> Path:
    """The routing trace of the reference forward of `model` over `prompt_tokens` tokens of
    shipped text number `text`, then `tokens` greedy tokens (batch 1): recorded once, then
    read from the file next to the model. The expert budget changes no routing decision
    (placement never changes semantics), only how long the recording takes."""
    out = trace_path(model, prompt_tokens, tokens, text)
    if out.is_file():
        return out
    from moetier.engine import Engine
    from moetier.model.sampling import SamplingParams
    from moetier.store.trace import TraceRecorder, save_trace

    t0 = time.perf_counter()
    with Engine.open(model, budget=budget) as engine:
        ids = prompt_ids(engine.tokenizer, prompt_tokens, text)
        rec = TraceRecorder(engine.model.experts)
        engine.model.experts = rec
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        n = sum(1 for _ in engine.generate(ids, params))
        n_experts = engine.model.args.n_routed_experts
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}.npz")
    try:
        save_trace(tmp, rec.trace, n_experts)
        tmp.rename(out)
    except OSError as e:  # a read-only model directory: use the trace without keeping it
        log.warning("could not keep the routing trace next to the model (%s); it is recorded again next time", e)
        tmp.unlink(missing_ok=True)
        fallback = Path(tempfile.gettempdir()) / out.name
        save_trace(fallback, rec.trace, n_experts)
        out = fallback
    if say:
        print(f"recorded the routing of {model.name}: {prompt_tokens} prompt + {n} generated tokens, "
              f"{len(rec.trace)} steps, in {time.perf_counter() - t0:.0f} s -> {out}", file=sys.stderr, flush=True)
    return out
