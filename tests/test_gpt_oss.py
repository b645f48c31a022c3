"""gpt-oss beyond the oracle suites (tests/test_model_oracle.py, test_engine.py, test_convert.py):
its MXFP4 experts converted losslessly, served by the mxfp4 kernels equal to transformers, bf16
sources, and the sliding-window KV cache (what it keeps, chunked prefill, batching, rollback,
persistence)."""

from __future__ import annotations

import json
from pathlib import Path

import helpers_hf as hf
import numpy as np
import pytest
from safetensors.numpy import load_file

from moetier.cli import main
from moetier.convert.synth import write_container, write_hf_checkpoint
from moetier.engine import Engine
from moetier.kernels import FastOps
from moetier.model.experts import DictExperts
from moetier.model.forward import Model
from moetier.model.kv_cache import ROLLBACK, KVCache
from moetier.model.sampling import SamplingParams
from moetier.prefix_cache import PrefixCache
from moetier.weights.container import Container
from moetier.weights.quant import E2M1

FIXTURES = Path(__file__).parent / "fixtures" / "oracle"
LOGIT_RTOL = 1e-4


def fixture(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / f"{name}.npz", allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the MXFP4 source of the gpt_oss-mxfp4 fixture, its default conversion)."""
    root = tmp_path_factory.mktemp("gpt-oss")
    fx = fixture("gpt_oss-mxfp4")
    src = hf.make_checkpoint(str(fx["generator"]), str(fx["preset"]), root / "hf", int(fx["seed"]),
                             json.loads(str(fx["overrides"])))
    assert hf.checkpoint_checksum(src) == str(fx["checksum"])
    assert main(["convert", str(src), str(root / "c")]) == 0
    return src, root / "c"


def ocp_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 [R, G, 16] + e8m0 [R, G] -> float64 [R, 32 G], low nibble first, by ldexp."""
    lo, hi = blocks & 15, blocks >> 4
    codes = np.stack([lo, hi], axis=-1).reshape(blocks.shape[0], blocks.shape[1], 32)
    return np.ldexp(E2M1[codes].astype(np.float64), scales.astype(np.int64)[..., None] - 127).reshape(len(blocks), -1)


