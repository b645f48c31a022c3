"""Streaming, resumable Hugging Face -> container conversion (`moetier convert`).

One source shard is mapped at a time. Its dense tensors are quantized and written as one
dense file; its expert matrices are quantized and, when an expert's gate, up and down are
all known, packed into the expert's record, which has a fixed place in its layer file.
An expert split across shards leaves its finished parts in a spill directory (quantized,
so bounded by the quantized size of the split experts) until the rest arrives.

After each shard the expert files are fsynced and one JSON line is appended (and fsynced)
to the journal: the dense file, the records and their checksums, spilled and consumed
parts, the shard's checksum and its quantization-error sums. A rerun after any kill
replays the journal, skips finished shards and redoes the interrupted one; every byte
written depends only on the source and the options (fixed order, no timestamps), so the
final container is byte-identical to an uninterrupted run. moetier.json comes last.

Extra disk beyond the output: the spill (quantized parts) plus one dense file in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from moetier.convert import tiktoken
from moetier.convert.adapters import Dense, Expert, FusedExperts, UnknownTensor
from moetier.convert.adapters.gpt_oss import MXFP4_SCALES
from moetier.convert.qerror import Stats, experts_sample, measure, merge, summary
from moetier.convert.source import F32, SCALE_SUFFIX, HFSource, load_f32, widen
from moetier.errors import ConversionError, FormatError
from moetier.weights.format import MANIFEST, atomic_write, canonical_json, fsync_dir, xxh3_file, xxh3_hex
from moetier.weights.layout import bias_tensor, model_layout, pack_part_into
from moetier.weights.quant import ExpertWeights, QDType, QTensor, mxfp4_tensor, quantize
from moetier.weights.safetensors_io import MappedFile, TensorInfo
from moetier.weights.schema import (
    DENSE_ALLOWED,
    EXPERTS_ALLOWED,
    MTP_ALLOWED,
    dense_shapes,
    expert_shapes,
    mtp_shapes,
)
from moetier.weights.writer import ContainerWriter

log = logging.getLogger(__name__)

JOURNAL = "convert.journal"
SPILL = ".spill"


MTP_INT4_REFUSED = ("--mtp int4 is refused: an int4 MTP head drafts with 0-4% acceptance (measured by the seed's "
                    "users), so it costs speed and shows nothing else; use int8 (the default), bf16 or f32")


@dataclass(frozen=True)
class ConvertOptions:
    experts: QDType | None = None  # None: int4, or mxfp4 for a source whose experts are MXFP4 (kept as they are)
    dense: QDType = "int8"
    group_size: int = 64
    mtp: str = "int8"  # the MTP head's dtype, or "none" to leave it out

    def check(self) -> None:
        if self.experts is not None and self.experts not in EXPERTS_ALLOWED:
            raise ConversionError(f"--experts {self.experts}: choose one of {', '.join(EXPERTS_ALLOWED)}")
        if self.dense not in DENSE_ALLOWED:
            raise ConversionError(f"--dense {self.dense}: choose one of {', '.join(DENSE_ALLOWED)}")
        if self.group_size <= 0 or self.group_size % 2:
            raise ConversionError(f"--group-size {self.group_size}: must be a positive even number")
        if self.mtp == "int4":
            raise ConversionError(MTP_INT4_REFUSED)
        if self.mtp != "none" and self.mtp not in MTP_ALLOWED:
            raise ConversionError(f"--mtp {self.mtp}: choose one of {', '.join(MTP_ALLOWED)} or none")

    @property
    def mtp_dtype(self) -> QDType:
        return "int8" if self.mtp == "none" else self.mtp  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"experts": self.experts, "dense": self.dense, "group_size": self.group_size}
        if self.mtp != "int8":  # the default leaves the identity of conversions without MTP unchanged
            d["mtp"] = self.mtp
        return d


PartKey = tuple[int, int, str]  # (layer, expert, part)


class _Journal:
    def __init__(self, path: Path) -> None:
        self.path = path

    def read(self) -> list[dict[str, Any]]:
        """Complete lines only: a line torn by a kill is dropped (its shard is redone)."""
        if not self.path.exists():
            return []
        entries = []
        for line in self.path.read_bytes().split(b"\n"):
            if not line:
                continue
            try:
                entries.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError):
                break
        return entries

    def rewrite(self, entries: list[dict[str, Any]]) -> None:
        """Drop a torn tail before appending more."""
        data = b"".join(canonical_json(e) + b"\n" for e in entries)
        if not self.path.exists() or self.path.read_bytes() != data:
            atomic_write(self.path, data)

    def append(self, entry: dict[str, Any]) -> None:
        with open(self.path, "ab") as f:
            f.write(canonical_json(entry) + b"\n")
            f.flush()
            os.fsync(f.fileno())


class Converter:
    def __init__(self, src: Path, out: Path, opts: ConvertOptions,
                 on_progress: Callable[[int], None] | None = None, progress: bool | None = None) -> None:
        opts.check()
        self.source = HFSource.open(src)
        self.args = self.source.args
        if opts.experts is None:  # an MXFP4 source keeps its experts as they are; any other: int4
            mx = any(n.endswith("_blocks") for sh in self.source.shards for n in sh.header.tensors)
            opts = dataclasses.replace(opts, experts="mxfp4" if mx else "int4")
        self.out = out
        self.opts = opts
        self.on_progress = on_progress
        self.progress = progress
        self.identity = xxh3_hex(canonical_json({"source": self.source.identity(), "options": opts.to_dict()}))
        self.n_mtp = 0 if opts.mtp == "none" else self._mtp_present()
        self.dense_want = dense_shapes(self.args)
        self.mtp_want = mtp_shapes(self.args, self.n_mtp)
        self.expert_want = expert_shapes(self.args)
        self.sample = set(experts_sample(self.args.n_routed_experts))
        self.spill_dir = out / SPILL
        self.journal = _Journal(out / JOURNAL)

    def _mtp_present(self) -> int:
        """MTP layers to convert: those the config announces whose tensors the checkpoint holds
        (a checkpoint stripped of its MTP layers converts to a container without a head)."""
        announced = self.source.adapter.mtp_layers(self.source.config)
        names = {n for s in self.source.shards for n in s.header.tensors}
        n = 0
        while n < announced and any(k.startswith(f"model.layers.{self.args.num_layers + n}.") for k in names):
            n += 1
        if n < announced:
            log.info("config.json announces %d MTP layers; the checkpoint holds %d: the container gets %d",
                     announced, n, n)
        return n

    @property
    def experts(self) -> QDType:
        """The routed experts' dtype (the option, resolved for this source in __init__)."""
        assert self.opts.experts is not None
        return self.opts.experts

    def _part_names(self, layer: int) -> tuple[str, ...]:
        g = self.opts.group_size
        dtype = self.opts.mtp_dtype if self._mtp_layer(layer) else self.experts
        return model_layout(self.args, dtype, g).part_names

    def _mtp_layer(self, layer: int) -> bool:
        return self.args.num_layers <= layer < self.args.num_layers + self.n_mtp

    # ---- output directory state ----------------------------------------------------------------
    def _prepare(self) -> list[dict[str, Any]] | None:
        """Journal entries to resume from; None when OUT already holds this conversion."""
        out = self.out
        if (out / MANIFEST).exists():
            try:
                m = json.loads((out / MANIFEST).read_bytes())
                same = m["source"].get("identity") == self.identity
            except (json.JSONDecodeError, KeyError, AttributeError, TypeError):
                same = False
            if not same:
                raise ConversionError(f"{out} holds a different conversion (other source or options); "
                                      "choose another output directory or remove it")
            return None
        entries = self.journal.read()
        if entries:
            head = entries[0]
            if head.get("kind") != "start" or head.get("identity") != self.identity:
                raise ConversionError(f"{out} holds an unfinished conversion of a different source or options; "
                                      "choose another output directory or remove it")
            self.journal.rewrite(entries)
            return entries[1:]
        if out.exists() and any(p.name not in (JOURNAL, JOURNAL + ".tmp") for p in out.iterdir()):
            raise ConversionError(f"{out} is not empty and holds no moetier conversion; refusing to write into it")
        out.mkdir(parents=True, exist_ok=True)
        self.journal.rewrite([{"kind": "start", "identity": self.identity, "options": self.opts.to_dict(),
                               "source": self.source.identity()}])
        fsync_dir(out)
        return []

    # ---- main loop ----------------------------------------------------------------------------
    def run(self) -> Path:
        done = self._prepare()
        if done is None:
            log.info("%s already holds this conversion", self.out)
            self._cleanup()
            return self.out
        w = ContainerWriter(self.out, self.args, self.experts, self.opts.dense, self.opts.group_size,
                            mtp_layers=self.n_mtp, mtp_dtype=self.opts.mtp_dtype,
                            mtp_hidden_first=self.source.adapter.mtp_hidden_first(self.source.config))
        seen_dense: set[str] = set()
        seen_parts: set[PartKey] = set()
        spilled: set[PartKey] = set()
        stats: Stats = {}
        files: dict[str, dict[str, Any]] = {}
        n_dense_files = n_mtp_files = 0
        done_shards = set()
        for ent in done:
            done_shards.add(ent["shard"])
            if ent["dense"]:
                n_dense_files += 1
                w.note_dense_file(n_dense_files, ent["dense"])
                seen_dense.update(ent["dense"])
            if ent.get("mtp_dense"):
                n_mtp_files += 1
                w.note_dense_file(n_mtp_files, ent["mtp_dense"], mtp=True)
                seen_dense.update(ent["mtp_dense"])
            for li, e, ck in ent["records"]:
                w.note_record(li, e, ck)
                seen_parts.update((li, e, p) for p in w.layout_for(li).part_names)
            for key in ent["spilled"]:
                spilled.add((key[0], key[1], key[2]))
                seen_parts.add((key[0], key[1], key[2]))
            for key in ent["consumed"]:
                spilled.discard((key[0], key[1], key[2]))
            merge(stats, ent["errors"])
            files[ent["shard"]] = {"size": ent["size"], "xxh3_64": ent["xxh3_64"]}
        total = sum(s.size for s in self.source.shards)
        done_bytes = sum(s.size for s in self.source.shards if s.name in done_shards)
        bar = tqdm(total=total, initial=done_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                   desc="convert", disable=None if self.progress is None else not self.progress)
        self._bytes = done_bytes
        try:
            for shard in self.source.shards:
                if shard.name in done_shards:
                    continue
                ent = self._shard(shard, w, (n_dense_files + 1, n_mtp_files + 1), seen_dense, seen_parts, spilled,
                                  bar)
                if ent["dense"]:
                    n_dense_files += 1
                if ent.get("mtp_dense"):
                    n_mtp_files += 1
                self.journal.append(ent)
                spilled.update((key[0], key[1], key[2]) for key in ent["spilled"])
                for key in ent["consumed"]:
                    spilled.discard((key[0], key[1], key[2]))
                    (self.spill_dir / _spill_name(key[0], key[1], key[2])).unlink(missing_ok=True)
                merge(stats, ent["errors"])
                files[shard.name] = {"size": ent["size"], "xxh3_64": ent["xxh3_64"]}
            self._check_complete(seen_dense, seen_parts)
        except BaseException:
            w.abort()
            raise
        finally:
            bar.close()
        src_files = {"config.json": {"size": len(self.source.config_bytes),
                                     "xxh3_64": xxh3_hex(self.source.config_bytes)}}
        index = self.source.root / "model.safetensors.index.json"
        if index.is_file():
            src_files[index.name] = {"size": index.stat().st_size, "xxh3_64": xxh3_file(index)}
        src_files.update(files)
        source = {"kind": "hf", "model_type": self.args.arch, "identity": self.identity,
                  "files": dict(sorted(src_files.items()))}
        skipped = self._skipped()
        if skipped:
            source["skipped"] = skipped
        copies: dict[str, bytes | Path] = dict(self.source.extra_files())
        converted = tiktoken.tokenizer_json(self.source.root)  # a tiktoken.model-only source (Kimi)
        if converted is not None:
            copies["tokenizer.json"] = converted
            source["tokenizer"] = "tokenizer.json converted from tiktoken.model (moetier/convert/tiktoken.py)"
        mtp_stats = {"mtp": stats.pop("mtp")} if "mtp" in stats else {}
        mtp_error = (summary(mtp_stats, {"mtp": self.opts.mtp_dtype, "group_size": self.opts.group_size})["mtp"]
                     if mtp_stats else None)
        w.finish(source, copies, summary(stats, w.quantization), mtp_error)
        self._cleanup()
        return self.out

    def _skipped(self) -> dict[str, dict[str, int]]:
        """Tensors of a wrapper checkpoint the served model leaves out (a vision tower), by why:
        {reason: {"tensors": n, "bytes": b}}, for `moetier inspect`."""
        out: dict[str, dict[str, int]] = {}
        for shard in self.source.shards:
            for info in shard.header.tensors.values():
                why = self.source.adapter.skipped(info.name)
                if why is not None:
                    row = out.setdefault(why, {"tensors": 0, "bytes": 0})
                    row["tensors"] += 1
                    row["bytes"] += info.nbytes
        return dict(sorted(out.items()))

    def _cleanup(self) -> None:
        shutil.rmtree(self.spill_dir, ignore_errors=True)
        (self.out / JOURNAL).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            (self.out / (JOURNAL + ".tmp")).unlink()

    def _advance(self, n: int, bar: tqdm) -> None:
        self._bytes += n
        bar.update(n)
        if self.on_progress is not None:
            self.on_progress(self._bytes)

    # ---- one shard ----------------------------------------------------------------------------
    def _shard(self, shard: Any, w: ContainerWriter, dense_k: tuple[int, int], seen_dense: set[str],
               seen_parts: set[PartKey], spilled: set[PartKey], bar: tqdm) -> dict[str, Any]:
        mf = MappedFile(shard.path, f"shard {shard.name}")
        ad, args, opts = self.source.adapter, self.args, self.opts
        dense_q: dict[str, QTensor] = {}
        mtp_q: dict[str, QTensor] = {}
        parts: dict[tuple[int, int], dict[str, QTensor]] = {}
        records: list[list[Any]] = []
        consumed: list[list[Any]] = []
        stats: Stats = {}
        try:
            for info in sorted(mf.header.tensors.values(), key=lambda t: t.begin):
                name = info.name
                if name.endswith(SCALE_SUFFIX) or (name.endswith(MXFP4_SCALES) and isinstance(
                        ad.target(name.removesuffix(MXFP4_SCALES) + "_blocks", args, self.n_mtp), FusedExperts)):
                    self._advance(info.nbytes, bar)
                    continue  # FP8 block scales and MXFP4 scales are read with their weight
                try:
                    target = ad.target(name, args, self.n_mtp)
                except UnknownTensor as exc:
                    raise ConversionError(f"{exc} (in shard {shard.name})") from exc
                where = f"tensor {name!r} in {shard.name}"
                if target is None or (isinstance(target, Dense) and target.name == "lm_head"
                                      and args.tie_word_embeddings):
                    self._advance(info.nbytes, bar)
                    continue
                if isinstance(target, Dense):
                    mtp = target.name.startswith("mtp.")
                    wants, specs, out, kind, whole = (
                        (self.mtp_want, w.mtp_specs, mtp_q, "mtp", "MTP head") if mtp
                        else (self.dense_want, w.dense_specs, dense_q, "dense", "model shape"))
                    want = wants.get(target.name)
                    if want is None and not mtp and 0 in info.shape:
                        # an empty tensor the shape does not use (transformers builds a zero-width
                        # shared expert for n_shared_experts = 0): nothing to convert
                        self._advance(info.nbytes, bar)
                        continue
                    try:  # the adapter's load-time fixes (a fused tensor split, a reshape): shapes checked per part
                        fixed = ad.fix(target.name, load_f32(mf, info, shard.name), args)
                    except ValueError as exc:
                        raise ConversionError(f"{where} has shape {info.shape}, which {target.name} cannot have "
                                              f"({exc})") from exc
                    for cname, x in fixed:
                        want = wants.get(cname)
                        if want is None:
                            raise ConversionError(f"{where} ({cname}) is not part of this {args.arch} {whole}")
                        _check_shape(where, x.shape, want)
                        if cname in seen_dense:
                            raise ConversionError(f"{where}: {cname} appears twice in the checkpoint")
                        seen_dense.add(cname)
                        spec = specs[cname]
                        q = quantize(x, spec.dtype, opts.group_size)
                        out[cname] = q
                        if spec.dtype != "f32":
                            measure(stats, kind, x, q, opts.group_size)
                else:
                    for li, e, part, xe in self._expert_parts(target, info, mf, shard.name, where):
                        key = (li, e, part)
                        if key in seen_parts:
                            raise ConversionError(f"{where}: layer {li} expert {e} {part} appears twice")
                        seen_parts.add(key)
                        mtp = self._mtp_layer(li)
                        dtype = opts.mtp_dtype if mtp else self.experts
                        if part.endswith("_bias"):  # float32, as the record layout keeps it
                            have = parts.setdefault((li, e), {})
                            have[part] = bias_tensor(np.asarray(xe, dtype=np.float32))
                            self._maybe_record(w, li, e, have, spilled, records, consumed)
                            continue
                        if isinstance(xe, QTensor) and xe.dtype == dtype:
                            q = xe  # an MXFP4 source stored as mxfp4: its bytes, nothing decoded or rounded
                        else:
                            q = quantize(xe.dequantize() if isinstance(xe, QTensor) else xe, dtype, opts.group_size)
                        if e in self.sample:  # the error against the source's values (0 for q = the source)
                            src = xe.dequantize() if isinstance(xe, QTensor) else xe
                            measure(stats, "mtp" if mtp else "experts", src, q, opts.group_size)
                        have = parts.setdefault((li, e), {})
                        have[part] = q
                        self._maybe_record(w, li, e, have, spilled, records, consumed)
                self._advance(info.nbytes, bar)
            # parts still waiting for the rest of their expert: spill them (quantized)
            spill: list[list[Any]] = []
            for (li, e), have in sorted(parts.items()):
                for part, q in sorted(have.items()):
                    self._spill(li, e, part, q, w)
                    spill.append([li, e, part])
            dense_names = sorted(dense_q)
            if dense_names:
                f = w.dense_file(dense_k[0], dense_names)
                for n in dense_names:
                    f.add(n, dense_q[n])
                f.close()
            mtp_names = sorted(mtp_q)
            if mtp_names:
                f = w.mtp_dense_file(dense_k[1], mtp_names)
                for n in mtp_names:
                    f.add(n, mtp_q[n])
                f.close()
            w.sync()
            if spill:
                fsync_dir(self.spill_dir)
        finally:
            mf.close()
        ent = {"kind": "shard", "shard": shard.name, "size": shard.size, "xxh3_64": xxh3_file(shard.path),
               "dense": dense_names, "records": sorted(records), "spilled": spill, "consumed": sorted(consumed),
               "errors": stats}
        if mtp_names:
            ent["mtp_dense"] = mtp_names
        return ent

    def _expert_parts(self, target: Expert | FusedExperts, info: TensorInfo, mf: MappedFile, shard: str,
                      where: str) -> Iterator[tuple[int, int, str, F32 | QTensor]]:
        """(layer, expert, part, float32 matrix or an MXFP4 source's own QTensor), one expert at a
        time (a fused tensor is widened slice by slice, never whole)."""
        args = self.args
        if not self._mtp_layer(target.layer) and (target.layer >= args.num_layers
                                                  or not args.moe_layers[target.layer]):
            raise ConversionError(f"{where}: layer {target.layer} is not a MoE layer of this {args.arch} model")
        e_count, inter, d = args.n_routed_experts, args.moe_intermediate_size, args.hidden_size
        if isinstance(target, Expert):
            if not 0 <= target.expert < e_count:
                raise ConversionError(f"{where}: expert {target.expert} out of range ({e_count} experts)")
            _check_shape(where, info.shape, self.expert_want[target.part])
            yield target.layer, target.expert, target.part, load_f32(mf, info, shard)
            return
        if target.layout == "gpt_oss":
            yield from _gpt_oss_parts(target, info, mf, shard, where, (e_count, inter, d))
            return
        raw = mf.raw(info.name)
        if target.part == "gate_up":
            _check_shape(where, info.shape, (e_count, 2 * inter, d))
            for e in range(e_count):
                yield target.layer, e, "gate", widen(raw[e, :inter], info.dtype, info.name, shard)
                yield target.layer, e, "up", widen(raw[e, inter:], info.dtype, info.name, shard)
            return
        _check_shape(where, info.shape, (e_count, d, inter))
        for e in range(e_count):
            yield target.layer, e, "down", widen(raw[e], info.dtype, info.name, shard)

    def _maybe_record(self, w: ContainerWriter, li: int, e: int, have: dict[str, QTensor],
                      spilled: set[PartKey], records: list[list[Any]], consumed: list[list[Any]]) -> None:
        """Write the record once all its parts are known (this shard's or spilled earlier)."""
        layout = w.layout_for(li)
        names = layout.part_names
        from_spill = [p for p in names if p not in have and (li, e, p) in spilled]
        if len(have) + len(from_spill) < len(names):
            return
        full = dict(have)
        for part in from_spill:
            full[part] = self._unspill(li, e, part, w)
            consumed.append([li, e, part])
        biases = {p: full[p].data.reshape(-1) for p in names if p.endswith("_bias")}
        ck = w.write_record(li, e, ExpertWeights(gate=full["gate"], up=full["up"], down=full["down"],
                                                 act=layout.act, **biases))
        records.append([li, e, ck])
        have.clear()  # done: nothing of this expert is left to spill

    def _spill(self, li: int, e: int, part: str, q: QTensor, w: ContainerWriter) -> None:
        p = w.layout_for(li).part(part)
        buf = bytearray(p.end - p.data_offset)
        pack_part_into(p, q, buf, -p.data_offset)
        self.spill_dir.mkdir(exist_ok=True)
        atomic_write(self.spill_dir / _spill_name(li, e, part), bytes(buf))

    def _unspill(self, li: int, e: int, part: str, w: ContainerWriter) -> QTensor:
        p = w.layout_for(li).part(part)
        path = self.spill_dir / _spill_name(li, e, part)
        try:
            raw = np.frombuffer(path.read_bytes(), dtype=np.uint8)
        except FileNotFoundError:
            raise FormatError(f"{path}: spilled part of layer {li} expert {e} is missing; "
                              "remove the output directory and convert again") from None
        if raw.nbytes != p.end - p.data_offset:
            raise FormatError(f"{path}: spilled part has {raw.nbytes} bytes, expected {p.end - p.data_offset}")
        return p.view(raw, -p.data_offset)

    def _check_complete(self, seen_dense: set[str], seen_parts: set[PartKey]) -> None:
        args = self.args
        want = [n for n in [*self.dense_want, *self.mtp_want] if n not in seen_dense]
        mtp_layers = list(range(args.num_layers, args.num_layers + self.n_mtp))
        want += [f"layer {li} expert {e} {p}" for li in args.moe_layer_ids + mtp_layers
                 for e in range(args.n_routed_experts) for p in self._part_names(li)
                 if (li, e, p) not in seen_parts]
        if want:
            more = f" (+{len(want) - 5} more)" if len(want) > 5 else ""
            raise ConversionError(f"checkpoint is missing tensors: {', '.join(want[:5])}{more}")


