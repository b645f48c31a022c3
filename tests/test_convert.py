"""HF checkpoint -> container: every architecture, per-expert and fused sources, source
dtypes, resumability after SIGKILL, and bad inputs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moetier.cli import main
from moetier.convert import synth
from moetier.convert.converter import ConvertOptions, convert
from moetier.convert.source import E4M3
from moetier.weights import Container
from moetier.weights.format import MANIFEST
from moetier.weights.quant import bf16_to_f32
from moetier.weights.safetensors_io import MappedFile, SafetensorsWriter

ARCHS = ["deepseek_v3", "deepseek_v2", "glm4_moe", "qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm_moe_dsa",
         "deepseek_v32", "minimax_m2", "qwen3_next", "qwen3_5_moe", "kimi_k25", "gpt_oss"]
SHARD = 20_000  # at most two expert matrices per shard: every expert is split across shards


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def synth_containers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Container]:
    root = tmp_path_factory.mktemp("synth")
    return {a: Container.open(synth.write_container(f"tiny-{a}", root / a, 0)) for a in ARCHS}


@pytest.mark.parametrize("fused", [False, True], ids=["per-expert", "fused"])
@pytest.mark.parametrize("arch", ARCHS)
def test_convert_matches_synth(tmp_path: Path, arch: str, fused: bool,
                               synth_containers: dict[str, Container]) -> None:
    """An f32 HF checkpoint converts to exactly the records and dense tensors synth writes directly."""
    hf = synth.write_hf_checkpoint(f"tiny-{arch}", tmp_path / "hf", 0, dtype="f32", shard_bytes=SHARD, fused=fused)
    assert len(list(hf.glob("*.safetensors"))) > 3
    if not fused:  # some expert's matrices really are split across shards (the spill path runs)
        wm = json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]
        by_expert: dict[str, set[str]] = {}
        for name, shard in wm.items():
            if ".experts." in name:
                by_expert.setdefault(name.rsplit(".", 2)[0], set()).add(shard)
        assert any(len(s) > 1 for s in by_expert.values())
    c = Container.open(convert(hf, tmp_path / "c", progress=False), verify=True)
    ref = synth_containers[arch]
    assert c.args == ref.args
    assert c.index.identity == ref.index.identity  # same layout, files and record checksums
    for name in ref.dense_names():
        a, b = c.dense(name), ref.dense(name)
        assert np.array_equal(a.data, b.data), name
        if a.scales is not None:
            assert b.scales is not None and np.array_equal(a.scales, b.scales), name
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (c.path / name).read_bytes() == (hf / name).read_bytes()
    q = c.manifest["quant_error"]
    assert 0 < q["dense"]["rel_rms"] < 0.02 and 0.05 < q["experts"]["rel_rms"] < 0.2
    assert (c.mtp is None) == (ref.mtp is None) == (arch not in ("deepseek_v3", "glm4_moe", "glm_moe_dsa",
                                                                  "deepseek_v32"))
    if c.mtp is not None and ref.mtp is not None:  # the MTP head: int8 by default, the same bits
        assert (c.mtp.layers, c.mtp.dtype) == (ref.mtp.layers, ref.mtp.dtype) == (1, "int8")
        assert c.mtp.index.identity == ref.mtp.index.identity
        for name in ref.mtp.specs:
            assert np.array_equal(c.mtp.dense(name).data, ref.mtp.dense(name).data), name
        assert 0 < c.manifest["mtp"]["quant_error"]["rel_rms"] < 0.02
    assert c.manifest["source"]["kind"] == "hf" and "model.safetensors.index.json" in c.manifest["source"]["files"]
    assert not (c.path / "convert.journal").exists() and not (c.path / ".spill").exists()


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_half_precision_sources(tmp_path: Path, dtype: str, synth_containers: dict[str, Container]) -> None:
    hf = synth.write_hf_checkpoint("tiny-qwen2_moe", tmp_path / "hf", 0, dtype=dtype)
    c = Container.open(convert(hf, tmp_path / "c", ConvertOptions(experts="bf16", dense="bf16"), progress=False))
    ref = synth_containers["qwen2_moe"]
    li = c.args.moe_layer_ids[0]
    got, want = c.read_expert(li, 5).up.dequantize(), ref.read_expert(li, 5).up.dequantize()
    assert np.abs(got - want).max() < 0.15  # vs int4 of the f32 source
    if dtype == "bf16":  # bf16 -> bf16 is lossless
        src = MappedFile(hf / "model.safetensors")
        raw = src.raw(f"model.layers.{li}.mlp.experts.5.up_proj.weight")
        assert np.array_equal(got, bf16_to_f32(np.ascontiguousarray(raw)))
        src.close()


def test_fp8_block_scaled_source(tmp_path: Path) -> None:
    assert E4M3[0x38] == 1.0 and E4M3[0x40] == 2.0 and E4M3[0x7E] == 448.0 and E4M3[0xB8] == -1.0
    assert E4M3[0x01] == 2.0**-9 and np.isnan(E4M3[0x7F])
    hf = synth.write_hf_checkpoint("tiny-deepseek_v3", tmp_path / "hf", 0, dtype="f32")
    f = hf / "model.safetensors"
    mf = MappedFile(f)
    tensors = {n: np.array(mf.raw(n)) for n in mf.header.tensors}
    mf.close()
    name = "model.layers.0.mlp.down_proj.weight"  # [64, 128]: 1 x 1 blocks of 128
    codes = np.random.default_rng(0).integers(0, 0x7E, tensors[name].shape).astype(np.uint8)
    scale = np.array([[0.5]], dtype=np.float32)
    entries = [(n, "F32", a.shape) for n, a in tensors.items() if n != name]
    entries += [(name, "F8_E4M3", codes.shape), (name + "_scale_inv", "F32", scale.shape)]
    w = SafetensorsWriter(f, entries, {"format": "pt"})
    for n, a in tensors.items():
        if n != name:
            w.write(n, a)
    w.write(name, codes)
    w.write(name + "_scale_inv", scale)
    w.close()
    c = Container.open(convert(hf, tmp_path / "c", ConvertOptions(dense="f32"), progress=False))
    assert np.array_equal(c.dense("layers.0.mlp.w_down").dequantize(), E4M3[codes] * np.float32(0.5))


# ---- resumability -----------------------------------------------------------------------------
KILLER = """
import os, signal, sys
from pathlib import Path
from moetier.convert.converter import convert
limit = int(sys.argv[3])
def hook(done):
    if done >= limit:
        os.kill(os.getpid(), signal.SIGKILL)
