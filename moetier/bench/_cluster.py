"""The cluster a benchmark runs: router, expert store and dense worker started the way `moetier up`
starts them (the same commands and one config file, each a process of its own; started at once
rather than one after another, so their imports and warm-ups overlap: each retries what it needs
until it answers), observed only through what the services publish: their /metrics, the router's
Generate stream, and each process's CPU time (/proc/<pid>/stat).

    with LocalCluster.start(settings, model, data_dir) as cluster:
        stub = router_pb2_grpc.RouterStub(grpc.insecure_channel(cluster.router_address))
        cluster.scrape("expert_store")   # {"moetier_expert_store_hits_total": ..., ...}
        cluster.cpu_seconds()            # user + system seconds of the three processes since they started
        cluster.wait_seconds()           # their threads' seconds runnable but waiting for a CPU

The gateway is not started: a benchmark speaks to the router as the gateway does. Every port is
a free one chosen at start (another `moetier up` on this machine is left alone).

With `stores=N` (N > 1) the experts are sharded over N expert stores, each given a directory of
its own (`shard_dirs`: the container's files, hard-linked where the filesystem allows, with the
expert files of every N-th MoE layer only), registered with the router, and the dense worker
places its calls by the router's map (`inference.expert_placement: router`). `scrape("expert_store")`
is then every store's metrics added up; `scrape_each("expert_store")` keeps them apart.
"""

from __future__ import annotations

import os
import shutil
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from moetier.errors import Unavailable
from moetier.launch import ServiceSpec, Supervisor, free_ports, grpc_healthy, service_specs
from moetier.settings import Settings
from moetier.weights.format import EXPERTS_DIR

SERVICES = ("router", "expert_store", "dense_worker")
START_S = 300.0  # one service's start (imports, dense tensors, kernel warm-up) at most
_TICK = os.sysconf("SC_CLK_TCK")

Sample = dict[str, float]  # "name{label=value,...}" (labels sorted) or "name" -> value


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14, 15 of proc(5))


def process_wait_s(pid: int) -> float:
    """Seconds the threads of a process now alive spent runnable but waiting for a CPU (the
    scheduler's run-queue delay, /proc/<pid>/task/*/schedstat; 0 where the kernel keeps none)."""
    out = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            out += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[1])
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
    return out / 1e9


def machine_busy_s(cpus: set[int] | None = None) -> float:
    """CPU seconds the machine's CPUs (`cpus`: these only; default: those this process may use)
    spent busy since boot, whoever ran: /proc/stat's user + nice + system + irq + softirq + steal
    (idle and iowait are not busy). Beside a system's own CPU seconds it tells what the others
    on a shared machine took."""
    want = os.sched_getaffinity(0) if cpus is None else cpus
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *ticks = line.split()
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in want:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in ticks[:8])
                busy += user + nice + system + irq + softirq + steal
    return busy / _TICK


def parse_metrics(text: str) -> Sample:
    out: Sample = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def total(sample: Sample, name: str) -> float:
    """The sum of a metric over all its label values."""
    return sum(v for k, v in sample.items() if k == name or k.startswith(name + "{"))


def shard_dirs(model: Path, into: Path, n: int) -> list[Path]:
    """`n` directories, each the container `model` less the expert files of the MoE layers that
    are not its share (every n-th layer, by position: store i gets layers i, i + n, ...).
    Files are hard links where `into` is on the model's filesystem, copies elsewhere."""
    layer_files = sorted(p.name for p in (model / EXPERTS_DIR).glob("*.bin"))
    out = []
    for i in range(n):
        mine = set(layer_files[i::n])
        root = into / f"shard-{i}"
        for src in model.rglob("*"):
            rel = src.relative_to(model)
            if src.is_dir() or (rel.parts[0] == EXPERTS_DIR and src.suffix == ".bin" and src.name not in mine):
                continue
            dst = root / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
        out.append(root)
    return out


