"""`moetier doctor`'s checks: the machine, the model's disk, the container, the config, and the
clients' snippets. Each check is one `Check`: ok, warn or fail, what was found, and the fix.

    checks = run_checks(settings, model_dir, deep=False)   # list[Check]

The seed's pitfalls each have a check: a virtual or SATA disk (and rotational media, network
mounts), random reads under 1 GB/s, dense and expert files mixed, an int4 MTP head, per-row int4
experts, the wrong base URL or client variables (the snippets are printed from the settings),
and keys in files (the snippets name the key's variable, never its value).
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shutil
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from moetier.settings import Settings, resolve_budget

DISK_MIN_GBPS = 1.0  # the seed's rule of thumb for random expert reads
DISK_SECONDS = 3.0
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "9p", "fuse.sshfs", "ceph", "glusterfs", "lustre", "afs",
              "virtiofs", "fuse.s3fs")
OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    group: str  # machine | disk | container | config | clients
    name: str
    status: str  # ok | warn | fail
    message: str
    fix: str = ""
    data: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in (None, "")}


# ---- the machine ------------------------------------------------------------------------------
def cpu_flags() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name":
                model = value.strip()
            elif key in ("flags", "Features"):
                flags = set(value.split())
                break
    return model, flags


def meminfo() -> dict[str, int]:
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 else 1)
    return out


def check_cpu() -> Check:
    model, flags = cpu_flags()
    wanted = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vbmi", "asimd", "asimddp", "sve") if f in flags]
    return Check("machine", "cpu", OK, f"{model}, {os.cpu_count()} CPUs; SIMD: {', '.join(wanted) or 'none found'}",
                 data={"model": model, "cpus": os.cpu_count(), "simd": wanted})


def check_kernels(probe_shape: tuple[int, int, str, int]) -> Check:
    """Which FastOps backend runs here and its GB/s of expert weights at batch 1 (a 1-second probe)."""
    from moetier import probe
    from moetier.kernels.fast import FastOps, c_problem

    ops = FastOps()
    hidden, inter, dtype, group = probe_shape
    experts = probe.random_experts(hidden, inter, dtype, group, 64 << 20)  # type: ignore[arg-type]
    rate = probe.kernel_gbps(experts, 1, 1.0, ops)
    mem = probe.memory_gbps(128)
    data = {"backend": ops.backend, "threads": ops.threads, "gbps": rate.gbps, "memory_gbps": mem,
            "expert": f"{dtype} g{group} D={hidden} I={inter}"}
    msg = (f"FastOps backend {ops.backend}, {ops.threads} threads: {rate.gbps:.2f} GB/s of {dtype} expert weights "
           f"at batch 1 = {rate.gbps / mem:.0%} of the memory bandwidth ({mem:.1f} GB/s)")
    problem = c_problem()
    if problem:
        return Check("machine", "kernels", WARN, f"{msg}; {problem}", "reinstall with a C compiler: pip install -e .",
                     data)
    return Check("machine", "kernels", OK, msg, data=data)


def check_ram(settings: Settings, expert_bytes: int | None, dense_bytes: int | None) -> Check:
    mem = meminfo()
    total, avail = mem.get("MemTotal", 0), mem.get("MemAvailable", 0)
    data = {"total_bytes": total, "available_bytes": avail}
    msg = f"{total / 1e9:.1f} GB RAM, {avail / 1e9:.1f} GB available"
    if expert_bytes is None or dense_bytes is None:
        return Check("config", "memory", OK, msg, data=data)
    cache = min(resolve_budget(settings.model.expert_cache, expert_bytes), expert_bytes)  # never more than all
    need = cache + dense_bytes
    data.update(expert_cache_bytes=cache, dense_bytes=dense_bytes)
    msg += f"; expert cache {cache / 1e9:.2f} GB (model.expert_cache {settings.model.expert_cache!r}) + dense {dense_bytes / 1e9:.2f} GB"
    if need > total:
        return Check("config", "memory", FAIL, msg + f" = {need / 1e9:.2f} GB, more than the machine's RAM",
                     "lower model.expert_cache (`moetier plan` sizes it: (RAM - overhead - dense) / record size)", data)
    if need > 0.9 * avail:
        return Check("config", "memory", WARN, msg + f" = {need / 1e9:.2f} GB, near what is available: the machine "
                     "may swap or kill a service", "lower model.expert_cache", data)
    return Check("config", "memory", OK, msg, data=data)


def check_free_disk(settings: Settings, model: Path | None) -> Check:
    where = {"data_dir": settings.data_path}
    if model is not None:
        where["model"] = model
    parts, data, worst = [], {}, OK
    for name, path in where.items():
        p = path
        while not p.exists() and p != p.parent:
            p = p.parent
        free = shutil.disk_usage(p).free
        data[name] = free
        parts.append(f"{name} {free / 1e9:.1f} GB free")
        if name == "data_dir" and free < 2e9:
            worst = WARN
    return Check("machine", "free disk", worst, "; ".join(parts),
                 "free space under data_dir (prefix cache, history, logs)" if worst != OK else "", data)


def check_direct_io(model: Path) -> Check:
    """O_DIRECT on the experts' filesystem (the store's reads bypass the page cache), and io_uring."""
    from moetier.store.buffers import alloc_aligned

    files = sorted((model / "experts").glob("*.bin"))
    uring = "io_uring: "
    try:
        disabled = Path("/proc/sys/kernel/io_uring_disabled").read_text().strip()
        uring += "enabled" if disabled == "0" else f"disabled (io_uring_disabled={disabled})"
    except OSError:
        uring += "enabled by default" if _kernel_at_least(5, 1) else "not in this kernel"
    uring += " (the store reads with a thread pool; io_uring is not required)"
    if not files:
        return Check("machine", "O_DIRECT", WARN, "no expert files to try O_DIRECT on; " + uring)
    flag = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(files[0], os.O_RDONLY | flag)
    except OSError as e:
        return Check("machine", "O_DIRECT", WARN, f"O_DIRECT refused on {files[0].parent} ({e.strerror}): expert "
                     "reads go through the page cache, which then competes with the expert cache; " + uring,
                     "keep the experts on a local ext4/xfs filesystem (not tmpfs or a network mount)")
    try:
        buf = alloc_aligned(4096)
        os.preadv(fd, [buf.data], 0)
    except OSError as e:
        return Check("machine", "O_DIRECT", WARN, f"O_DIRECT reads fail on {files[0].parent} ({e.strerror}); "
                     + uring, "keep the experts on a local ext4/xfs filesystem")
    finally:
        os.close(fd)
    return Check("machine", "O_DIRECT", OK, f"O_DIRECT reads work on {files[0].parent}; " + uring)


def _kernel_at_least(major: int, minor: int) -> bool:
    try:
        nums = [int(x) for x in platform.release().split("-")[0].split(".")[:2]]
    except ValueError:
        return False
    return (nums[0], nums[1]) >= (major, minor)


# ---- the model's disk ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Device:
    name: str  # block device (the whole disk), or "" where /sys does not tell
    fstype: str
    mount: str
    rotational: bool | None
    transport: str  # nvme | sata | virtio | scsi | ... | ""
    read_ahead_kb: int | None


def device_of(path: Path) -> Device:
    mount, fstype = _mount_of(path)
    name = ""
    st = os.stat(path)
    sys_dev = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    rot: bool | None = None
    transport = ""
    ra: int | None = None
    with contextlib.suppress(OSError):
        real = sys_dev.resolve()
        disk = real.parent if (real / "partition").exists() else real
        name = disk.name
        with contextlib.suppress(OSError, ValueError):
            rot = Path(f"/sys/block/{name}/queue/rotational").read_text().strip() == "1"
        with contextlib.suppress(OSError, ValueError):
            ra = int(Path(f"/sys/block/{name}/queue/read_ahead_kb").read_text())
        parts = str(disk).split("/")
        if name.startswith("nvme"):
            transport = "nvme"
        elif name.startswith(("vd", "xvd")) or "virtio" in "/".join(parts):
            transport = "virtio"
        elif "ata" in "/".join(p for p in parts if p.startswith("ata")):
            transport = "sata"
        elif name.startswith("sd"):
            transport = "scsi"
        with contextlib.suppress(OSError):
            vendor = Path(f"/sys/block/{name}/device/vendor").read_text().strip()
            if vendor in ("QEMU", "VMware", "Msft", "Google", "Amazon", "VBOX"):
                transport = f"virtual ({vendor})"
    return Device(name, fstype, mount, rot, transport, ra)


def _mount_of(path: Path) -> tuple[str, str]:
    best, fstype = "", ""
    real = str(path.resolve())
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            mnt = fields[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                best, fstype = mnt, fields[2]
    return best, fstype


def check_device(model: Path) -> Check:
    d = device_of(model / "experts")
    data = asdict(d)
    what = f"{d.name or '?'} ({d.transport or 'transport unknown'}), {d.fstype or '?'} on {d.mount or '?'}"
    if d.read_ahead_kb is not None:
        what += f", read_ahead_kb {d.read_ahead_kb}"
    if d.fstype in NETWORK_FS or d.fstype.startswith("fuse"):
        return Check("disk", "device", FAIL, f"the experts are on a network or FUSE filesystem: {what}",
                     "copy the container to a local NVMe drive", data)
    if d.transport.startswith(("virtio", "virtual")):
        rot = "; it reports itself rotational (a virtual disk's flag says little)" if d.rotational else ""
        return Check("disk", "device", WARN, f"the experts are on a virtual disk: {what}{rot}; its speed is the "
                     "host's, often under 1 GB/s of random reads", "a local NVMe drive (the read test tells)", data)
    if d.rotational:
        return Check("disk", "device", FAIL, f"the experts are on rotational media: {what}",
                     "move the experts to an NVMe SSD (random reads of MB records need >= 1 GB/s)", data)
    if d.transport == "sata":
        return Check("disk", "device", WARN, f"the experts are on a SATA disk: {what}; SATA tops out near 0.5 GB/s",
                     "a local NVMe drive", data)
    return Check("disk", "device", OK, what, data=data)


def check_disk_speed(model: Path, settings: Settings) -> Check:
    from moetier import probe
    from moetier.weights.index import ExpertIndex

    r = probe.disk_gbps(ExpertIndex.load(model), settings.storage.queue_depth, DISK_SECONDS)
    data = asdict(r)
    how = "O_DIRECT" if r.direct else "buffered (the page cache may serve some)"
    msg = (f"random {how} reads of {r.record_bytes / 1e6:.2f} MB records at depth {r.depth}: {r.gbps:.2f} GB/s "
           f"({r.reads} reads in {DISK_SECONDS:.0f} s, median {r.p50_s * 1e3:.1f} ms)")
    if r.gbps < DISK_MIN_GBPS:
        return Check("disk", "random reads", WARN, f"{msg}, under the {DISK_MIN_GBPS:g} GB/s a hot cache needs",
                     "an NVMe drive, a mirror on a second one (storage.mirrors), or a larger expert cache", data)
    return Check("disk", "random reads", OK, f"{msg} (>= {DISK_MIN_GBPS:g} GB/s)", data=data)


# ---- the container ---------------------------------------------------------------------------------
def container_checks(model: Path, deep: bool) -> list[Check]:
    from moetier.errors import MoetierError
    from moetier.weights.container import Container

    out = [_check_tokenizer(model), _check_separate(model)]  # these need no valid container
    try:
        c = Container.open(model)
    except MoetierError as e:
        return [Check("container", "format", FAIL, str(e), "reconvert with `moetier convert`"), *out]
    with c:
        if deep:
            try:
                c.verify()
                out.append(Check("container", "checksums", OK, f"every file and expert record matches "
                                 f"{len(c.files)} checksums"))
            except MoetierError as e:
                out.append(Check("container", "checksums", FAIL, str(e), "reconvert, or copy the file again"))
        else:
            out.append(Check("container", "checksums", OK, "manifest, sizes and expert index valid (--deep reads "
                             "every byte against its checksum)"))
        out.append(_check_mtp(c.path, c.files))
        out.append(_check_per_row(c))
    return out


def _check_separate(root: Path) -> Check:
    dense, experts = root / "dense", root / "experts"
    mixed = [p.name for p in experts.glob("*.safetensors")] + [p.name for p in dense.glob("*.bin")]
    if mixed:
        return Check("container", "layout", FAIL, f"dense and expert files mixed: {', '.join(mixed[:3])}",
                     "reconvert: dense tensors in dense/, expert records in experts/")
    return Check("container", "layout", OK, "dense/ and experts/ are separate directories")


def _check_mtp(root: Path, files: dict[str, Any]) -> Check:
    from moetier.weights.dense import DenseFile

    mtp = sorted(rel for rel in files if rel.startswith("mtp/") and rel.endswith(".safetensors"))
    if not mtp:
        return Check("container", "MTP head", OK, "no MTP head (nothing to check)")
    dtypes = set()
    for rel in mtp:
        df = DenseFile(root / rel, rel)
        dtypes |= {s.dtype for s in df.specs.values()}
        df.close()
    if "int4" in dtypes:
        return Check("container", "MTP head", FAIL, "the MTP head has int4 tensors: drafts are then accepted 0-4% of "
                     "the time (the seed's figure), so speculation only costs", "reconvert the MTP head as int8")
    return Check("container", "MTP head", OK, f"MTP head stored as {', '.join(sorted(dtypes))}")


def _check_per_row(c: Any) -> Check:
    q = c.quantization
    if q["experts"] != "int4":
        return Check("container", "expert quantization", OK, f"{q['experts']} experts")
    g, hidden, inter = int(q["group_size"]), int(c.args.hidden_size), int(c.args.moe_intermediate_size)
    rows = [name for name, cols in (("gate and up", hidden), ("down", inter)) if g >= cols]
    if not rows:
        return Check("container", "expert quantization", OK, f"int4 experts with group scales (g{g})")
    cols = hidden if g >= hidden else inter
    loss = per_row_loss(inter if cols == hidden else hidden, cols)
    return Check("container", "expert quantization", WARN,
                 f"per-row int4 experts ({' and '.join(rows)}: one scale per row, g{g}): measured here on a "
                 f"heavy-tailed random [{inter if cols == hidden else hidden}, {cols}] matrix, relative weight error "
                 f"{loss['per_row']:.1%} per row vs {loss['g64']:.1%} with group-64 scales ({loss['ratio']:.1f}x); "
                 "the seed reports ~9% quality loss for per-row int4",
                 "reconvert with `moetier convert --experts int4 --group-size 64`", loss)


def per_row_loss(rows: int, cols: int, seed: int = 0) -> dict[str, float]:
    """Relative Frobenius error of int4 per-row vs group-64 quantization of a heavy-tailed random
    matrix (Student t, 4 degrees of freedom: a few large weights per row, as trained ones have)."""
    from moetier.weights.quant import quantize

    w = np.random.default_rng(seed).standard_t(4, size=(min(rows, 256), cols)).astype(np.float32)
    norm = float(np.linalg.norm(w))
    errs = {}
    for name, g in (("per_row", cols), ("g64", 64)):
        d = quantize(w, "int4", g).dequantize()[:, :cols]
        errs[name] = float(np.linalg.norm(d - w)) / norm
    errs["ratio"] = errs["per_row"] / errs["g64"] if errs["g64"] else 0.0
    return errs


def _check_tokenizer(root: Path) -> Check:
    if not (root / "tokenizer.json").is_file():
        return Check("container", "tokenizer", FAIL, "no tokenizer.json: the gateway cannot turn text into tokens",
                     "copy tokenizer.json (and tokenizer_config.json) from the source checkpoint")
    template = None
    with contextlib.suppress(OSError, json.JSONDecodeError, UnicodeDecodeError):
        template = json.loads((root / "tokenizer_config.json").read_text()).get("chat_template")
    if template is None and not (root / "chat_template.jinja").is_file():
        return Check("container", "tokenizer", WARN, "tokenizer.json present, but no chat template: chat requests "
                     "and tool calls cannot be rendered", "copy tokenizer_config.json with its chat_template")
    return Check("container", "tokenizer", OK, "tokenizer.json and a chat template present")


# ---- the config ------------------------------------------------------------------------------------
def check_mirrors(settings: Settings, model: Path | None) -> list[Check]:
    mirrors = settings.storage.mirrors
    if not mirrors:
        return [Check("config", "mirrors", OK, "no mirrors configured")]
    out = []
    seen: dict[int, str] = {}
    if model is not None:
        seen[os.stat(model / "experts" if (model / "experts").is_dir() else model).st_dev] = "the primary"
    for m in mirrors:
        p = Path(m).expanduser()
        d = p / "experts" if (p / "experts").is_dir() else p
        if not d.is_dir() or not any(d.glob("*.bin")):
            out.append(Check("config", "mirrors", FAIL, f"mirror {p}: no expert files (*.bin) there",
                             "point storage.mirrors at a copy of the container or of its experts/"))
            continue
        dev = os.stat(d).st_dev
        if dev in seen:
            out.append(Check("config", "mirrors", FAIL, f"mirror {p} is on the same device as {seen[dev]}: it adds "
                             "no bandwidth, only reads split over one disk", "put each mirror on a drive of its own"))
            continue
        seen[dev] = f"mirror {p}"
        out.append(Check("config", "mirrors", OK, f"mirror {p} on a device of its own"))
    return out


def check_binds(settings: Settings) -> Check:
    exposed = []
    for name in ("router", "dense_worker", "expert_store"):
        host = getattr(settings, name).bind.rpartition(":")[0].strip("[]")
        if host in ("0.0.0.0", "::", ""):
            exposed.append(f"{name} ({getattr(settings, name).bind})")
    gw = settings.gateway.bind.rpartition(":")[0].strip("[]")
    note = ""
    if gw in ("0.0.0.0", "::", "") and not settings.gateway.api_key:
        note = "; the gateway listens on every interface without gateway.api_key"
    if exposed:
        return Check("config", "bind addresses", WARN, f"internal services listen on every interface: "
                     f"{', '.join(exposed)}{note}", "bind them to 127.0.0.1 or a private network; only the gateway "
                     "is meant to be reachable")
    if note:
        return Check("config", "bind addresses", WARN, "internal services on loopback or private addresses" + note,
                     "set gateway.api_key (MOETIER_GATEWAY__API_KEY) or bind the gateway to 127.0.0.1")
    return Check("config", "bind addresses", OK, f"only the gateway is meant to be reached ({settings.gateway.bind}); "
                 "the internal services bind to specific addresses")


# ---- the clients -----------------------------------------------------------------------------------
KEY_VAR = "MOETIER_GATEWAY__API_KEY"


def client_snippets(settings: Settings, model_name: str) -> dict[str, str]:
    """Copy-paste configuration for the OpenAI SDK, Claude Code, Codex and curl. The key is named
    by its environment variable, never written out."""
    from moetier.launch import curl_command, gateway_url

    url = gateway_url(settings)
    keyed = settings.gateway.api_key is not None
    key_py = f'os.environ["{KEY_VAR}"]' if keyed else '"unused"'
    openai = (f'import os\nfrom openai import OpenAI\n\nclient = OpenAI(base_url="{url}/v1", api_key={key_py})\n'
              f'r = client.chat.completions.create(model="{model_name}", '
              'messages=[{"role": "user", "content": "Hello"}])\nprint(r.choices[0].message.content)')
    claude = json.dumps({"env": {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_MODEL": model_name}}, indent=2)
    claude = (f"# ~/.claude/settings.json\n{claude}\n# the token from the shell, not the file:\n"
              f'export ANTHROPIC_AUTH_TOKEN="${KEY_VAR}"' if keyed else
              f"# ~/.claude/settings.json\n{claude}\n# no gateway.api_key: any token is accepted\n"
              'export ANTHROPIC_AUTH_TOKEN="unused"')
    codex = (f'# ~/.codex/config.toml\nmodel = "{model_name}"\nmodel_provider = "moetier"\n\n'
             f'[model_providers.moetier]\nname = "moetier"\nbase_url = "{url}/v1"\n'
             + (f'env_key = "{KEY_VAR}"\n' if keyed else "") + 'wire_api = "responses"')
    return {"openai": openai, "claude_code": claude, "codex": codex, "curl": curl_command(settings, model_name)}


# ---- all of it ---------------------------------------------------------------------------------------
def run_checks(settings: Settings, model: Path | None, deep: bool = False, disk: bool = True,
               kernels: bool = True, progress: Callable[[Check], None] | None = None) -> list[Check]:
    out: list[Check] = []

    def add(c: Check | list[Check]) -> None:
        for x in c if isinstance(c, list) else [c]:
            out.append(x)
            if progress is not None:
                progress(x)

    expert_bytes = dense_bytes = None
    shape: tuple[int, int, str, int] = (2048, 1408, "int4", 64)  # mini-glm's expert, when no model is given
    if model is not None:
        from moetier.errors import MoetierError
        from moetier.perf import ModelCosts
        from moetier.weights.container import Container

        with contextlib.suppress(MoetierError), Container.open(model) as c:
            q = c.quantization
            costs = ModelCosts.of(c.args, "", q["experts"], q["dense"], q["group_size"])
            expert_bytes, dense_bytes = c.expert_bytes, costs.dense_bytes
            shape = (c.args.hidden_size, c.args.moe_intermediate_size, q["experts"], q["group_size"])
    add(check_cpu())
    if kernels:
        add(check_kernels(shape))
    add(check_free_disk(settings, model))
    if model is not None:
        add(check_direct_io(model))
        add(check_device(model))
        if disk:
            add(check_disk_speed(model, settings))
        add(container_checks(model, deep))
    add(check_ram(settings, expert_bytes, dense_bytes))
    add(check_mirrors(settings, model))
    add(check_binds(settings))
    return out
