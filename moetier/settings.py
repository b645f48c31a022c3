"""Settings of every moetier service: one object, built once in main() and passed down.

Sources, highest priority first: command-line flags, environment variables
(`MOETIER_<SECTION>__<FIELD>`, e.g. `MOETIER_CACHE__POLICY=lfu`), the YAML config
file (`--config FILE`), the defaults below. Nothing else in moetier reads
os.environ. `moetier config` prints the effective settings; docs/config.md is
the reference (a test keeps it in sync with this file).
"""

from __future__ import annotations

import os
import re
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from moetier.errors import InvalidArgument

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4,
          "tib": 1 << 40}


def parse_bytes(text: str | int) -> int:
    """'2GiB' / '512 MB' / '1048576' -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgument(f"{text!r} is not a byte size (examples: 1048576, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def resolve_budget(spec: str, total_bytes: int) -> int:
    """An expert cache budget: a byte size or a percentage of the model's expert bytes."""
    s = str(spec).strip()
    if s.endswith("%"):
        try:
            pct = float(s[:-1])
        except ValueError:
            raise InvalidArgument(f"expert cache {spec!r}: not a percentage") from None
        if not 0 <= pct <= 100:
            raise InvalidArgument(f"expert cache {spec!r}: percentage outside 0..100")
        return int(total_bytes * pct / 100)
    return parse_bytes(s)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSection(_Section):
    path: Path | None = Field(None, description="Container directory to serve; unset: the demo model "
                              "(built once under data_dir/models/demo).")
    name: str | None = Field(None, description="Model name clients use (OpenAI `model`); default: the "
                             "directory name.")
    expert_cache: str = Field("25%", description="RAM tier budget for routed experts: bytes (`2GiB`) or a "
                              "percentage of the model's expert bytes (`25%`).")
    experts: Literal["int4", "int8", "bf16", "f32"] = Field(
        "int4", description="Expert quantization used when `moetier up` builds the demo model.")
    dense: Literal["int8", "int4", "bf16", "f32"] = Field("int8", description="Dense quantization used when "
                                                  "`moetier up` builds the demo model.")

    @field_validator("expert_cache")
    @classmethod
    def _budget(cls, v: str) -> str:
        resolve_budget(v, 100)
        return v


class StorageSection(_Section):
    io_engine: Literal["threads"] = Field("threads", description="Expert read engine: a bounded thread "
                                          "pool issuing preadv.")
    direct_io: bool = Field(True, description="Read experts with O_DIRECT where the filesystem allows it "
                            "(falls back to buffered reads, logged).")
    queue_depth: int = Field(8, ge=1, le=256, description="Concurrent expert reads per store.")
    prefetch: bool = Field(True, description="Act on prefetch hints from dense workers.")
    preload: bool = Field(True, description="When the RAM tier budget holds every expert the store serves, "
                          "read them all at start, before it reports ready (a smaller budget fills on demand).")
    share: bool = Field(True, description="When the RAM tier holds every expert the store serves (after the "
                        "preload), keep them in one shared memory that a dense worker on this host maps over the "
                        "local lane and computes its calls from itself, with the same kernels (no round trip); "
                        "off: every call is sent to the store.")
    prefetch_depth: int = Field(64, ge=0, le=4096, description="Queued prefetch reads before hints drop.")
    mirrors: list[Path] = Field(default_factory=list, description="Extra copies (full or partial) of the "
                                "container's experts/ files; reads spread across copies.")
    mirror_weights: list[float] = Field(default_factory=list, description="Read weights of primary + "
                                        "mirrors (GB/s; their sum is also the store's weight in the router's "
                                        "placement map); empty: measured by a start-up bandwidth probe.")
    owned_experts: str = Field("all", description="The experts this store serves (its shard): `all`, or "
                               "comma-separated `LAYERS[:EXPERTS]` items, each a number or an inclusive range, e.g. "
                               "`1-9` or `1-19:0-31`; or `I/N` (every N-th MoE layer from the I-th) and `I/N*R` (R consecutive such "
                               "shards), for replicas that know only their ordinal. Layer files absent from the model "
                               "directory are left out too.")
    test_read_delay_file: Path | None = Field(None, description="Test only (the slow disk of `moetier chaos`): "
                                              "a file holding seconds to sleep before each expert read, "
                                              "re-read once a second; unset (the default): no delay.")