class LocalCluster:
    def __init__(self, settings: Settings, sup: Supervisor, procs: dict[str, Any],
                 store_metrics: dict[str, int]) -> None:
        self.settings = settings
        self.sup = sup
        self.pids = {name: p.pid for name, p in procs.items()}
        self.store_metrics = store_metrics  # store id -> its metrics port

    @classmethod
    @contextmanager
    def start(cls, settings: Settings, model: Path, data_dir: Path, stores: int = 1) -> Iterator[LocalCluster]:
        """Start the three services with `settings` (addresses and metrics ports replaced by free
        ones, data_dir by `data_dir`), `stores` expert stores (more than one: sharded, see above),
        stop them when the block ends."""
        updates: dict[str, Any] = {"data_dir": data_dir}
        # every port at once: ports taken one at a time can repeat (each is free again once its
        # probe closes), and two services given one port had the worker ask the router for Info
        ports = iter(free_ports(2 * len(SERVICES) + (2 * stores if stores > 1 else 0)))
        for name in SERVICES:
            ep = getattr(settings, name)
            port = next(ports)
            updates[name] = ep.model_copy(update={"bind": f"127.0.0.1:{port}", "address": f"127.0.0.1:{port}",
                                                  "metrics_port": next(ports)})
        if stores > 1:
            updates["inference"] = settings.inference.model_copy(update={"expert_placement": "router"})
        settings = settings.model_copy(update=updates)
        data_dir.mkdir(parents=True, exist_ok=True)
        config = data_dir / "moetier.yml"
        config.write_text(yaml.safe_dump(settings.model_dump(mode="json")))
        sup = Supervisor(data_dir / "logs", echo=lambda _: None)
        procs: dict[str, Any] = {}
        store_id = settings.expert_store.id
        store_metrics = {store_id: settings.expert_store.metrics_port}
        try:
            specs: list[ServiceSpec] = [s for s in service_specs(settings, model, config) if s.name in SERVICES]
            if stores > 1:
                specs = cls._store_specs(specs, settings, model, data_dir, stores, store_metrics, ports)
            for spec in specs:
                procs[spec.name] = sup.start(spec)
            for spec in specs:
                sup.wait_healthy(spec, procs[spec.name], START_S)
            cluster = cls(settings, sup, procs, store_metrics)
            cluster.wait_registered(stores)
            yield cluster
        finally:
            sup.stop_all()

    @staticmethod
    def _store_specs(specs: list[ServiceSpec], settings: Settings, model: Path, data_dir: Path, n: int,
                     store_metrics: dict[str, int], ports: Iterator[int]) -> list[ServiceSpec]:
        """The one store's spec replaced by `n`, each on its own shard directory, port and id."""
        (store,) = [s for s in specs if s.name == "expert_store"]
        base = settings.expert_store.id
        store_metrics.clear()
        out = [s for s in specs if s.name != "expert_store"]
        for i, shard in enumerate(shard_dirs(model, data_dir / "shards", n)):
            port, metrics = next(ports), next(ports)
            address = f"127.0.0.1:{port}"
            env = {**store.env, "MOETIER_MODEL__PATH": str(shard), "MOETIER_EXPERT_STORE__BIND": address,
                   "MOETIER_EXPERT_STORE__ADDRESS": address, "MOETIER_EXPERT_STORE__METRICS_PORT": str(metrics),
                   "MOETIER_EXPERT_STORE__ID": f"{base}-{i}"}
            store_metrics[f"{base}-{i}"] = metrics
            out.insert(1 + i, ServiceSpec(f"expert_store-{i}", store.argv, env, ["health", address],
                                          lambda a=address: grpc_healthy(a)))  # type: ignore[misc]
        return out

    @property
    def router_address(self) -> str:
        return self.settings.router.address

    def scrape(self, service: str) -> Sample:
        """A service's metrics (the expert stores': every store's, added up)."""
        if service == "expert_store":
            out: Sample = {}
            for sample in self.scrape_each(service).values():
                for k, v in sample.items():
                    out[k] = out.get(k, 0.0) + v
            return out
        return self._scrape(getattr(self.settings, service).metrics_port)

    def scrape_each(self, service: str) -> dict[str, Sample]:
        """The expert stores' metrics, by store id."""
        assert service == "expert_store"
        return {sid: self._scrape(port) for sid, port in self.store_metrics.items()}

    @staticmethod
    def _scrape(port: int) -> Sample:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def cpu_seconds(self) -> float:
        return sum(process_cpu_s(pid) for pid in self.pids.values())

    def wait_seconds(self) -> float:
        """The three processes' run-queue delay (`process_wait_s`)."""
        return sum(process_wait_s(pid) for pid in self.pids.values())

    def wait_registered(self, stores: int = 1, timeout_s: float = 30.0) -> None:
        """Until the router lists a dense worker and `stores` expert stores (its /metrics says so)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            m = self.scrape("router")
            if (m.get("moetier_router_members{kind=dense_worker}", 0) >= 1
                    and m.get("moetier_router_members{kind=expert_store}", 0) >= stores):
                return
            time.sleep(0.1)
        raise Unavailable(f"the dense worker and expert store did not register with the router within "
                          f"{timeout_s:.0f} s\n{self.sup.tail('dense_worker')}")

