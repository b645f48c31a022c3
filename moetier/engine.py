"""The in-process engine: one container served inside this process.

    engine = Engine.open("models/demo", budget="25%", prefix_cache="1GiB")
    gen = engine.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=32))
    for tok in gen:                      # gen.cached_tokens: prompt tokens taken from the prefix cache
        ...
    logits = engine.logits(ids)          # [T, V] teacher-forced
    engine.close()

The dense tensors are read into anonymous memory once, with no second copy left in the page
cache (`load_dense`; resident: a decode step never waits on a page fault), the routed experts
go through the RAM tier (`TieredExperts`) with a byte budget, and the forward pass runs on
`FastOps` (or `ReferenceOps`, the oracle). This is what `moetier generate` and `moetier
logits` run, and the reference the cluster is tested against: the dense worker runs the same
Model on the same kernels with the experts computed by the expert store, so at temperature 0
both produce the same tokens.

Prefix cache: off by default. With `prefix_cache` (a byte budget; `prefix_dir` persists it
across processes) `generate` reuses the KV of earlier sequences to the token, as the dense
worker does (moetier/prefix_cache.py), and remembers each sequence it ends; reuse changes no
bit of the output.

Kernel threads: by default every CPU this process may use (FastOps' own default). The
kernels claim work in chunks from a shared pool, so a helper thread that is not scheduled
(a busy machine) costs little: measured on a 2-core machine under load (load average 6),
demo model, 25% budget: 15-23 tok/s with 2 threads, 6-15 with 1. (With the OpenMP
fork-join kernels this was reversed: 1-3 tok/s with 2 threads.) The thread count never
changes a result bit (the kernels are row- and thread-invariant).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from moetier.errors import InvalidArgument
from moetier.kernels.fast import Activations, FastOps
from moetier.model.forward import Model
from moetier.model.generate import GeneratedToken, generate, teacher_forced_logits
from moetier.model.kv_cache import KVCache
from moetier.model.mtp import MtpHead
from moetier.model.ops import Ops, ReferenceOps
from moetier.model.sampling import SamplingParams
from moetier.model.speculative import Drafter
from moetier.prefix_cache import PrefixCache, kv_identity
from moetier.settings import Settings, parse_bytes, resolve_budget
from moetier.speculation import Controller, SpecStats, generate_speculative
from moetier.store.provider import TieredExperts
from moetier.store.tier import TierConfig
from moetier.text.tokenizer import TextTokenizer
from moetier.weights.container import Container
from moetier.weights.mapped import MappedExperts
from moetier.weights.quant import QTensor

log = logging.getLogger(__name__)

F32 = npt.NDArray[np.float32]

DEFAULT_THREADS: int | None = None  # FastOps' default; see the module docstring
DEMO_PRESET = "demo"
DEMO_SEED = 0


def load_dense(container: Container) -> dict[str, QTensor]:
    """Every dense tensor of the container, held once in process memory: each dense file read
    into anonymous memory (page-aligned, so every tensor keeps the file's natural alignment;
    C-contiguous, as the kernels need), its page cache dropped as it is read, the memmap never
    touched. (Copying from the memmap left a second copy of every byte in the page cache.)"""
    return container.resident_dense()


def make_ops(reference: bool = False, threads: int | None = None, activations: Activations | None = None) -> Ops:
    """FastOps with `threads` kernel threads (default: every CPU) and `activations` (default: the
    process's, exact unless `kernels.activations` says int8), or the reference."""
    if reference:
        return ReferenceOps()
    return FastOps(threads=threads if threads is not None else DEFAULT_THREADS, activations=activations)


class Generation(Iterator[GeneratedToken]):
    """The tokens of one `Engine.generate` call; `cached_tokens` of its prompt came from the
    prefix cache (the rest were prefilled). When it ends (or is closed), its sequence's KV goes
    to the prefix cache."""

    def __init__(self, tokens: Iterator[GeneratedToken], prompt_tokens: int, cached_tokens: int) -> None:
        self._tokens = tokens
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens

    def __next__(self) -> GeneratedToken:
        return next(self._tokens)

    def close(self) -> None:
        close = getattr(self._tokens, "close", None)
        if close is not None:
            close()


def load_mtp(container: Container, model: Model, ops: Ops) -> tuple[MtpHead, MappedExperts] | None:
    """The container's MTP head on `model` (its dense tensors resident, its experts memory-mapped),
    or None when it has none."""
    m = container.mtp
    if m is None:
        return None
    dense = {}
    for name in m.specs:
        t = m.dense(name)
        scales = None if t.scales is None else np.array(t.scales, order="C")
        dense[name] = QTensor(t.dtype, t.shape, np.array(t.data, order="C"), scales, t.group_size)
    experts = MappedExperts(container, m.expert_layers, m.layout, ops)
    return MtpHead(model, m.layers, dense, experts, hidden_first=m.hidden_first), experts


class Engine:
    """A container's model in this process: resident dense part, tiered experts, one Model."""

    def __init__(self, container: Container, model: Model, experts: TieredExperts,
                 prefix: PrefixCache | None = None, speculative: int = 0, fixed_k: bool = False) -> None:
        self.container = container
        self.model = model
        self.experts = experts
        self.prefix = prefix
        self._tokenizer: TextTokenizer | None = None
        mtp = load_mtp(container, model, model.ops) if speculative else None
        self.mtp = mtp[0] if mtp is not None else None
        self._mtp_experts = mtp[1] if mtp is not None else None
        a = model.args
        self.controller = Controller(speculative, moe_layers=len(a.moe_layer_ids), experts=a.n_routed_experts,
                                     top_k=a.num_experts_per_tok, has_mtp=self.mtp is not None, fixed=fixed_k)
        self.spec_stats = SpecStats()

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, budget: str | int = "25%", reference: bool = False,
             threads: int | None = None, policy: str = "lru", direct: bool = True, prefix_cache: str | int = 0,
             prefix_dir: Path | None = None, speculative: int = 0, fixed_k: bool = False,
             activations: Activations | None = None) -> Engine:
        """Open a container. `budget`: the expert RAM tier, bytes or a share of the expert bytes
        ("25%", "2GiB", or an int). `prefix_cache`: the prefix cache's byte budget (0: none),
        persisted in `prefix_dir` when given. `speculative`: most tokens the container's MTP head
        drafts per step (0: off; moetier.speculation decides how many pay, per step; `fixed_k`: always
        that many). `activations`: the kernels' (make_ops)."""
        container = Container.open(path)
        prefix: PrefixCache | None = None
        try:
            prefix_bytes = parse_bytes(prefix_cache)
            if prefix_bytes > 0:
                args = container.args
                prefix = PrefixCache(args, container.index.identity,
                                     kv_identity(container.files, container.index.identity, args), prefix_dir,
                                     prefix_bytes)
            ops = make_ops(reference, threads, activations)
            budget_bytes = resolve_budget(str(budget), container.expert_bytes)
            layer_bytes = container.args.n_routed_experts * container.layout.record_bytes
            if budget_bytes < layer_bytes:
                log.info("expert budget %d bytes holds less than one MoE layer's experts (%d bytes): a step "
                         "routing to more experts than fit computes them in waves", budget_bytes, layer_bytes)
            experts = TieredExperts.open(container, ops, TierConfig(budget_bytes=budget_bytes, policy=policy),
                                         direct=direct)
            model = Model(container.args, load_dense(container), ops, experts)
        except BaseException:
            if prefix is not None:
                prefix.close()
            container.close()
            raise
        try:
            return cls(container, model, experts, prefix, speculative, fixed_k)
        except BaseException:
            if prefix is not None:
                prefix.close()
            experts.close()
            container.close()
            raise

    # ---- identity and text -----------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.container.path

    @property
    def model_id(self) -> str:
        """Identity of the container's expert index (what cluster members register with)."""
        return self.container.index.identity

    @property
    def tokenizer(self) -> TextTokenizer:
        if self._tokenizer is None:
            self._tokenizer = TextTokenizer.from_dir(self.path)
        return self._tokenizer

    def eos_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: generation_config.json (via the tokenizer files), else the model's."""
        ids = self.tokenizer.eos_token_ids if (self.path / "tokenizer.json").is_file() else ()
        return tuple(ids) or self.model.args.eos_token_ids

    # ---- running -------------------------------------------------------------------------
    def check_ids(self, ids: Sequence[int] | npt.NDArray[np.integer]) -> npt.NDArray[np.int64]:
        a = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(a) == 0:
            raise InvalidArgument("the prompt is empty")
        vocab = self.model.args.vocab_size
        if a.min() < 0 or a.max() >= vocab:
            raise InvalidArgument(f"token ids must be in [0, {vocab}); got {int(a.min())}..{int(a.max())}")
        return a

    def generate(self, prompt: Sequence[int] | npt.NDArray[np.integer], params: SamplingParams,
                 chunk_size: int | None = None) -> Generation:
        """Generated tokens; the last carries its finish_reason. Stops at params.stop_token_ids
        and, unless params.ignore_eos, at the model's eos ids."""
        ids = self.check_ids(prompt)
        limit = self.model.args.max_position_embeddings
        if len(ids) + params.max_tokens > limit:
            raise InvalidArgument(f"{len(ids)} prompt tokens + max_tokens {params.max_tokens} exceed the "
                                  f"model's {limit} positions")
        if self.prefix is None:
            return Generation(self._tokens(ids, params, None, chunk_size), len(ids), 0)
        cache, n = self.prefix.lookup(ids)
        cache = cache if cache is not None else self.model.new_cache()
        cache.save_at.add(len(ids) - 1)  # a fixed-size state is saved where the same prompt resumes
        return Generation(self._remembered(cache, self._tokens(ids[n:], params, cache, chunk_size)), len(ids), n)

    def _tokens(self, ids: npt.NDArray[np.int64], params: SamplingParams, cache: KVCache | None,
                chunk_size: int | None) -> Iterator[GeneratedToken]:
        if self.mtp is None or self.controller.k_max == 0:
            return generate(self.model, ids, params, cache, chunk_size)
        tier = self.experts.tier
        return generate_speculative(self.model, Drafter(self.mtp), self.controller, ids, params, cache,
                                    misses=lambda: sum(tier.stats().misses.values()), stats=self.spec_stats,
                                    chunk_size=chunk_size)

    def _remembered(self, cache: KVCache, tokens: Iterator[GeneratedToken]) -> Iterator[GeneratedToken]:
        """`tokens`, then the sequence's KV into the prefix cache (also when the caller stops early:
        every committed position is valid KV of its tokens)."""
        assert self.prefix is not None
        try:
            yield from tokens
        finally:
            self.prefix.insert(cache, handover=True)  # generate made it, and it ends here

    def logits(self, ids: Sequence[int] | npt.NDArray[np.integer]) -> F32:
        """Teacher-forced logits [T, V] float32 over `ids`."""
        return teacher_forced_logits(self.model, self.check_ids(ids))

    def expert_hit_rate(self) -> float:
        """Share of demanded experts found in the RAM tier since the engine opened."""
        return self.experts.tier.stats().hit_rate

    def close(self) -> None:
        if self.prefix is not None:
            self.prefix.close()
        if self._mtp_experts is not None:
            self._mtp_experts.close()
        self.experts.close()
        self.container.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- the default model -----------------------------------------------------------------------
