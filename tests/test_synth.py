"""synth presets, determinism, the project tokenizer, inspect, and (where installed) loading
synth checkpoints with transformers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, cast

import jinja2
import numpy as np
import pytest

from moetier.cli import main
from moetier.convert import synth
from moetier.convert.tokenizer import (
    BOS_ID,
    CHAT_TEMPLATE,
    END_ID,
    EOS_ID,
    SPECIAL_TOKENS,
    _train,
    corpus_texts,
    load_tokenizer,
    tokenizer_files,
)
from moetier.errors import InvalidArgument
from moetier.weights import Container

TINY = [n for n in synth.PRESETS if n.startswith("tiny-")]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_every_adapter_arch_has_a_tiny_preset() -> None:
    from moetier.convert.adapters import ADAPTERS

    # qwen3_5_moe_text is the text-only form of qwen3_5_moe: tiny-qwen3_5_moe is written in it
    forms = {"qwen3_5_moe_text": "qwen3_5_moe"}
    assert sorted(TINY) == sorted({f"tiny-{forms.get(a, a)}" for a in ADAPTERS})
    assert synth.PRESETS["tiny-qwen3_5_moe"].config["model_type"] == "qwen3_5_moe_text"
    for name in TINY:
        a = synth.preset_args(name)
        assert a.hidden_size == 64 and a.n_routed_experts == 8 and a.num_experts_per_tok == 2
        assert 32 <= a.moe_intermediate_size <= 64 and a.num_layers in (2, 3, 4)  # 4: GLM-5 full + shared indexers
        assert a.vocab_size == load_tokenizer(synth.PRESETS[name].tokenizer_vocab).get_vocab_size() == 512


def test_tiny_presets_exercise_their_quirks() -> None:
    v3, v2 = synth.preset_args("tiny-deepseek_v3"), synth.preset_args("tiny-deepseek_v2")
    assert v3.group_score == "top2_sum" and (v3.n_group, v3.topk_group) == (4, 2) and v3.q_lora_rank == 32
    assert v3.rope_scaling is not None and v3.rope_scaling["rope_type"] == "yarn"
    assert v3.moe_layers == (False, True, True) and v3.score_correction_bias
    assert v2.q_lora_rank is None and v2.scoring_func == "softmax" and v2.moe_layers[0] is False
    glm = synth.preset_args("tiny-glm4_moe")
    assert glm.qk_norm == "head" and glm.qkv_bias and glm.moe_layers[0] is False and glm.rope_dim == 8
    assert synth.preset_args("tiny-qwen2_moe").qkv_bias and synth.preset_args("tiny-qwen2_moe").shared_expert_gate
    assert synth.preset_args("tiny-olmoe").qk_norm == "full"


def test_big_presets_shapes() -> None:
    demo = synth.preset_args("demo")
    assert demo.attention == "mla" and 512 <= demo.hidden_size <= 768 and 8 <= demo.num_layers <= 12
    assert 32 <= demo.n_routed_experts <= 64 and demo.num_experts_per_tok == 4
    assert 100e6 <= synth.total_expert_bytes(demo) <= 300e6
    mg = synth.preset_args("mini-glm")
    assert (mg.hidden_size, mg.num_layers, mg.n_routed_experts, mg.num_experts_per_tok) == (2048, 27, 64, 6)
    assert (mg.moe_intermediate_size, mg.shared_intermediate_size, mg.kv_lora_rank, mg.q_lora_rank) == (
        1408, 2816, 512, None)
    assert (mg.vocab_size, mg.intermediate_size, mg.num_heads) == (102400, 10944, 16)
    assert 7e9 <= synth.total_expert_bytes(mg) <= 8e9
    ol = synth.preset_args("olmoe-1b-7b")
    assert (ol.hidden_size, ol.num_layers, ol.n_routed_experts, ol.num_experts_per_tok,
            ol.moe_intermediate_size, ol.vocab_size) == (2048, 16, 64, 8, 1024, 50304)
    g5 = synth.preset_args("glm-5")
    assert (g5.hidden_size, g5.num_layers, g5.n_routed_experts, g5.moe_intermediate_size) == (6144, 78, 256, 2048)
    assert g5.moe_layers[:4] == (False, False, False, True) and g5.attention == "mla"


def test_refusals(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=r"shape-only: its int4 experts alone would take 385 GB"):
        synth.write_container("glm-5", tmp_path / "g", 0)
    with pytest.raises(InvalidArgument, match="shape-only"):
        synth.write_hf_checkpoint("glm-5", tmp_path / "g", 0)
    with pytest.raises(InvalidArgument, match="use --format container"):
        synth.write_hf_checkpoint("mini-glm", tmp_path / "m", 0)
    with pytest.raises(InvalidArgument, match="unknown preset"):
        synth.write_container("tiny-llama", tmp_path / "x", 0)
    assert not (tmp_path / "g").exists() and not (tmp_path / "m").exists()


def test_deterministic_from_seed(tmp_path: Path) -> None:
    a = synth.write_container("tiny-deepseek_v3", tmp_path / "a", 7)
    b = synth.write_container("tiny-deepseek_v3", tmp_path / "b", 7, workers=2)  # parallel: same bytes
    c = synth.write_container("tiny-deepseek_v3", tmp_path / "c", 8)
    assert _files(a) == _files(b)
    assert (a / "experts/layer-001.bin").read_bytes() != (c / "experts/layer-001.bin").read_bytes()
    h1 = synth.write_hf_checkpoint("tiny-glm4_moe", tmp_path / "h1", 7)
    h2 = synth.write_hf_checkpoint("tiny-glm4_moe", tmp_path / "h2", 7)
    assert _files(h1) == _files(h2)


def test_activations_stay_sane() -> None:
    """Initialisation scales: unit-spread routing logits and O(1) FFN outputs."""
    args = synth.preset_args("demo")
    x = np.random.default_rng(0).standard_normal((64, args.hidden_size)).astype(np.float32)  # a normed hidden state
    router = synth.dense_tensor("layers.1.moe.router", (args.n_routed_experts, args.hidden_size), 0,
                                args.hidden_size)
    logits = x @ router.T
    assert 0.7 < logits.std() < 1.3
    top = np.argsort(-logits, axis=1)[:, :4]
    assert len(np.unique(top)) > args.n_routed_experts // 2  # routing is spread, not degenerate
    shapes = {"gate": (384, 512), "up": (384, 512), "down": (512, 384)}
    g, u, d = (synth.expert_tensor(1, 0, p, s, 0) for p, s in shapes.items())
    h = (x @ g.T) / (1 + np.exp(-(x @ g.T))) * (x @ u.T)
    y = h @ d.T
    assert 0.2 < y.std() < 2.0


def test_tokenizer_deterministic_and_chat_template() -> None:
    texts = corpus_texts()
    assert sum(len(t) for t in texts) > 30_000
    assert _train(512, texts) == _train(512, texts)
    tok = load_tokenizer(512)
    assert tok.get_vocab_size() == 512
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    text = "Experts live on NVMe; the dense part stays in RAM."
    assert tok.decode(tok.encode(text).ids) == text
    assert load_tokenizer(4096).get_vocab_size() > 3000
    files = tokenizer_files(512, 2048)
    cfg = json.loads(files["tokenizer_config.json"])
    gen = json.loads(files["generation_config.json"])
    assert cfg["chat_template"] == CHAT_TEMPLATE and gen["eos_token_id"] == [EOS_ID, END_ID]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    t = jinja2.Environment().from_string(cfg["chat_template"])
    out = t.render(messages=msgs, add_generation_prompt=True, bos_token=cfg["bos_token"])
    assert out == "<|bos|><|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    ids = tok.encode(out).ids
    assert ids[0] == BOS_ID and ids.count(END_ID) == 2


def test_synth_and_inspect_commands(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "c"
    assert main(["synth", "--preset", "tiny-olmoe", "--out", str(out), "--seed", "3"]) == 0
    assert Container.open(out, verify=True).manifest["source"] == {
        "kind": "synth", "model_type": "olmoe", "preset": "tiny-olmoe", "seed": 3, "generator": 2, "files": {}}
    capsys.readouterr()
    assert main(["inspect", str(out), "--verify", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["experts"] == 8 and r["verified"] and r["record_bytes"] % 4096 == 0
    e = r["quant_error"]["experts"]
    assert e["dtype"] == "int4" and 0.05 < e["rel_rms"] < 0.2 and e["int4_per_row_rel_rms"] >= e["rel_rms"]
    assert 0 < r["quant_error"]["dense"]["rel_rms"] < 0.02
    assert main(["inspect", str(out)]) == 0
    text = capsys.readouterr().out
    assert "int4 g64" in text and "int4 row" in text and "experts" in text
    assert main(["synth", "--preset", "tiny-olmoe", "--out", str(tmp_path / "h"), "--format", "hf"]) == 0
    assert (tmp_path / "h" / "model.safetensors").is_file()


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
                    reason="transformers/torch not installed (they come with the [oracle] extra)")
@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
def test_transformers_loads_synth_checkpoints(tmp_path: Path, fused: bool) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoTokenizer

    transformers.logging.set_verbosity_error()
    for name in TINY:
        d = synth.write_hf_checkpoint(name, tmp_path / name, 0, shard_bytes=40_000, fused=fused)
        # Kimi K2.5 is a multimodal wrapper: synth writes its text model only, transformers
        # initialises the vision tower (which the text-only forward never reads)
        wrapper = synth.PRESETS[name].config["model_type"] == "kimi_k25"
        auto = AutoModelForImageTextToText if wrapper else AutoModelForCausalLM
        model, info = cast(Any, auto.from_pretrained(d, output_loading_info=True))
        if wrapper:
            info["missing_keys"] = {k for k in info["missing_keys"]
                                    if not k.startswith(("model.vision_tower.", "model.mm_projector."))}
        # nothing missing, unexpected or mismatched -- but the MTP layers, which transformers loads
        # apart (MtpModel) and skips by a pattern naming only the real checkpoints' layer numbers
        n = synth.preset_args(name).num_layers
        mtp = {k for k in info["unexpected_keys"] if k.startswith(f"model.layers.{n}.")}
        assert bool(mtp) == (synth.PRESETS[name].mtp_layers > 0), name
        assert not any(v for k, v in info.items() if k != "unexpected_keys"), (name, info)
        assert set(info["unexpected_keys"]) == mtp, (name, info)
        tok = AutoTokenizer.from_pretrained(d)
        ids: Any = tok.apply_chat_template([{"role": "user", "content": "Hello disks"}], add_generation_prompt=True)
        ids = ids["input_ids"] if not isinstance(ids, list) else ids
        assert ids == load_tokenizer(512).encode("<|bos|><|user|>\nHello disks<|end|>\n<|assistant|>\n").ids
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True)
        rms = [float(h.float().pow(2).mean().sqrt()) for h in out.hidden_states]
        assert all(0.3 < r < 10 for r in rms), (name, rms)
        assert torch.isfinite(out.logits).all() and 0.3 < float(out.logits.std()) < 5


def test_inspect_refuses_to_regenerate_for_another_generator(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A synth container from an older weight generator gets no made-up error figures."""
    out = tmp_path / "old"
    assert main(["synth", "--preset", "tiny-qwen3_moe", "--out", str(out)]) == 0
    manifest = json.loads((out / "moetier.json").read_text())
    manifest["source"]["generator"] = 1
    (out / "moetier.json").write_text(json.dumps(manifest))
    capsys.readouterr()
    assert main(["inspect", str(out)]) == 0
    assert "not available: built by synth generator 1" in capsys.readouterr().out