def _gpt_oss_parts(target: FusedExperts, info: TensorInfo, mf: MappedFile, shard: str, where: str,
                   shape: tuple[int, int, int]) -> Iterator[tuple[int, int, str, F32 | QTensor]]:
    """gpt-oss's fused experts (adapters/gpt_oss.py): gate and up interleaved (rows 0::2 and
    1::2 of the outputs), dense matrices transposed, or MXFP4 blocks with their scales (the
    `_scales` tensor from the same shard) kept as mxfp4 QTensors; the biases as vectors."""
    e_count, inter, d = shape
    li = target.layer
    raw = mf.raw(info.name)
    if target.part in ("gate_up_bias", "down_bias"):
        n = 2 * inter if target.part == "gate_up_bias" else d
        _check_shape(where, info.shape, (e_count, n))
        for e in range(e_count):
            b = widen(raw[e], info.dtype, info.name, shard)
            if target.part == "down_bias":
                yield li, e, "down_bias", b
            else:
                yield li, e, "gate_bias", np.ascontiguousarray(b[0::2])
                yield li, e, "up_bias", np.ascontiguousarray(b[1::2])
        return
    rows, cols = (2 * inter, d) if target.part == "gate_up" else (d, inter)
    if info.name.endswith("_blocks"):
        sname = info.name.removesuffix("_blocks") + MXFP4_SCALES
        if sname not in mf.header.tensors:
            raise ConversionError(f"{where}: MXFP4 blocks without their {sname!r} in the same shard")
        g = -(-cols // 32)
        _check_shape(where, info.shape, (e_count, rows, g, 16))
        sinfo = mf.header.tensors[sname]
        _check_shape(f"tensor {sname!r} in {shard}", sinfo.shape, (e_count, rows, g))
        if info.dtype != "U8" or sinfo.dtype != "U8":
            raise ConversionError(f"{where}: MXFP4 blocks and scales must be U8, got {info.dtype} and {sinfo.dtype}")
        scales = mf.raw(sname)
        for e in range(e_count):
            if (np.asarray(scales[e]) == 255).any():
                raise ConversionError(f"{where}: expert {e} has an e8m0 scale of 255 (NaN in MXFP4)")
            if target.part == "down":
                yield li, e, "down", mxfp4_tensor(np.asarray(raw[e]), np.asarray(scales[e]), cols)
            else:
                yield li, e, "gate", mxfp4_tensor(np.asarray(raw[e, 0::2]), np.asarray(scales[e, 0::2]), cols)
                yield li, e, "up", mxfp4_tensor(np.asarray(raw[e, 1::2]), np.asarray(scales[e, 1::2]), cols)
        return
    _check_shape(where, info.shape, (e_count, cols, rows))  # transposed: inputs first
    for e in range(e_count):
        m = widen(raw[e], info.dtype, info.name, shard)  # [C, R]
        if target.part == "down":
            yield li, e, "down", np.ascontiguousarray(m.T)
        else:
            yield li, e, "gate", np.ascontiguousarray(m[:, 0::2].T)
            yield li, e, "up", np.ascontiguousarray(m[:, 1::2].T)


def _spill_name(li: int, e: int, part: str) -> str:
    return f"layer-{li:03d}-expert-{e:05d}-{part}.bin"


def _check_shape(where: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if tuple(got) != tuple(want):
        raise ConversionError(f"{where} has shape {list(got)}, expected {list(want)} from config.json")


def convert(src: Path, out: Path, opts: ConvertOptions | None = None, *,
            on_progress: Callable[[int], None] | None = None, progress: bool | None = None) -> Path:
    """Convert the HF checkpoint at `src` into a container at `out` (resuming if interrupted).

    `on_progress(bytes_done)` is called after each source tensor; `progress` forces the
    progress bar on or off (default: on when stderr is a terminal).
    """
    return Converter(src, out, opts or ConvertOptions(), on_progress, progress).run()
