"""This machine's measured profile (`moetier tune` writes it, the services and `moetier plan`
read it): data_dir/profile.json, written atomically. A setting given in the config, the
environment or a flag always wins over the profile; a profile of another machine (CPU or
memory size differ) is ignored with a log line.
"""

from __future__ import annotations

import json
import logging
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from moetier.settings import Settings

log = logging.getLogger(__name__)

FILE = "profile.json"
FORMAT = "moetier-profile-1"


def machine_id() -> str:
    """CPU model, core count and RAM: a profile is valid on the machine that measured it."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") >> 30
    return f"{cpu}; {os.cpu_count()} CPUs; {ram} GiB"


@dataclass
class Profile:
    machine: str = field(default_factory=machine_id)
    kernel_threads: int | None = None  # FastOps threads of the dense worker and the store
    queue_depth: int | None = None  # storage.queue_depth
    direct_io: bool | None = None  # storage.direct_io
    prefetch_depth: int | None = None  # storage.prefetch_depth
    memory_gbps: float | None = None
    compute_gbps: float | None = None  # kernels at batch 1 on the tuned model's expert shape
    compute_gbps_batched: float | None = None  # at batch 16
    disk_gbps: float | None = None  # the tuned model's disk at the chosen depth
    gains: dict[str, Any] = field(default_factory=dict)  # per setting: the measurement behind the choice


def profile_path(settings: Settings) -> Path:
    return settings.data_path / FILE


def load_profile(settings: Settings) -> Profile | None:
    path = profile_path(settings)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        log.warning("ignoring the profile %s: %s", path, e)
        return None
    if not isinstance(obj, dict) or obj.pop("format", None) != FORMAT:
        log.warning("ignoring the profile %s: not a %s file", path, FORMAT)
        return None
    try:
        prof = Profile(**obj)
    except TypeError as e:
        log.warning("ignoring the profile %s: %s", path, e)
        return None
    if prof.machine != machine_id():
        log.info("ignoring the profile %s: measured on %s, this is %s", path, prof.machine, machine_id())
        return None
    return prof


def save_profile(settings: Settings, prof: Profile) -> Path:
    path = profile_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"format": FORMAT, **asdict(prof)}, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def apply_profile(settings: Settings) -> Settings:
    """`settings` with the profile's storage choices where nothing (flag, environment, config
    file) set them; unchanged without a profile for this machine."""
    prof = load_profile(settings)
    if prof is None:
        return settings
    st = settings.storage
    given = st.model_fields_set
    update = {k: v for k, v in (("queue_depth", prof.queue_depth), ("direct_io", prof.direct_io),
                                ("prefetch_depth", prof.prefetch_depth)) if v is not None and k not in given}
    if not update:
        return settings
    log.info("profile %s: %s", profile_path(settings), ", ".join(f"storage.{k}={v}" for k, v in update.items()))
    return settings.model_copy(update={"storage": st.model_copy(update=update)})


def profile_threads(settings: Settings) -> int | None:
    """The dense worker's kernel threads from the profile (None: none saved, FastOps' default)."""
    prof = load_profile(settings)
    return None if prof is None else prof.kernel_threads