convert(Path(sys.argv[1]), Path(sys.argv[2]), on_progress=hook, progress=False)
"""


def test_resume_after_sigkill_is_byte_identical(tmp_path: Path) -> None:
    hf = synth.write_hf_checkpoint("tiny-deepseek_v3", tmp_path / "hf", 3, dtype="bf16", shard_bytes=SHARD)
    ref = convert(hf, tmp_path / "ref", progress=False)
    total = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
    out = tmp_path / "out"
    kills = 0
    for frac in (0.1, 0.35, 0.6, 0.9):
        r = subprocess.run([sys.executable, "-c", KILLER, str(hf), str(out), str(int(total * frac))],
                           capture_output=True, text=True, timeout=120)
        if r.returncode == -signal.SIGKILL:
            kills += 1
        else:
            assert r.returncode == 0, r.stderr
        assert not (out / MANIFEST).exists()
        assert (out / "convert.journal").exists()
    assert kills == 4
    # a torn journal tail (a kill mid-append) is ignored and its shard redone
    with open(out / "convert.journal", "ab") as jf:
        jf.write(b'{"kind": "shard", "shard": "model-000')
    convert(hf, out, progress=False)
    assert _files(out) == _files(ref)
    Container.open(out, verify=True)
    # a rerun on the finished container is a no-op
    convert(hf, out, progress=False)
    assert _files(out) == _files(ref)


# ---- bad input --------------------------------------------------------------------------------
@pytest.fixture()
def hf(tmp_path: Path) -> Path:
    return synth.write_hf_checkpoint("tiny-mixtral", tmp_path / "hf", 0, dtype="f32", shard_bytes=SHARD)


def _fails(capsys: pytest.CaptureFixture[str], src: Path, out: Path, *flags: str, match: str) -> None:
    rc = main(["convert", str(src), str(out), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0
    assert err and err[-1].startswith("moetier convert: error: "), err
    assert match in err[-1], err[-1]
    assert not (out / MANIFEST).exists()


def _shards(hf: Path) -> list[Path]:
    return sorted(hf.glob("model-*.safetensors"))


def test_refuses_pickle(tmp_path: Path, hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for p in [*_shards(hf), hf / "model.safetensors.index.json"]:
        p.unlink()
    (hf / "pytorch_model.bin").write_bytes(b"\x80\x04 not to be unpickled")
    _fails(capsys, hf, tmp_path / "out", match="pickle checkpoints are refused")
    _fails(capsys, hf / "pytorch_model.bin", tmp_path / "out", match="pickle checkpoints are refused")
    assert not (tmp_path / "out").exists()


def test_refuses_unknown_architecture(tmp_path: Path, hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "model_type": "llama"}))
    _fails(capsys, hf, tmp_path / "out", match="unknown architecture 'llama'")


def test_refuses_missing_shard(tmp_path: Path, hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = _shards(hf)[2]
    victim.unlink()
    _fails(capsys, hf, tmp_path / "out", match=f"shard {victim.name} listed in model.safetensors.index.json is missing")


def test_refuses_truncated_shard(tmp_path: Path, hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    victim = _shards(hf)[1]
    victim.write_bytes(victim.read_bytes()[:-100])
    _fails(capsys, hf, tmp_path / "out", match=f"shard {victim.name}")
    _fails(capsys, hf, tmp_path / "out", match="truncated")


def test_refuses_wrong_shape(tmp_path: Path, hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 48}))
    _fails(capsys, hf, tmp_path / "out", match="expected [48, 64] from config.json")


def test_refuses_missing_tensors(tmp_path: Path, hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    idx = json.loads((hf / "model.safetensors.index.json").read_text())
    victim_shard = _shards(hf)[-2]
    mf = MappedFile(victim_shard)
    keep = {n: np.array(mf.raw(n)) for n in mf.header.tensors}
    mf.close()
    dropped = sorted(keep)[0]
    del keep[dropped]
    del idx["weight_map"][dropped]
    w = SafetensorsWriter(victim_shard, [(n, "F32", a.shape) for n, a in keep.items()], {"format": "pt"})
    for n, a in keep.items():
        w.write(n, a)
    w.close()
    (hf / "model.safetensors.index.json").write_text(json.dumps(idx))
    _fails(capsys, hf, tmp_path / "out", match="checkpoint is missing tensors")


def test_refuses_foreign_output_dirs(tmp_path: Path, hf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["convert", str(hf), str(out)]) == 0
    before = (out / MANIFEST).read_bytes()
    rc = main(["convert", str(hf), str(out), "--experts", "int8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc != 0 and "holds a different conversion" in err[-1]
    assert (out / MANIFEST).read_bytes() == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    _fails(capsys, hf, other, match="not empty")
    # an unfinished conversion of another source is refused too
    unfinished = tmp_path / "unfinished"
    hook_err = None
    try:
        convert(hf, unfinished, on_progress=lambda n: (_ for _ in ()).throw(KeyboardInterrupt()), progress=False)
    except KeyboardInterrupt as e:
        hook_err = e
    assert hook_err is not None
    _fails(capsys, hf, unfinished, "--dense", "bf16", match="unfinished conversion of a different source or options")


def test_group_size_and_dtype_options(tmp_path: Path, hf: Path) -> None:
    c = Container.open(convert(hf, tmp_path / "c", ConvertOptions("int8", "f32", 32), progress=False))
    assert c.quantization == {"experts": "int8", "dense": "f32", "group_size": 32}
    assert c.read_expert(0, 1).gate.group_size == 32
    assert c.dense("embed").dtype == "f32"


def test_multimodal_qwen3_5_moe_serves_its_text_model(tmp_path: Path, synth_containers: dict[str, Container],
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """Qwen3.5-MoE's multimodal checkpoint form (Qwen3_5MoeForConditionalGeneration: text_config,
    model.language_model.*, a vision tower under model.visual.*) converts to the very container of
    its text-only form; the vision tensors are skipped and `moetier inspect` reports them."""
    from safetensors.numpy import load_file, save_file

    text = synth.write_hf_checkpoint("tiny-qwen3_5_moe", tmp_path / "text", 0, dtype="f32")
    mm = tmp_path / "mm"
    mm.mkdir()
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(str(text / "model.safetensors")).items()}
    vision = {"model.visual.patch_embed.proj.weight": np.ones((16, 3, 2, 2, 2), np.float32),
              "model.visual.blocks.0.attn.qkv.weight": np.ones((48, 16), np.float32)}
    save_file({**tensors, **vision}, str(mm / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((text / "config.json").read_text())
    (mm / "config.json").write_text(json.dumps({
        "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": cfg,
        "vision_config": {"depth": 1, "hidden_size": 16}, "image_token_id": 5, "tie_word_embeddings": False}))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (mm / name).write_bytes((text / name).read_bytes())
    c = Container.open(convert(mm, tmp_path / "c", progress=False), verify=True)
    ref = synth_containers["qwen3_5_moe"]
    assert c.index.identity == ref.index.identity
    for name in ref.dense_names():
        assert np.array_equal(c.dense(name).data, ref.dense(name).data), name
    assert c.manifest["source"]["skipped"] == {"vision": {"tensors": 2, "bytes": sum(v.nbytes for v in vision.values())}}
    capsys.readouterr()
    assert main(["inspect", str(c.path)]) == 0
    out = capsys.readouterr().out
    assert "skipped        vision: 2 source tensors" in out and "3 Gated DeltaNet layers of 4" in out


def test_tiktoken_tokenizer_is_converted(tmp_path: Path) -> None:
    """A source that ships only tiktoken.model (Kimi K2.5) gets a tokenizer.json in the container
    that encodes as tiktoken itself does, with Kimi's split pattern and its special tokens at
    their ids (the unnamed reserved ones as <|reserved_token_{id}|>)."""
    import base64

    tiktoken = pytest.importorskip("tiktoken")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from moetier.convert.tiktoken import KIMI_PATTERN, RESERVED_SPECIAL, _byte_chars
    from moetier.text.tokenizer import TextTokenizer

    corpus = ["Hello world, DON'T stop; they're here. HTTPServer", "中文字符测试，你好世界。", "def f(x):\n    return x * 2\n",
              "12345 3.14159", "Ünïcödé façade — “quotes”"] * 20
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    byte_of = {c: b for b, c in _byte_chars().items()}
    ranks = {bytes(byte_of[c] for c in tok): i for tok, i in bpe.get_vocab().items()}
    base = len(ranks)
    src = synth.write_hf_checkpoint("tiny-kimi_k25", tmp_path / "hf", 0, dtype="f32")
    (src / "tokenizer.json").unlink()
    (src / "tiktoken.model").write_text("".join(f"{base64.b64encode(t).decode()} {r}\n"
                                               for t, r in sorted(ranks.items(), key=lambda x: x[1])))
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    cfg["added_tokens_decoder"] = {str(base): {"content": "[BOS]", "special": True},
                                   str(base + 1): {"content": "<|im_end|>", "special": True}}
    (src / "tokenizer_config.json").write_text(json.dumps(cfg))
    c = Container.open(convert(src, tmp_path / "c", progress=False))
    assert "tiktoken.model" in c.manifest["source"]["tokenizer"]
    ours = Tokenizer.from_file(str(c.path / "tokenizer.json"))
    ref = tiktoken.Encoding("kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"[BOS]": base, "<|im_end|>": base + 1})
    for text in [*corpus[:5], "完全不同的句子 with mixed 中文 and English", "   spaces \n\n\n  x", "🙂 ÷ ∑ isOK XMLHttp"]:
        assert ours.encode(text).ids == ref.encode(text), text
        assert ours.decode(ours.encode(text).ids) == text
    assert ours.encode("[BOS]hi<|im_end|>").ids == ref.encode("[BOS]hi<|im_end|>", allowed_special="all")
    assert ours.get_vocab_size() == base + RESERVED_SPECIAL
    assert ours.id_to_token(base + 7) == f"<|reserved_token_{base + 7}|>"
    assert TextTokenizer.from_dir(c.path).encode("hello") == ref.encode("hello")


def test_refuses_packed_int4_kimi(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Kimi K2.5's own release packs its experts as compressed-tensors int4: refused by name, before
    any tensor is read (not a tensor-by-tensor 'unknown' failure half-way)."""
    src = synth.write_hf_checkpoint("tiny-kimi_k25", tmp_path / "hf", 0)
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"]["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}
    (src / "config.json").write_text(json.dumps(cfg))
    _fails(capsys, src, tmp_path / "out", match="compressed-tensors")