# The trained demo model's source (scripts/train_demo.py): a Hugging Face checkpoint with its
# safetensors xz-compressed, converted into data_dir/models/demo on first use. Without it (a
# checkout that dropped the file) the synth preset "demo" (random weights) is built instead.
DEMO_SOURCE = Path(__file__).resolve().parent / "data" / "demo"
DEMO_WEIGHTS = "model.safetensors.xz"
DEMO_CHECKSUMS = "checksums.json"  # size and xxh3 of the uncompressed model.safetensors


def demo_model_dir(settings: Settings) -> Path:
    return settings.data_path / "models" / DEMO_PRESET


def trained_demo_source() -> Path | None:
    """moetier/data/demo when it holds the trained checkpoint, else None."""
    return DEMO_SOURCE if (DEMO_SOURCE / DEMO_WEIGHTS).is_file() else None


def _demo_current(path: Path) -> bool:
    """Whether a built demo model is the current one (the trained checkpoint's conversion, or
    else the synth preset's; its context length and chat template); an older one is rebuilt."""
    from moetier.convert.synth import DEMO_POSITIONS
    from moetier.convert.tokenizer import CHAT_TEMPLATE
    from moetier.text.tokenizer import read_json

    try:
        config, tok = read_json(path / "config.json"), read_json(path / "tokenizer_config.json")
        source = read_json(path / "moetier.json").get("source", {})
    except Exception:
        return False
    if not (config.get("max_position_embeddings") == DEMO_POSITIONS and tok.get("chat_template") == CHAT_TEMPLATE):
        return False
    trained = trained_demo_source()
    if trained is None:
        return bool(source.get("kind") == "synth")
    want = read_json(trained / DEMO_CHECKSUMS).get("model.safetensors")
    return bool(source.get("kind") == "hf" and source.get("files", {}).get("model.safetensors") == want)


