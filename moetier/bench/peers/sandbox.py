"""Where a benchmarked system runs and what it costs: a cgroup (v1) or its process tree,
the disk's read-ahead, the page cache.

`Sandbox` is one system's process tree, measured the same way in both regimes:
  * memory: with a v1 memory cgroup, its charge (anonymous memory *and* page cache, which
    v1 charges to the cgroup that faulted it in) and the peak charge since start
    (memory.max_usage_in_bytes); always, the summed RSS of its processes (sampled);
  * CPU: with a v1 cpuacct cgroup, cpuacct.usage; else utime + stime of its processes;
  * disk bytes read: read_bytes of /proc/<pid>/io summed over its processes (page faults,
    read-ahead and O_DIRECT reads alike; the blkio controller does not count them on
    every kernel, and /proc/diskstats would count the other users of the disk too).

`Cgroup` creates one group in each v1 hierarchy used (memory, cpuacct), with an optional
memory limit; a child joins it in its `preexec_fn`, so the whole tree it starts is inside.
`Cgroup.remove_leftovers` removes the groups of a killed run, stopping what still runs there.
`ReadAhead` sets a block device's read_ahead_kb and always puts the old value back: on
exit, on Ctrl-C or an error, and, after a SIGKILL of the benchmark, on the next run (the
old value is written to a note file before it is changed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from moetier.errors import InvalidArgument, Unavailable

CGROUP_ROOT = Path("/sys/fs/cgroup")
SYSFS = Path("/sys")
PROC = Path("/proc")
CONTROLLERS = ("memory", "cpuacct")
CGROUP_PREFIX = "moetier-peers-"  # + the benchmark's PID: one group per trial of a run
TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# ---- processes -------------------------------------------------------------------------------
def _stat_fields(pid: int, proc: Path = PROC) -> list[str] | None:
    try:
        text = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # fields from 3 (state) on


def descendants(root: int, proc: Path = PROC) -> list[int]:
    """`root` and every live process below it."""
    children: dict[int, list[int]] = {}
    for d in proc.iterdir():
        if d.name.isdigit():
            f = _stat_fields(int(d.name), proc)
            if f is not None and f[0] != "Z":
                children.setdefault(int(f[1]), []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def rss_bytes(pid: int, proc: Path = PROC, field: str = "VmRSS") -> int:
    """Resident set of one process (VmRSS; VmHWM: its peak so far), 0 when it is gone."""
    try:
        for line in (proc / str(pid) / "status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def read_bytes(pid: int, proc: Path = PROC) -> int:
    """Bytes this process caused to be read from storage (/proc/<pid>/io read_bytes)."""
    try:
        for line in (proc / str(pid) / "io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int, proc: Path = PROC) -> float:
    """utime + stime of one process, its threads included."""
    f = _stat_fields(pid, proc)
    return 0.0 if f is None else (int(f[11]) + int(f[12])) / TICKS


# ---- cgroup v1 -------------------------------------------------------------------------------
def cgroup_v1_available(root: Path = CGROUP_ROOT) -> str | None:
    """None when v1 memory and cpuacct hierarchies can be used here; else why not."""
    if os.geteuid() != 0:
        return "not root (creating a cgroup needs root)"
    for c in CONTROLLERS:
        if not (root / c / "cgroup.procs").is_file():
            return f"no cgroup v1 {c} hierarchy at {root / c}"
    return None


@dataclass
class Cgroup:
    """One group named `name` in each v1 hierarchy of CONTROLLERS."""

    name: str
    root: Path = CGROUP_ROOT
    limit_bytes: int | None = None

    def path(self, controller: str) -> Path:
        return self.root / controller / self.name

    def create(self) -> Cgroup:
        for c in CONTROLLERS:
            p = self.path(c)
            if p.exists():
                self._empty(p)
                p.rmdir()  # left by an interrupted run
            p.mkdir()
        mem = self.path("memory")
        if self.limit_bytes is not None:
            (mem / "memory.limit_in_bytes").write_text(f"{self.limit_bytes}\n")
            got = int((mem / "memory.limit_in_bytes").read_text())
            if abs(got - self.limit_bytes) > 1 << 20:  # the kernel rounds to pages
                raise Unavailable(f"{mem}: memory limit {self.limit_bytes} not taken (reads {got})")
        return self

    def join(self) -> None:
        """Move the calling process into the group (a child's preexec_fn calls this)."""
        for c in CONTROLLERS:
            with open(self.path(c) / "cgroup.procs", "w") as f:
                f.write("0\n")  # 0: the writing process

    def procs(self) -> list[int]:
        try:
            text = (self.path("memory") / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(x) for x in text.split()]

    def memory_bytes(self) -> int:
        return int((self.path("memory") / "memory.usage_in_bytes").read_text())

    def peak_memory_bytes(self) -> int:
        return int((self.path("memory") / "memory.max_usage_in_bytes").read_text())

    def memory_stat(self) -> dict[str, int]:
        out = {}
        for line in (self.path("memory") / "memory.stat").read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.strip().isdigit():
                out[k] = int(v)
        return out

    def cpu_seconds(self) -> float:
        return int((self.path("cpuacct") / "cpuacct.usage").read_text()) / 1e9

    def _empty(self, p: Path, timeout_s: float = 10.0) -> None:
        """Kill what is left in the group and wait until it is empty."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                pids = [int(x) for x in (p / "cgroup.procs").read_text().split()]
            except OSError:
                return
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                raise Unavailable(f"{p}: processes {pids} did not exit")
            time.sleep(0.05)

    def remove(self) -> None:
        for c in CONTROLLERS:
            p = self.path(c)
            if p.exists():
                self._empty(p)
                with contextlib.suppress(OSError):
                    p.rmdir()

    @classmethod
    def remove_leftovers(cls, prefix: str, root: Path = CGROUP_ROOT,
                         say: Callable[[str], None] = print) -> list[str]:
        """Remove the groups named `prefix` + a PID that is no longer running, with whatever
        still runs in them: what a benchmark killed before its clean-up left behind (a
        llama.cpp server there kept a CPU busy through the next runs' trials). A group whose
        PID runs belongs to a live benchmark and is left alone. The names removed."""
        names: set[str] = set()
        for c in CONTROLLERS:
            with contextlib.suppress(OSError):
                names.update(d.name for d in (root / c).iterdir()
                             if d.is_dir() and d.name.startswith(prefix) and d.name.removeprefix(prefix).isdigit())
        removed = []
        for name in sorted(names):
            if _running(int(name.removeprefix(prefix))):
                continue
            group = cls(name, root=root)
            left = group.procs()
            group.remove()
            removed.append(name)
            say(f"removed cgroup {name}, left by an interrupted run"
                + (f", and stopped the {len(left)} process(es) still in it: {left}" if left else ""))
        return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether it exists
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # it exists, as another user's process
    return True


# ---- one system's process tree ---------------------------------------------------------------
@dataclass
class Sandbox:
    """The processes of one benchmarked system: its cgroup's, or the tree under `root_pid`."""

    cgroup: Cgroup | None = None
    root_pid: int | None = None
    proc: Path = PROC
    sample_s: float = 0.2
    peak_rss: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def pids(self) -> list[int]:
        if self.cgroup is not None:
            return self.cgroup.procs()
        return [] if self.root_pid is None else descendants(self.root_pid, self.proc)

    def rss(self) -> int:
        return sum(rss_bytes(p, self.proc) for p in self.pids())

    def read_bytes(self) -> int:
        return sum(read_bytes(p, self.proc) for p in self.pids())

    def cpu_seconds(self) -> float:
        if self.cgroup is not None:
            return self.cgroup.cpu_seconds()
        return sum(cpu_seconds(p, self.proc) for p in self.pids())

    def memory(self) -> int | None:
        """The cgroup's charge (page cache included); None without a cgroup."""
        return None if self.cgroup is None else self.cgroup.memory_bytes()

    def peak_memory(self) -> int | None:
        return None if self.cgroup is None else self.cgroup.peak_memory_bytes()

    def start_sampling(self) -> None:
        def loop() -> None:
            while not self._stop.wait(self.sample_s):
                self.peak_rss = max(self.peak_rss, self.rss())

        self._thread = threading.Thread(target=loop, name="rss-sampler", daemon=True)
        self._thread.start()

    def stop_sampling(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


# ---- page cache and read-ahead ----------------------------------------------------------------
def drop_page_cache(proc: Path = PROC) -> bool:
    """Write back and drop the page cache (root only); False where that is not allowed."""
    try:
        os.sync()
        (proc / "sys" / "vm" / "drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def block_device(path: Path, sysfs: Path = SYSFS) -> Path | None:
    """The sysfs directory of the disk holding `path` (a partition's parent disk), or None
    where there is none (tmpfs, overlay and other filesystems without a block device)."""
    st = os.stat(path)
    dev = sysfs / "dev" / "block" / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"
    if not dev.exists():
        return None
    real = dev.resolve()
    if (real / "partition").exists():
        real = real.parent
    return real if (real / "queue" / "read_ahead_kb").exists() else None


class ReadAhead:
    """A block device's read_ahead_kb: read it, set it for a while, always restore it.

    `note` is a JSON file {"device": ..., "read_ahead_kb": old} written before a change and
    removed after the restore; `restore_leftover` puts back what a killed run left changed."""

    def __init__(self, device: Path, note: Path) -> None:
        self.device = device
        self.note = note
        self.file = device / "queue" / "read_ahead_kb"

    @property
    def name(self) -> str:
        return self.device.name

    def get(self) -> int:
        return int(self.file.read_text())

    @contextlib.contextmanager
    def set(self, kb: int) -> Iterator[None]:
        old = self.get()
        if old == kb:
            yield
            return
        self.note.parent.mkdir(parents=True, exist_ok=True)
        self.note.write_text(json.dumps({"device": str(self.device), "read_ahead_kb": old}) + "\n")
        try:
            try:
                self.file.write_text(f"{kb}\n")
            except OSError as e:
                raise InvalidArgument(f"cannot set {self.file} to {kb} ({e.strerror})") from e
            yield
        finally:
            self.file.write_text(f"{old}\n")
            self.note.unlink(missing_ok=True)

    @staticmethod
    def restore_leftover(note: Path, say: Callable[[str], None] = print) -> None:
        if not note.is_file():
            return
        try:
            left = json.loads(note.read_text())
            f = Path(left["device"]) / "queue" / "read_ahead_kb"
            f.write_text(f"{int(left['read_ahead_kb'])}\n")
            say(f"restored {f} to {left['read_ahead_kb']} KiB (left changed by an interrupted run)")
        except (OSError, ValueError, KeyError, TypeError) as e:
            say(f"could not restore the read-ahead noted in {note} ({e}); check it by hand")
            return
        note.unlink(missing_ok=True)


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt in the main thread while inside, so `finally` blocks
    (read-ahead restore, servers stopped, cgroups removed) run on a kill too. Later SIGTERMs
    are ignored until it exits: `pkill` reaching both `timeout` and the benchmark sends two,
    and the second must not cut that clean-up short (it left a llama.cpp server running)."""
    def on_term(_signum: int, _frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
