"""`moetier bench io`: expert records read cold through the store's I/O engine, beside fio.

The store side is the production path: `IOEngine` (O_DIRECT preadv from `depth`
worker threads into pooled aligned buffers, xxh3_64 verification of every record),
fed `depth` x 2 requests at a time so the disk always has `depth` reads in flight.
The peer is fio doing random reads of the same block size (the record size) at the
same queue depth on the same files (randread, direct=1, libaio iodepth=N, or psync
numjobs=N), i.e. what the disk gives a C program. Reads are cold: O_DIRECT bypasses
the page cache; if the filesystem refuses O_DIRECT the page cache is dropped (root)
before each store pass. Disks drift over minutes, so the two alternate within one
run (ABBA order); `ratio` is the median over rounds of store GB/s / fio GB/s (each
round's two passes are adjacent in time), the ratio of the totals is printed beside it.

The records are the benchmark model's (mini-glm, built once under data_dir/models/; see
moetier.bench.models) unless --model names another container, or --synthetic / --dir ask
for a synthetic set of random bytes written to a scratch directory (deleted afterwards
unless --dir is given, which also reuses it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, wait
from pathlib import Path
from typing import Any

from moetier.bench import models
from moetier.errors import InvalidArgument
from moetier.store.buffers import Buffer, Holder
from moetier.store.io import IOEngine
from moetier.store.synth import write_records
from moetier.weights.container import Container
from moetier.weights.index import ExpertIndex, ExpertKey

log = logging.getLogger(__name__)
TARGET = 0.85


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "io", help="cold expert record reads (store I/O engine) beside fio, same block size and depth")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", help="container (or record set) directory whose expert files are read "
                                   f"(default: the benchmark model, {models.BENCHMARK_PRESET})")
    p.add_argument("--config", type=Path, help="YAML config file (data_dir: where the benchmark model lives)")
    p.add_argument("--synthetic", action="store_true", help="read a synthetic record set instead of a model")
    p.add_argument("--depth", type=int, default=8, help="queue depth: reads in flight (default 8)")
    p.add_argument("--records", type=int, default=128, help="records read per pass (default 128)")
    p.add_argument("--rounds", type=int, default=10, help="store/fio pass pairs, alternating order (default 10)")
    p.add_argument("--record-bytes", type=int, default=4 << 20,
                   help="synthetic record size (default 4 MiB)")
    p.add_argument("--set-records", type=int, default=256,
                   help="records in the synthetic set (default 256 = 1 GiB of 4 MiB records)")
    p.add_argument("--dir", help="where the synthetic set lives (implies --synthetic; kept and reused; "
                                 "default: a temporary directory, deleted afterwards)")
    p.add_argument("--fio-engine", default="libaio", choices=["libaio", "psync"],
                   help="fio ioengine: libaio with iodepth N, or psync with N jobs (default libaio)")
    p.set_defaults(func=run)


def find_fio(bench: str, why: str) -> str | None:
    """fio's path; where it is missing, says so on stderr (naming `bench` and `why` it needs fio)."""
    fio = shutil.which("fio")
    if fio is None:
        print(f"moetier bench {bench}: fio is not installed; {why}.\n"
              "  Debian/Ubuntu: sudo apt-get install -y fio    Fedora: sudo dnf install fio", file=sys.stderr)
    return fio


def run(args: argparse.Namespace) -> int:
    fio = find_fio("io", "it is the peer this benchmark measures against")
    if fio is None:
        return 2
    if args.depth < 1 or args.records < 1 or args.rounds < 1:
        raise InvalidArgument("--depth, --records and --rounds must be >= 1")
    scratch: Path | None = None
    try:
        if args.model and (args.synthetic or args.dir):
            raise InvalidArgument("--model reads a container's records; --synthetic and --dir a synthetic set")
        if not (args.synthetic or args.dir):
            model = models.resolve_model(args) if not args.model else Path(args.model)
            with Container.open(model) as c:
                index = c.index
            source = f"container {model}"
        else:
            base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="moetier-bench-io-"))
            scratch = None if args.dir else base
            index = _synthetic(base, args.set_records, args.record_bytes)
            source = f"synthetic set in {base}"
        result = measure(index, fio, args.depth, args.records, args.rounds, args.fio_engine)
        result["source"] = source
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0


