"""The settings each command reads, listed as environment variables at the end of its --help
(`describe(subparsers)` runs once the commands are registered). A command not named here that
takes --config lists every setting."""

from __future__ import annotations

import argparse
from typing import Any

from pydantic import BaseModel

from moetier.settings import Settings

_SERVICE = ("data_dir", "heartbeat_interval_s", "member_expiry_s", "router")
SECTIONS: dict[str, tuple[str, ...]] = {
    "router": ("router", "queue_capacity", "test_clock_offset_file", *_SERVICE),
    "dense-worker": ("model", "inference", "kernels", "dense_worker", "expert_store", *_SERVICE),
    "expert-store": ("model", "storage", "cache", "kernels", "expert_store", *_SERVICE),
    "gateway": ("model", "gateway", *_SERVICE),
    "generate": ("model", "inference", "kernels", "data_dir"),
    "logits": ("model", "kernels", "data_dir"),
    "inspect": ("model", "data_dir"),
    "doctor": ("model", "storage", "kernels", "gateway", "router", "dense_worker", "expert_store", "data_dir"),
    "plan": ("model", "cache", "storage", "kernels", "data_dir"),
    "tune": ("model", "storage", "cache", "kernels", "data_dir"),
    "simulate": ("model", "cache", "data_dir"),
    "bench": ("model", "storage", "cache", "inference", "kernels", "data_dir"),
}


def env_vars(sections: tuple[str, ...] | None = None) -> list[str]:
    """MOETIER_* names of the settings in `sections` (top-level fields or whole sections; None: all)."""
    out = []
    defaults = Settings.model_construct()
    for name, field in Settings.model_fields.items():
        if sections is not None and name not in sections:
            continue
        value = getattr(defaults, name, field.default)
        if isinstance(value, BaseModel):
            out += [f"MOETIER_{name.upper()}__{sub.upper()}" for sub in type(value).model_fields]
        else:
            out.append(f"MOETIER_{name.upper()}")
    return out


def _takes_config(p: argparse.ArgumentParser) -> bool:
    return any("--config" in a.option_strings for a in p._actions)


def describe(sub: Any, top: str = "") -> None:
    """Give every command parser that takes --config an epilog naming its settings' variables."""
    for name, p in sub.choices.items():
        nested = [a for a in p._actions if isinstance(a, argparse._SubParsersAction)]
        for n in nested:
            describe(n, top or name)
        if not _takes_config(p) or p.epilog:
            continue
        key = top or name
        names = env_vars(SECTIONS.get(key))
        p.epilog = ("settings, highest priority first: flags, these environment variables, --config FILE, "
                    "defaults (docs/config.md): " + ", ".join(names))
