"""The hidden-config oracle (scripts/oracle_hidden.py) on a few seeds: DSA configs drawn at
random, built by transformers, converted and run through the moetier commands."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import helpers_hf as hf
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "oracle_hidden.py"


def _script():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("oracle_hidden", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["oracle_hidden"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_drawn_configs_vary_what_the_fixtures_fix() -> None:
    oh = _script()
    from moetier.convert.adapters import adapter_for

    for arch in oh.ARCHS:
        args = [adapter_for(arch).model_args(oh.draw_config(arch, s)) for s in range(12)]
        assert len({a.index_topk for a in args}) > 2 and len({a.index_n_heads for a in args}) > 1
        assert len({a.num_layers for a in args}) > 1
        if arch == "glm_moe_dsa":  # full and shared schedules both drawn
            assert any(not all(a.indexer_layers) for a in args) and any(all(a.indexer_layers) for a in args)


@pytest.mark.skipif(not hf.hf_available(), reason="torch/transformers not installed (the [oracle] extra)")
@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])
@pytest.mark.parametrize("seed", [101, 102])
def test_hidden_config(arch: str, seed: int, tmp_path: Path) -> None:
    o = _script().check(arch, seed, tmp_path)
    assert o.ok, f"{arch} seed {seed}: max |logit error| {o.error:.3e} > {o.tolerance:.3e}"