def _synthetic(base: Path, n: int, record_bytes: int) -> ExpertIndex:
    per_file = 32
    layers = list(range(1, -(-n // per_file) + 1))
    try:
        idx = ExpertIndex.load(base)
        if len(idx.records) == len(layers) * per_file and idx.record_bytes == record_bytes:
            return idx
    except Exception:
        pass
    log.info("writing %d synthetic records of %d bytes to %s", len(layers) * per_file, record_bytes, base)
    return write_records(base, layers, per_file, record_bytes)


def measure(index: ExpertIndex, fio: str, depth: int, records: int, rounds: int,
            fio_engine: str = "libaio") -> dict[str, Any]:
    lengths = {loc.length for loc in index.records.values()}
    if len(lengths) != 1:
        raise InvalidArgument("records of different sizes: fio needs one block size")
    bs = lengths.pop()
    files = [index.root / f for f in index.files]
    keys = list(index.records)
    rng = random.Random(0)
    rows = []
    with IOEngine(index, depth=depth, direct=True) as engine:
        direct = engine.direct
        if not direct and os.geteuid() != 0:
            log.warning("buffered reads and not root: the page cache cannot be dropped, store reads are not cold")
        _store_pass(engine, rng.sample(keys, min(len(keys), depth)), depth, direct)  # warm-up, untimed
        _fio_pass(fio, files, bs, depth, depth, fio_engine)
        for r in range(rounds):
            sample = [rng.choice(keys) for _ in range(records)]
            order = ("store", "fio") if r % 2 == 0 else ("fio", "store")
            row: dict[str, float] = {}
            for which in order:
                if which == "store":
                    row["store_bytes"], row["store_s"] = _store_pass(engine, sample, depth, direct)
                else:
                    row["fio_bytes"], row["fio_s"] = _fio_pass(fio, files, bs, depth, records, fio_engine)
            row["store_gbps"] = row["store_bytes"] / row["store_s"] / 1e9
            row["fio_gbps"] = row["fio_bytes"] / row["fio_s"] / 1e9
            rows.append(row)
        st = engine.stats()
    store = sum(r["store_bytes"] for r in rows) / sum(r["store_s"] for r in rows) / 1e9
    peer = sum(r["fio_bytes"] for r in rows) / sum(r["fio_s"] for r in rows) / 1e9
    paired = statistics.median(r["store_gbps"] / r["fio_gbps"] for r in rows)
    return {
        "name": "io", "record_bytes": bs, "depth": depth, "records": records, "rounds": rows,
        "direct": direct, "files": len(files), "file_bytes": sum(f.stat().st_size for f in files),
        "store_gbps": store, "fio_gbps": peer, "ratio": paired, "ratio_of_totals": store / peer if peer else 0.0,
        "target": TARGET,
        "fio_ioengine": fio_engine, "checksum_failures": st.checksum_failures,
        "p50_read_s": st.disks[0].latency.quantile(0.5), "p99_read_s": st.disks[0].latency.quantile(0.99),
    }


def _drop_page_cache() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        log.warning("could not drop the page cache (%s): buffered store reads may be warm", e)


def _store_pass(engine: IOEngine, keys: list[ExpertKey], depth: int, direct: bool) -> tuple[int, float]:
    """Read `keys` through the engine, `2 * depth` requests outstanding; (bytes, seconds)."""
    if not direct:
        _drop_page_cache()
    todo = list(reversed(keys))
    pending: set[Future[Buffer]] = set()
    nbytes = 0
    t0 = time.perf_counter()
    while todo or pending:
        while todo and len(pending) < 2 * depth:
            k = todo.pop()
            nbytes += engine.index.records[k].length
            pending.add(engine.submit(k))
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        while done:
            f = done.pop()
            box = Holder(f.result())
            del f  # the future holds the buffer too
            engine.reclaim(box)  # recycled like the tier recycles evicted records
    return nbytes, time.perf_counter() - t0


def _fio_pass(fio: str, files: list[Path], bs: int, depth: int, records: int, engine: str) -> tuple[int, float]:
    names = ":".join(str(f).replace(":", "\\:") for f in files)
    jobs = 1 if engine == "libaio" else depth
    cmd = [fio, "--name=moetier-io", f"--filename={names}", "--rw=randread", f"--bs={bs}", "--direct=1",
           f"--ioengine={engine}", f"--iodepth={depth if engine == 'libaio' else 1}", f"--numjobs={jobs}",
           f"--io_size={max(1, records // jobs) * bs}", "--file_service_type=random", "--randrepeat=0",
           "--group_reporting", "--output-format=json"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        raise InvalidArgument(f"fio failed ({' '.join(cmd)}): {p.stderr.strip() or p.stdout.strip()}")
    out = json.loads(p.stdout[p.stdout.index("{"):])
    read = out["jobs"][0]["read"]
    return int(read["io_bytes"]), float(read["runtime"]) / 1e3


def _print(r: dict[str, Any]) -> None:
    mib = r["record_bytes"] / (1 << 20)
    print(f"moetier bench io: {mib:g} MiB records, depth {r['depth']}, {r['records']} random records per pass, "
          f"{'O_DIRECT' if r['direct'] else 'buffered, page cache dropped'}; {r['files']} files, "
          f"{r['file_bytes'] / 1e9:.2f} GB ({r['source']})")
    print(f"{'round':>5}  {'store GB/s':>10}  {'fio GB/s':>9}  {'ratio':>6}")
    for i, row in enumerate(r["rounds"], 1):
        print(f"{i:>5}  {row['store_gbps']:>10.3f}  {row['fio_gbps']:>9.3f}  "
              f"{row['store_gbps'] / row['fio_gbps']:>6.3f}")
    fio_desc = (f"libaio iodepth {r['depth']}" if r["fio_ioengine"] == "libaio" else f"psync x{r['depth']} jobs")
    print(f"store  (IOEngine: preadv x{r['depth']} threads, aligned buffers, xxh3 verified): "
          f"{r['store_gbps']:.3f} GB/s   read p50 {r['p50_read_s'] * 1e3:g} ms, p99 {r['p99_read_s'] * 1e3:g} ms "
          "(bucket bounds)")
    print(f"fio    (randread bs={mib:g} MiB, direct=1, {fio_desc}):  {r['fio_gbps']:.3f} GB/s")
    print(f"ratio  store / fio = {r['ratio']:.3f} (median of the rounds; of the totals {r['ratio_of_totals']:.3f})"
          f"   target >= {r['target']}")
