"""The MTP head in the container: written by the converter and synth (int8 by default, bf16 and
f32 allowed, int4 refused), absent when the checkpoint has none, shown by inspect, and drafting
like a trained head on the synth models."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from moetier.cli import main
from moetier.convert import synth
from moetier.convert.converter import ConvertOptions, convert
from moetier.engine import load_dense
from moetier.errors import ConversionError
from moetier.model.experts import DictExperts
from moetier.model.forward import Model
from moetier.model.generate import generate
from moetier.model.mtp import MtpHead
from moetier.model.ops import ReferenceOps
from moetier.model.sampling import SamplingParams
from moetier.weights import Container
from moetier.weights.safetensors_io import MappedFile, SafetensorsWriter

MTP_ARCHS = ("deepseek_v3", "glm4_moe", "glm_moe_dsa", "deepseek_v32")


def test_int4_mtp_is_refused_with_its_reason(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConversionError, match="int4 MTP head drafts with 0-4% acceptance"):
        ConvertOptions(mtp="int4").check()
    hf = synth.write_hf_checkpoint("tiny-deepseek_v3", tmp_path / "hf", 0, dtype="f32")
    assert main(["convert", str(hf), str(tmp_path / "c"), "--mtp", "int4"]) != 0
    err = capsys.readouterr().err
    assert "int4 MTP head drafts with 0-4% acceptance" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c" / "moetier.json").exists()
    assert main(["synth", "--preset", "tiny-deepseek_v3", "--out", str(tmp_path / "s"), "--mtp", "int4"]) != 0
    assert not (tmp_path / "s").exists()
    capsys.readouterr()
    assert main(["synth", "--preset", "glm-5", "--mtp", "int4"]) != 0  # nor printed as a shape it would not write
    assert "int4 MTP head drafts" in capsys.readouterr().err


@pytest.mark.parametrize("mtp", ["bf16", "f32", "none"])
def test_mtp_precision_choices(tmp_path: Path, mtp: str) -> None:
    hf = synth.write_hf_checkpoint("tiny-deepseek_v3", tmp_path / "hf", 0, dtype="f32")
    c = Container.open(convert(hf, tmp_path / "c", ConvertOptions(mtp=mtp), progress=False), verify=True)
    if mtp == "none":
        assert c.mtp is None and not (c.path / "mtp").exists()
        return
    assert c.mtp is not None and c.mtp.dtype == mtp and c.mtp.layout.parts[0].dtype == mtp
    assert c.mtp.dense("mtp.0.eh_proj").dtype == mtp and c.mtp.dense("mtp.0.enorm").dtype == "f32"
    err = c.manifest["mtp"]["quant_error"]["rel_rms"]
    assert err == 0 if mtp == "f32" else 0 < err < 0.01


def test_checkpoint_without_mtp_tensors_has_no_head(tmp_path: Path) -> None:
    """config.json announces an MTP layer, the safetensors were stripped of it: no head, no error."""
    hf = synth.write_hf_checkpoint("tiny-deepseek_v3", tmp_path / "hf", 0, dtype="f32")
    args = synth.preset_args("tiny-deepseek_v3")
    mf = MappedFile(hf / "model.safetensors", "src")
    keep = {n: t for n, t in mf.header.tensors.items()
            if not n.startswith(f"model.layers.{args.num_layers}.")}
    w = SafetensorsWriter(tmp_path / "model.safetensors", [(n, t.dtype, t.shape) for n, t in keep.items()],
                          {"format": "pt"})
    for n in keep:
        w.write(n, np.array(mf.raw(n)))
    w.close()
    mf.close()
    (tmp_path / "model.safetensors").replace(hf / "model.safetensors")
    assert json.loads((hf / "config.json").read_text())["num_nextn_predict_layers"] == 1
    c = Container.open(convert(hf, tmp_path / "c", progress=False))
    assert c.mtp is None


def test_inspect_shows_the_head(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    synth.write_container("tiny-deepseek_v3", tmp_path / "c", 0)
    synth.write_container("tiny-qwen3_moe", tmp_path / "q", 0)
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "c"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["mtp"]
    assert (r["layers"], r["dtype"]) == (1, "int8") and r["expert_bytes"] > 0 and r["dense_bytes"] > 0
    e = r["quant_error"]
    assert 0 < e["rel_rms"] < e["int4_g64_rel_rms"]  # int8 measured against its source, beside int4
    assert main(["inspect", str(tmp_path / "c")]) == 0
    assert "MTP head       1 layer(s), int8 g64" in capsys.readouterr().out
    assert main(["inspect", str(tmp_path / "q")]) == 0
    assert "MTP head       none" in capsys.readouterr().out


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_synth_head_drafts_like_a_trained_one(arch: str, tmp_path: Path) -> None:
    """Greedy acceptance of one drafted token (the MTP's choice equals the main model's next one),
    int4 experts, int8 dense and head as served: >= 50%, the range real MTP heads reach. A random
    head would agree about 1 time in 512."""
    c = Container.open(synth.write_container(f"tiny-{arch}", tmp_path / "c", 0))
    assert c.mtp is not None
    ops = ReferenceOps()
    args = c.args
    experts = DictExperts({(li, e): c.read_expert(li, e) for li in args.moe_layer_ids + c.mtp.expert_layers
                           for e in range(args.n_routed_experts)}, ops)
    model = Model(args, load_dense(c), ops, experts)
    head = MtpHead(model, c.mtp.layers, {n: c.mtp.dense(n) for n in c.mtp.specs}, experts)
    hits = total = 0
    for s in range(4):
        prompt = np.random.default_rng(s).integers(2, args.vocab_size, 12)
        out = [g.token for g in generate(model, prompt, SamplingParams(temperature=0, max_tokens=24,
                                                                       ignore_eos=True))]
        seq = np.concatenate([prompt, out])
        hidden = model.forward([(model.new_cache(), seq)])[0]
        draft = model.head(head.step(0, [(head.new_caches()[0], seq[1:], hidden[:-1], 1)])[0]).argmax(-1)
        # draft row j (position j + 1) predicts seq[j + 2]; count the generated positions
        for p in range(len(prompt) - 1, len(seq) - 1):
            hits += int(draft[p - 1] == seq[p + 1])
            total += 1
    assert hits / total >= 0.5, f"{arch}: greedy acceptance {hits / total:.2f}"