def unpack_trained_demo(dst: Path) -> Path:
    """The trained demo checkpoint as a plain Hugging Face directory at `dst` (decompressed)."""
    import lzma

    from moetier.weights.format import COPIED_FILES

    src = trained_demo_source()
    if src is None:
        raise InvalidArgument(f"{DEMO_SOURCE / DEMO_WEIGHTS} is missing: this install has no trained demo model")
    dst.mkdir(parents=True, exist_ok=True)
    for name in COPIED_FILES:
        shutil.copyfile(src / name, dst / name)
    with lzma.open(src / DEMO_WEIGHTS) as f, open(dst / "model.safetensors", "wb") as out:
        shutil.copyfileobj(f, out, 1 << 20)
    return dst


def _build_demo(tmp: Path, settings: Settings) -> None:
    if trained_demo_source() is None:
        from moetier.convert.synth import write_container

        write_container(DEMO_PRESET, tmp, DEMO_SEED, settings.model.experts, settings.model.dense)
        return
    from moetier.convert.converter import ConvertOptions, convert

    hf = tmp.parent / f"{tmp.name}-hf"
    shutil.rmtree(hf, ignore_errors=True)
    try:
        unpack_trained_demo(hf)
        convert(hf, tmp, ConvertOptions(experts=settings.model.experts, dense=settings.model.dense), progress=False)
    finally:
        shutil.rmtree(hf, ignore_errors=True)