def test_mxfp4_source_converts_losslessly(mxfp4: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The container's experts are the source's bytes (gate rows 0::2, up rows 1::2 of gate_up),
    dequantize to exactly the source's values, and `moetier inspect` reports zero error."""
    src, dst = mxfp4
    c = Container.open(dst, verify=True)
    assert c.quantization["experts"] == "mxfp4" and c.layout.part("gate").dtype == "mxfp4"
    tensors = load_file(str(src / "model.safetensors"))
    checked = 0
    for li in c.args.moe_layer_ids:
        p = f"model.layers.{li}.mlp.experts."
        gu_b, gu_s = tensors[p + "gate_up_proj_blocks"], tensors[p + "gate_up_proj_scales"]
        dn_b, dn_s = tensors[p + "down_proj_blocks"], tensors[p + "down_proj_scales"]
        bias = tensors[p + "gate_up_proj_bias"]
        for e in range(c.args.n_routed_experts):
            ew = c.read_expert(li, e)
            for q, b, s in ((ew.gate, gu_b[e, 0::2], gu_s[e, 0::2]), (ew.up, gu_b[e, 1::2], gu_s[e, 1::2]),
                            (ew.down, dn_b[e], dn_s[e])):
                assert np.array_equal(q.data, b.reshape(len(b), -1)) and np.array_equal(q.scales, s)
                got = q.dequantize()
                assert np.array_equal(got.view(np.uint32), ocp_decode(b, s).astype(np.float32).view(np.uint32))
            assert ew.gate_bias is not None and np.array_equal(ew.gate_bias, bias[e, 0::2])
            checked += 1
    assert checked == len(c.args.moe_layer_ids) * c.args.n_routed_experts
    capsys.readouterr()
    assert main(["inspect", str(dst), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quant_error"]["experts"]["dtype"] == "mxfp4"
    assert report["quant_error"]["experts"]["rel_rms"] == 0.0 and report["quant_error"]["experts"]["tensors"] > 0
    assert any("sliding window 8" in m for m in report["mechanisms"])
    assert main(["inspect", str(dst)]) == 0
    assert "experts  mxfp4" in capsys.readouterr().out


@pytest.mark.skipif(not hf.hf_available(), reason="torch/transformers not installed (the [oracle] extra)")
def test_mxfp4_experts_are_transformers_decoding(mxfp4: tuple[Path, Path]) -> None:
    """transformers' own MXFP4 decoding of the source gives the container's dequantized values, bit for bit."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, dst = mxfp4
    c = Container.open(dst)
    tensors = load_file(str(src / "model.safetensors"))
    p = "model.layers.1.mlp.experts."
    gate_up = convert_moe_packed_tensors(torch.from_numpy(tensors[p + "gate_up_proj_blocks"]),
                                         torch.from_numpy(tensors[p + "gate_up_proj_scales"]),
                                         dtype=torch.float32).numpy()  # [E, D, 2I]
    for e in range(c.args.n_routed_experts):
        ew = c.read_expert(1, e)
        assert np.array_equal(ew.gate.dequantize().view(np.uint32), np.ascontiguousarray(gate_up[e][:, 0::2].T).view(np.uint32))
        assert np.array_equal(ew.up.dequantize().view(np.uint32), np.ascontiguousarray(gate_up[e][:, 1::2].T).view(np.uint32))


def test_mxfp4_container_matches_transformers(mxfp4: tuple[Path, Path], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The mxfp4 kernels serve the MXFP4 container: logits within 1e-4 of max |logit| of
    transformers on the same source, 32 greedy tokens identical (the experts are exact: only the
    dense int8 of the default conversion differs, so an f32-dense conversion is compared)."""
    src, _ = mxfp4
    fx = fixture("gpt_oss-mxfp4")
    dst = tmp_path / "c"
    assert main(["convert", str(src), str(dst), "--dense", "f32"]) == 0
    assert main(["logits", "--model", str(dst), "--ids", ",".join(map(str, fx["prompt"])),
                 "--out", str(tmp_path / "l.npy")]) == 0
    ours, ref = np.load(tmp_path / "l.npy"), fx["logits"]
    err, tol = float(np.abs(ours - ref).max()), LOGIT_RTOL * float(np.abs(ref).max())
    print(f"gpt_oss mxfp4: max |logit error| {err:.3e}, limit {tol:.3e}")
    assert err <= tol
    capsys.readouterr()
    assert main(["generate", "--model", str(dst), "--prompt-ids", ",".join(map(str, fx["prompt"])),
                 "--temperature", "0", "--max-tokens", "32", "--ignore-eos", "--show-ids"]) == 0
    assert [int(t) for t in capsys.readouterr().out.strip().split(",")] == fx["greedy"].tolist()


def test_bf16_source_converts_with_the_chosen_expert_dtype(tmp_path: Path) -> None:
    src = write_hf_checkpoint("tiny-gpt_oss", tmp_path / "hf", 3, dtype="bf16")
    for experts in (None, "mxfp4"):
        dst = tmp_path / f"c-{experts}"
        assert main(["convert", str(src), str(dst), *(["--experts", experts] if experts else [])]) == 0
        c = Container.open(dst, verify=True)
        assert c.quantization["experts"] == (experts or "int4")
        assert 0.05 < c.manifest["quant_error"]["experts"]["rel_rms"] < 0.25  # lossy, and measured


# ---------------------------------------------------------------- the sliding-window KV cache


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Model:
    c = Container.open(write_container("tiny-gpt_oss", tmp_path_factory.mktemp("gpt-oss-kv") / "c", 0))
    ops = FastOps("auto", threads=2)
    experts = {(li, e): c.read_expert(li, e) for li in c.args.moe_layer_ids for e in range(c.args.n_routed_experts)}
    return Model(c.args, {n: c.dense(n) for n in c.dense_names()}, ops, DictExperts(experts, ops))


def decode(model: Model, cache: KVCache, first: int, n: int) -> list[int]:
    out, tok = [], first
    for _ in range(n):
        tok = int(np.argmax(model.step([(cache, [tok])])[0]))
        out.append(tok)
    return out


def test_sliding_layers_keep_their_window_only(tiny: Model) -> None:
    a = tiny.args
    window = a.sliding_window
    keep = window + ROLLBACK
    prompt = np.random.default_rng(1).integers(2, 512, 90)
    cache = tiny.new_cache()
    tiny.step([(cache, prompt)])
    decode(tiny, cache, 5, 30)
    assert cache.length == 120
    sliding = [i for i in range(a.num_layers) if a.window(i)]
    assert sliding and len(sliding) < a.num_layers
    for i in range(a.num_layers):
        rows = len(cache.get(i, "k", cache.length))
        if i in sliding:
            assert keep <= rows < 2 * keep and cache.start(i) == cache.length - rows
        else:
            assert rows == cache.length and cache.start(i) == 0
    full = KVCache(cache.layout, a.num_layers)  # the same positions without windows
    per_position = 4 * full.width
    assert cache.nbytes == per_position * sum(cache.length - cache.start(i) for i in range(a.num_layers))
    assert cache.nbytes < per_position * cache.length * a.num_layers
    arrays = cache.to_arrays()
    assert all(arrays[f"layers.{i}.k"].shape[0] < cache.length for i in sliding)
    # a rollback within what is kept works; one past it is refused, naming the shortest length
    cache.truncate(cache.length - 3)
    with pytest.raises(ValueError, match="sliding-window"):
        cache.truncate(cache.min_length - 1)


def test_chunked_prefill_batching_and_resume_give_the_same_bits(tiny: Model) -> None:
    """Past the window: a prompt fed in chunks, alongside other sequences, or rebuilt from its
    persisted arrays (sliding layers: their last positions only) continues with the bits of one
    uninterrupted run."""
    rng = np.random.default_rng(2)
    prompt = rng.integers(2, 512, 70)
    whole = tiny.new_cache()
    want = tiny.step([(whole, prompt)])[0]
    chunked = tiny.new_cache()
    for s in range(0, 70, 9):
        other = tiny.new_cache()
        got = tiny.step([(other, rng.integers(2, 512, 3 + s % 5)), (chunked, prompt[s:s + 9])])[1]
    assert np.array_equal(got, want)
    assert chunked.start(0) > 0  # the window slid while the chunks went in
    cont = decode(tiny, whole, 7, 20)
    resumed = KVCache.from_arrays(tiny.args, chunked.to_arrays())
    assert decode(tiny, resumed, 7, 20) == cont
    # a prefix shorter than the window kept cannot be resumed from these arrays
    with pytest.raises(ValueError, match="cannot resume"):
        KVCache.from_arrays(tiny.args, chunked.to_arrays(), 20)


def test_prefix_cache_persists_windowed_kv(tiny: Model, tmp_path: Path) -> None:
    """The prefix cache keeps and persists what the sliding layers keep (its byte count is the
    cache's), a restarted cache resumes the sequence exactly, and a prefix the windows no longer
    reach is a miss, not wrong math."""
    prompt = np.random.default_rng(3).integers(2, 512, 60)
    kv = tiny.new_cache()
    tiny.step([(kv, prompt)])
    uninterrupted = decode(tiny, kv, 9, 12)
    seq = np.concatenate([prompt, [9], uninterrupted[:-1]]).astype(np.int64)
    assert np.array_equal(kv.tokens, seq)
    a = PrefixCache(tiny.args, "m", "kv", tmp_path, 1 << 24)
    assert a.insert(kv) == len(seq)
    assert a.stats().memory_bytes == kv.nbytes + 4 * len(seq)
    a.close()
    b = PrefixCache(tiny.args, "m", "kv", tmp_path, 1 << 24)
    got, n = b.lookup(np.concatenate([seq, [uninterrupted[-1], 4]]))
    assert got is not None and n == len(seq)
    assert decode(tiny, got, uninterrupted[-1], 5) == decode(tiny, kv, uninterrupted[-1], 5)
    miss, n = b.lookup(seq[:40])  # positions the sliding layers have dropped
    assert miss is None and n == 0
    b.close()


def test_engine_serves_past_the_window(tmp_path: Path) -> None:
    """`moetier generate`'s engine over a long prompt and continuation: the same tokens as the
    model stepped by hand, and the prefix cache reused."""
    model = write_container("tiny-gpt_oss", tmp_path / "c", 0)
    prompt = [int(t) for t in np.random.default_rng(4).integers(2, 500, 50)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with Engine.open(model, budget="100%") as e:
        first = [g.token for g in e.generate(prompt, params)]
    with Engine.open(model, budget="100%", prefix_cache=1 << 24) as e:
        assert [g.token for g in e.generate(prompt, params)] == first
        gen = e.generate([*prompt, *first], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        more = [g.token for g in gen]
        assert gen.cached_tokens > 0 and len(more) == 4