class CacheSection(_Section):
    policy: Literal["lru", "lfu", "learned"] = Field("learned", description="RAM tier replacement policy. "
                                                     "learned: usage history (persisted) pins the hottest "
                                                     "experts, the rest LRU.")
    history_path: Path | None = Field(None, description="Usage history file of the learned policy; "
                                      "default data_dir/history/<store id>.hist.")
    pin_fraction: float | None = Field(None, ge=0.0, le=1.0, description="Share of the budget the learned "
                                       "policy pins for its hot set; unset: chosen at run time among plain "
                                       "LRU, 0.5 and 0.9 by sampled shadow caches.")


class InferenceSection(_Section):
    max_batch_size: int = Field(8, ge=1, le=256, description="Sequences in a dense worker's running batch.")
    max_waiting: int = Field(64, ge=0, description="Requests a dense worker queues beyond the batch before "
                             "refusing with RESOURCE_EXHAUSTED.")
    max_seq_len: int = Field(65536, ge=16, description="Prompt + generated tokens per sequence (capped by the "
                             "model's max_position_embeddings).")
    prefill_chunk: int = Field(256, ge=1, description="Prompt tokens prefilled per step; long prompts are "
                               "prefilled in chunks between decode steps.")
    kv_dtype: Literal["float32"] = Field("float32", description="KV cache dtype (float32 only: exact).")
    prefix_cache_bytes: str = Field("1GiB", description="Disk budget of the persisted prefix cache.")
    prefix_cache_memory_bytes: str = Field("256MiB", description="Memory budget of the prefix cache (at most "
                                           "prefix_cache_bytes): entries beyond it are read back from their "
                                           "files. It counts against the machine's memory beside the expert cache.")
    prefix_cache_dir: Path | None = Field(None, description="Prefix cache directory; default "
                                          "data_dir/prefix-cache/<model id>.")
    expert_timeout_s: float = Field(30.0, gt=0, description="Deadline of each ComputeExperts call.")
    expert_placement: Literal["store", "router"] = Field(
        "store", description="Where a dense worker sends ComputeExperts: store (the one store at "
        "expert_store.address) or router (the stores of the router's placement map: experts sharded over several "
        "stores, one call per store owning part of a layer's union, combined in a fixed order).")
    local_lane: bool = Field(True, description="Send ComputeExperts and prefetch hints over the expert store's "
                             "local lane (a unix socket and shared memory) when the store is on this host; off: "
                             "gRPC only.")
    shared_experts: bool = Field(True, description="Where the expert store on this host shares its experts "
                                 "(storage.share), compute them here from its shared memory instead of sending "
                                 "ComputeExperts over the local lane (the same kernels: the same bits); off: send "
                                 "every call.")
    speculative_tokens: int = Field(3, ge=0, le=8, description="Most tokens the MTP head drafts per sequence "
                                    "and step (0: no speculative decoding); each step drafts as many as the "
                                    "measured cost model says pay, possibly none.")


class KernelsSection(_Section):
    backend: Literal["auto", "c", "c-portable", "c-avx2", "c-avx512", "c-neon", "numba"] = Field(
        "auto", description="Kernel path of the dense worker, the expert store and the in-process engine: auto "
        "(the best this CPU runs), or one by name, e.g. c-portable or c-avx2 (every path gives the same bits; a path "
        "this CPU lacks is refused at start).")
    activations: Literal["exact", "int8"] = Field(
        "exact", description="exact (default), or int8: LOSSY, every int8/int4 linear rounds its inputs to int8 per "
        "block of 64 and multiplies in integers (faster prefill; `moetier bench activations` measures the error).")
    idle_spin_us: float = Field(
        2000.0, ge=0, le=1_000_000, description="How long an idle kernel thread polls for the next kernel call "
        "before it sleeps, in microseconds (0: sleep at once). A sleeping thread joins the next call late where "
        "wake-ups are slow (a VM whose idle vCPUs halt: 0.42 ms at p90); a polling one yields its CPU to any "
        "thread with work. Never changes a result bit.")
    max_wake_latency_us: int | None = Field(
        0, ge=0, description="While a dense worker, expert store or bench peers' in-process engine runs, ask the "
        "kernel for CPUs that leave idle within this many microseconds (a PM QoS request on /dev/cpu_dma_latency; "
        "0: idle CPUs poll instead of halting). Each MoE layer hands work between processes and threads; where idle "
        "vCPUs halt, a wake-up took 0.42 ms at p90 (0.02 ms held). Needs write access to the device (root), else "
        "nothing is held. Costs power; null leaves it to the system.")


