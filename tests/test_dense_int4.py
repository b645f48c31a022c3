"""Dense weights stored as int4 (`moetier convert --dense int4`): the converter writes them,
every reader of dense tensors computes with them (embedding rows, lm_head, GQA and MLA
projections, shared experts, dense MLP layers), inspect reports their error, and the cluster
produces exactly the in-process engine's tokens from them.

Tolerance of the logits against the same checkpoint converted with f32 dense weights: int4
with one scale per 64 inputs has a relative RMS error of about 0.1 per matrix (inspect
measures it); through a few layers, and with the router choosing a different expert
wherever two were nearly tied, the tiny models' logits move by 0.18-0.41 relative RMS
(measured when this test was written) with the top-1 token agreeing at 85-100% of the
positions. The bound, 0.5, separates that from a broken int4 path (a wrong nibble order,
scale group or row), whose logits are uncorrelated with the reference: relative error
1.0-1.4. The int8 container of the same checkpoint must land closer than the int4 one.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_cluster_e2e import MODEL, chat, expected_reply, up

from moetier.cli import main
from moetier.convert import synth
from moetier.convert.converter import ConvertOptions, convert
from moetier.engine import Engine
from moetier.weights import Container

REL_RMS_BOUND = 0.5
TOP1_AGREEMENT = 0.8
# olmoe: the peers benchmark's architecture; qwen2_moe: shared experts; deepseek_v2: MLA without
# q_lora; deepseek_v3: MLA with q_lora, a dense first layer and a grouped router
ARCHS = ["olmoe", "qwen2_moe", "deepseek_v2", "deepseek_v3"]


def _logits(container: Path, ids: np.ndarray) -> np.ndarray:
    with Engine.open(container, budget="100%") as e:
        return e.logits(ids)


def _rel_rms(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((x - ref) ** 2)) / np.sqrt(np.mean(ref**2)))


@pytest.mark.parametrize("arch", ARCHS)
def test_int4_dense_logits_are_close_to_f32_dense(tmp_path: Path, arch: str) -> None:
    hf = synth.write_hf_checkpoint(f"tiny-{arch}", tmp_path / "hf", 0, dtype="f32")
    ids = np.random.default_rng(1).integers(7, synth.preset(f"tiny-{arch}").args.vocab_size, 48)
    logits = {}
    for dense in ("f32", "int8", "int4"):
        # f32 experts: only the dense part differs between the three containers
        out = convert(hf, tmp_path / dense, ConvertOptions("f32", dense, 64), progress=False)
        c = Container.open(out)
        try:
            assert c.quantization["dense"] == dense
            assert c.dense("layers.0.attn_norm").dtype == "f32"  # norms stay exact
            assert c.dense("embed").dtype == dense
        finally:
            c.close()
        logits[dense] = _logits(out, ids)
    ref = logits["f32"]
    err4, err8 = _rel_rms(logits["int4"], ref), _rel_rms(logits["int8"], ref)
    assert 0 < err8 < err4 < REL_RMS_BOUND, (err8, err4)
    assert np.mean(logits["int4"].argmax(-1) == ref.argmax(-1)) >= TOP1_AGREEMENT


def test_convert_flag_and_inspect_report_the_dense_int4_error(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    hf = synth.write_hf_checkpoint("tiny-olmoe", tmp_path / "hf", 0, dtype="bf16")
    out = tmp_path / "c"
    assert main(["convert", "--dense", "int4", "--group-size", "32", str(hf), str(out)]) == 0
    capsys.readouterr()
    assert main(["inspect", "--json", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quantization"] == {"experts": "int4", "dense": "int4", "group_size": 32}
    dense = report["quant_error"]["dense"]
    assert dense["dtype"] == "int4"
    # the stored tensors are int4 g32, the method of the "int4 g32" column: the same figure
    assert dense["rel_rms"] == pytest.approx(dense["int4_g32_rel_rms"])
    assert 0.05 < dense["rel_rms"] < 0.2  # int4's error, not int8's (~0.006) nor zero
    assert dense["rel_rms"] <= dense["int4_per_row_rel_rms"]


async def test_cluster_equals_in_process_with_int4_dense(tmp_path: Path) -> None:
    model = synth.write_container("tiny-deepseek_v3", tmp_path / MODEL, 0, dense="int4")
    messages = [{"role": "user", "content": "Tell me about the disks and the experts of this machine."}]
    async with up(model, tmp_path) as c:
        reply = (await chat(c.client, messages))["choices"][0]["message"]["content"]
        assert reply == expected_reply(model, c.served, messages, 24)