def ensure_demo_model(settings: Settings, say: bool = True) -> Path:
    """The demo container under data_dir/models/demo, built once (into a temporary directory
    renamed into place, so an interrupted build is never mistaken for a model): the trained
    checkpoint converted, or the synth preset where the checkpoint is absent."""
    target = demo_model_dir(settings)
    if (target / "moetier.json").is_file() and _demo_current(target):
        return target
    if say:
        print(f"building the demo model in {target} (once; a few seconds)", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{DEMO_PRESET}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _build_demo(tmp, settings)
        if target.exists() and not ((target / "moetier.json").is_file() and _demo_current(target)):
            shutil.rmtree(target)  # a directory left by an interrupted build, or an older demo model
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "moetier.json").is_file() or not _demo_current(target):  # not another process winning the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def model_dir(settings: Settings, given: Path | None, say: bool = True) -> Path:
    """--model, else settings model.path, else the demo model (built if missing)."""
    if given is not None:
        return given
    if settings.model.path is not None:
        return settings.model.path.expanduser()
    return ensure_demo_model(settings, say)


def parse_ids(text: str) -> list[int]:
    """'1,2, 3' -> [1, 2, 3] (InvalidArgument naming the bad entry)."""
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            out.append(int(part))
        except ValueError:
            raise InvalidArgument(f"token id {part!r} is not an integer (expected e.g. 1,2,3)") from None
    return out


def expert_cache_spec(settings: Settings, flag: str | None) -> str:
    return flag if flag is not None else settings.model.expert_cache


def summarize(prompt_tokens: int, generated: int, seconds: float, hit_rate: float) -> str:
    rate = generated / seconds if seconds > 0 else 0.0
    return (f"prompt {prompt_tokens} tokens, generated {generated} tokens in {seconds:.2f} s "
            f"({rate:.1f} tok/s), expert hit rate {100 * hit_rate:.1f}%")