class Endpoint(_Section):
    """A gRPC service's addresses. Subclasses give per-service defaults, so overriding one field
    (e.g. MOETIER_ROUTER__BIND) keeps the others."""

    bind: str = Field(description="host:port the service listens on.")
    address: str = Field(description="host:port other services use to reach it.")
    metrics_port: int = Field(description="Port of its Prometheus /metrics endpoint (0: none).")
    id: str = Field(description="Name it registers under.")

    @field_validator("id")
    @classmethod
    def _id_is_a_name(cls, v: str) -> str:
        # it names a file under data_dir (the store's usage history): one path component, no NUL
        if v in ("", ".", "..") or re.search(r"[/\\\0]", v) or len(v) > 128:
            raise ValueError(f"id {v!r}: a name of at most 128 characters, without '/', '\\' or NUL, not '.' or '..'")
        return v


class RouterEndpoint(Endpoint):
    bind: str = Field("127.0.0.1:50051", description="host:port the service listens on.")
    address: str = Field("127.0.0.1:50051", description="host:port other services use to reach it.")
    metrics_port: int = Field(9101, ge=0, le=65535, description="Port of its Prometheus /metrics endpoint (0: none).")
    id: str = Field("router", description="Name it registers under.")


class WorkerEndpoint(Endpoint):
    bind: str = Field("127.0.0.1:50052", description="host:port the service listens on.")
    address: str = Field("127.0.0.1:50052", description="host:port other services use to reach it.")
    metrics_port: int = Field(9102, ge=0, le=65535, description="Port of its Prometheus /metrics endpoint (0: none).")
    id: str = Field("worker-0", description="Name it registers under.")


class StoreEndpoint(Endpoint):
    bind: str = Field("127.0.0.1:50053", description="host:port the service listens on.")
    address: str = Field("127.0.0.1:50053", description="host:port other services use to reach it.")
    metrics_port: int = Field(9103, ge=0, le=65535, description="Port of its Prometheus /metrics endpoint (0: none).")
    id: str = Field("store-0", description="Name it registers under.")


class GatewaySection(_Section):
    bind: str = Field("127.0.0.1:8000", description="host:port of the OpenAI-compatible HTTP API.")
    api_key: str | None = Field(None, description="If set, /v1/* requires it, as `Authorization: Bearer <key>` "
                                "or `x-api-key: <key>`.")
    max_body_bytes: int = Field(8 << 20, ge=1024, description="Largest accepted request body (413 above).")
    request_timeout_s: float = Field(600.0, gt=0, description="Deadline of one generation through the router.")
    default_max_tokens: int | None = Field(None, ge=1, description="Completion tokens of a request that sets "
                                           "none (chat max_tokens, Responses max_output_tokens); default: the rest "
                                           "of the context (for a model that never stops, as the random demo model).")
    default_temperature: float = Field(1.0, ge=0.0, le=2.0, description="Temperature of a request that sets "
                                       "none (the APIs' own default is 1.0); 0 = greedy.")
    tool_parser: str | None = Field(None, description="Tool-call format of the model (qwen3, glm45, deepseek_v3, "
                                    "kimi_k2, mistral); default: chosen from its chat template and architecture.")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MOETIER_", env_nested_delimiter="__", extra="forbid")

    data_dir: Path = Field(Path("~/.cache/moetier"), description="Where moetier keeps the demo model, "
                           "caches and history.")
    model: ModelSection = ModelSection()
    storage: StorageSection = StorageSection()
    cache: CacheSection = CacheSection()
    inference: InferenceSection = InferenceSection()
    kernels: KernelsSection = KernelsSection()
    gateway: GatewaySection = GatewaySection()
    router: RouterEndpoint = RouterEndpoint()
    dense_worker: WorkerEndpoint = WorkerEndpoint()
    expert_store: StoreEndpoint = StoreEndpoint()
    queue_capacity: int = Field(256, ge=1, description="Router: requests queued cluster-wide before 429 / "
                                "RESOURCE_EXHAUSTED.")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="Members heartbeat the router this often.")
    member_expiry_s: float = Field(5.0, gt=0, description="Router drops a member silent this long.")
    test_clock_offset_file: Path | None = Field(None, description="Test only (the clock jumps of `moetier "
                                                "chaos`): a file holding seconds added to the router's "
                                                "heartbeat clock, re-read once a second; unset (the default): "
                                                "none.")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, env_settings, _YamlSource(settings_cls))

    @property
    def data_path(self) -> Path:
        return self.data_dir.expanduser()


_config_file: ContextVar[dict[str, Any] | None] = ContextVar("moetier_config_file", default=None)


class _YamlSource(PydanticBaseSettingsSource):
    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        return (_config_file.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_config_file.get() or {})


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _env_error(e: SettingsError) -> InvalidArgument:
    """pydantic-settings' error for an environment value it could not parse (a settings section
    or a list given something that is not JSON, e.g. MOETIER_MODEL=demo), naming the variable.

    The error names only the top-level field, so each MOETIER_<FIELD>[__...] variable is parsed
    again alone to find the one at fault. Values are not repeated (a section may hold the API key)."""
    m = re.search(r'field "(\w+)"', str(e))
    field = m.group(1) if m else ""
    prefix = f"moetier_{field}"
    names = sorted(k for k in os.environ if k.lower() == prefix or k.lower().startswith(prefix + "__"))
    culprits = []
    for name in names:
        source = EnvSettingsSource(Settings)
        source.env_vars = {name.lower(): os.environ[name]}
        try:
            source()
        except SettingsError:
            culprits.append(name)
    why = f" ({e.__cause__})" if e.__cause__ is not None else ""
    if not culprits:
        return InvalidArgument(f"invalid settings in the environment: {e}{why}")
    name = culprits[0]
    if name.lower() == prefix:
        hint = (f"`{field}` is a settings section: set its fields as {name}__<FIELD>, or give the whole "
                "section as a JSON object")
    else:
        hint = "a list is given as JSON, e.g. '[\"/mnt/a\", \"/mnt/b\"]' or '[0.5, 0.5]'"
    return InvalidArgument(f"invalid settings: environment variable {name} is not valid JSON{why}; {hint}")


def apply_kernel_settings(settings: Settings) -> None:
    """Make `settings.kernels` this process's kernel default (main() calls it once)."""
    from moetier.kernels import set_default_activations, set_default_backend, set_idle_spin

    try:
        set_default_backend(settings.kernels.backend)
    except ValueError as e:
        raise InvalidArgument(f"kernels.backend: {e}") from None
    set_default_activations(settings.kernels.activations)
    set_idle_spin(settings.kernels.idle_spin_us)


def load_settings(config: Path | None = None, overrides: dict[str, Any] | None = None,
                  environ: dict[str, str] | None = None) -> Settings:
    """Build the settings: flags (`overrides`, nested dicts) > env > config file > defaults.

    `environ` replaces os.environ (tests, and `moetier up` preparing children).
    """
    data: dict[str, Any] = {}
    if config is not None:
        try:
            data = yaml.safe_load(Path(config).read_text()) or {}
        except FileNotFoundError:
            raise InvalidArgument(f"config file {config} does not exist") from None
        except yaml.YAMLError as e:
            raise InvalidArgument(f"config file {config} is not valid YAML: {e}") from None
        if not isinstance(data, dict):
            raise InvalidArgument(f"config file {config}: top level must be a mapping of sections")
    token = _config_file.set(data)
    saved = None
    if environ is not None:
        saved = {k: v for k, v in os.environ.items() if k.startswith("MOETIER_")}
        for k in saved:
            del os.environ[k]
        os.environ.update({k: v for k, v in environ.items() if k.startswith("MOETIER_")})
    try:
        from pydantic import ValidationError

        try:
            return Settings(**(overrides or {}))
        except ValidationError as e:
            where = f" (config file {config})" if config else ""
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()
            )
            raise InvalidArgument(f"invalid settings{where}: {problems}") from None
        except SettingsError as e:
            raise _env_error(e) from None
    finally:
        _config_file.reset(token)
        if saved is not None:
            for k in [k for k in os.environ if k.startswith("MOETIER_")]:
                del os.environ[k]
            os.environ.update(saved)


def merge_flags(**flags: Any) -> dict[str, Any]:
    """Turn `section__field=value` flags (None = not given) into a nested overrides dict."""
    out: dict[str, Any] = {}
    for key, value in flags.items():
        if value is None or value == []:
            continue
        parts = key.split("__")
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return _deep_merge({}, out)


def address_from_bind(settings: Settings, section: Literal["dense_worker", "expert_store"],
                      bind: str | None) -> Settings:
    """`settings` with the section's `address` (how others reach the service) set to where it
    listens, `bind` (loopback for a wildcard host), when a bind was given on the command line
    and nobody set the address."""
    ep = getattr(settings, section)
    if not bind or "address" in ep.model_fields_set:
        return settings
    host, _, port = bind.rpartition(":")
    host = "127.0.0.1" if host in ("", "0.0.0.0", "[::]") else host
    return settings.model_copy(update={section: ep.model_copy(update={"address": f"{host}:{port}"})})
