"""Whether other work competed for a variant's cores while its speed was timed: what the measure stage read
(`LoadMonitor` -> `LoadReading`) and the verdict on it (`judge_contention`, pure).

How a variant shares the host's cores (its thread share, its seat, the host's timing lock) is
`quantlab.host_share`; which figures a busy host distorts is a column of the metric contract (`metrics.spec(key).timed`).
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import psutil

CONTENDED_TAG = "quantlab.cost_contended"  # "true" | "false": whether other work competed while timing
CONTENTION_TAG = "quantlab.cost.contention"  # the verdict in words, with the figures it rests on


# Busy-time counters (per CPU in /proc/stat, per process) advance in ticks of 1/100 s (USER_HZ).
TICK_SECONDS = 0.01
# Other work may keep this much of the variant's cores busy, on average, before its timing counts as contended:
# half a core, or a tenth of the cores on a large machine. On a quiet machine the OS, daemons and the sweep's
# own parent process (polling its queue) take well under 0.2 of a core; an other process that keeps half a
# core busy preempts one of torch's threads half the time, and every op then waits for that thread.
OTHER_CORES_MARGIN = 0.5
OTHER_CORES_SHARE = 0.1
# Runnable threads besides the variant's, in the 1-minute load average, beyond the CPUs its threads leave free:
# at least one, or a quarter of the machine. The average lags by a minute (it still holds the stage before)
# and counts threads waiting on disk too, so only a clear excess counts. It is the machine's figure (a
# container sees its host's), so it is compared with the machine's CPUs, not this process's cores.
LOAD_MARGIN = 1.0
LOAD_SHARE = 0.25


@dataclass(frozen=True)
class LoadReading:
    """What competed with the timed part of the measure stage."""

    threads: int  # torch intra-op threads while timing
    cores: int  # cores this process may run on
    machine_cpus: int  # CPUs of the machine: what its load average counts against
    load_before: float  # the machine's 1-minute load average before the timed part
    load_after: float  # ... and after it
    wall_seconds: float
    cpu_seconds: float  # this process's (and, monitored as a tree, its descendants') user + system CPU time
    cores_busy_seconds: float | None  # busy time of this process's cores, every process's; None: unknown

    @property
    def load_1m(self) -> float:
        return max(self.load_before, self.load_after)

    @property
    def own_cores(self) -> float:
        """Cores this process kept busy, on average (its CPU seconds per wall second)."""
        return self.cpu_seconds / self.wall_seconds if self.wall_seconds > 0 else 0.0

    @property
    def other_cores(self) -> float | None:
        """Cores of this process's that other work kept busy, on average."""
        if self.cores_busy_seconds is None or self.wall_seconds <= 0:
            return None
        return max(0.0, self.cores_busy_seconds / self.wall_seconds - self.own_cores)

    def to_metrics(self, prefix: str = "measure/") -> dict[str, float]:
        """`prefix`: the stage that timed (the measure stage's `measure/`, the serve stage's `measure/serve/`)."""
        metrics = {
            f"{prefix}load_1m": self.load_1m,
            f"{prefix}cpu_seconds_per_wall_second": self.own_cores,
            f"{prefix}threads": float(self.threads),
        }
        if self.other_cores is not None:
            metrics[f"{prefix}other_cores_busy"] = self.other_cores
        return metrics

    def describe(self) -> str:
        return (
            f"1-minute load average {self.load_before:.2f} before, {self.load_after:.2f} after, on {self.cores} "
            f"cores ({self.machine_cpus} on the machine); {self.threads} torch threads used {self.own_cores:.2f} "
            f"CPU s per wall s over {self.wall_seconds:.2f} s"
        )


def combined(readings: Sequence[LoadReading]) -> LoadReading:
    """Several timed windows (a load's rounds, apart in time) read as one: their seconds added up, the load average's
    lowest before and highest after."""
    first, *_ = readings
    busy = [reading.cores_busy_seconds for reading in readings]
    return replace(
        first,
        load_before=min(reading.load_before for reading in readings),
        load_after=max(reading.load_after for reading in readings),
        wall_seconds=sum(reading.wall_seconds for reading in readings),
        cpu_seconds=sum(reading.cpu_seconds for reading in readings),
        cores_busy_seconds=None if None in busy else sum(busy),
    )


@dataclass(frozen=True)
class Contention:
    contended: bool
    reason: str
    cause: str = "other work competed"  # in a few words, for a line that names several runs


def judge_contention(reading: LoadReading, load_average: bool = True) -> Contention:
    """Whether other work competed for the variant's cores while it was timed (pure). Either is enough:

    - CPU time: other processes kept more of this process's cores busy than its threads left free, by
      more than OTHER_CORES_MARGIN (plus what the counters' ticks cannot resolve over so short a window);
    - load: the machine's 1-minute load average held more runnable threads besides the variant's than the
      CPUs its threads leave free, by more than LOAD_MARGIN.
    Its own threads beyond its cores (QUANTLAB_THREADS set too high) are not other work: not contention.
    `load_average` False: CPU time alone where it is known, for a window of seconds, which the 1-minute average (a
    minute of the past, other windows mostly) cannot judge."""
    found: list[str] = []
    checked: list[str] = []
    others = reading.other_cores
    if others is not None:
        spare = max(0, reading.cores - reading.threads)
        resolution = 2 * (reading.cores + 1) * TICK_SECONDS / reading.wall_seconds
        limit = spare + max(OTHER_CORES_MARGIN, OTHER_CORES_SHARE * reading.cores) + resolution
        words = (
            f"other processes kept {others:.2f} of its {reading.cores} cores busy while it was timed "
            f"({reading.threads} threads; limit {limit:.2f})"
        )
        (found if others > limit else checked).append(words)
    if others is not None and not load_average:
        return Contention(bool(found), ("contended: " if found else "not contended: ") + "; ".join(found + checked))
    load_others = max(0.0, reading.load_1m - reading.threads)
    load_limit = max(0, reading.machine_cpus - reading.threads) + max(LOAD_MARGIN, LOAD_SHARE * reading.machine_cpus)
    words = (
        f"1-minute load average {reading.load_1m:.2f} on {reading.machine_cpus} CPUs, {load_others:.2f} runnable "
        f"threads besides its {reading.threads} (limit {load_limit:.2f})"
    )
    (found if load_others > load_limit else checked).append(words)
    if found:
        return Contention(True, "contended: " + "; ".join(found))
    return Contention(False, "not contended: " + "; ".join(checked))


# A load run's measured requests against its own warm-up requests, the same load on the same server moments before.
# A machine that slows while a run is timed (another tenant of the host, the hypervisor, a kernel thread) shows no
# process's CPU time here, only in the run's own pace. On a quiet machine the two medians of a run stayed within
# 0.6x-1.45x of each other (benchmarks/serving_agreement.py prints every run's); half again slower counts, and only by
# more than a few scheduler ticks per token, which a tiny model's millisecond latencies jitter by.
SLOWED_RATIO = 1.5
SLOWED_MIN_MS = 15.0


def judge_slowdown(measured_itl_ms: float, warm_up_itl_ms: float | None) -> Contention | None:
    """Contended where a run's measured median inter-token latency is at least SLOWED_RATIO times, and SLOWED_MIN_MS
    more than, its warm-up's (pure); None where it is not, or there is no warm-up pace to compare with."""
    if warm_up_itl_ms is None or not warm_up_itl_ms > 0 or not math.isfinite(measured_itl_ms):
        return None
    ratio = measured_itl_ms / warm_up_itl_ms
    if ratio < SLOWED_RATIO or measured_itl_ms - warm_up_itl_ms < SLOWED_MIN_MS:
        return None
    return Contention(
        True,
        f"contended: its measured requests' median inter-token latency, {measured_itl_ms:.1f} ms, was {ratio:.2f}x "
        f"its warm-up's ({warm_up_itl_ms:.1f} ms), with no other process's work to show for it: the machine slowed "
        "while it was timed",
        "it slowed while timed",
    )


def _busy_seconds(cpus: set[int]) -> float | None:
    """Busy seconds so far of the given CPUs (every process's time but idle and I/O wait); None if unknown."""
    try:
        per_cpu = psutil.cpu_times(percpu=True)
    except (OSError, NotImplementedError, AttributeError):
        return None
    chosen = [per_cpu[index] for index in sorted(cpus) if index < len(per_cpu)] or per_cpu
    busy = 0.0
    for times in chosen:
        fields = times._asdict()
        # guest time is counted in user time already (Linux); steal (the hypervisor's other guests) is busy.
        total = sum(value for name, value in fields.items() if name not in ("guest", "guest_nice"))
        busy += total - fields["idle"] - fields.get("iowait", 0.0)
    return busy


def _cpus() -> set[int]:
    return set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def _own_cpu_seconds(process: psutil.Process, tree: bool) -> float:
    """The process's user + system CPU seconds; with `tree`, its descendants' too: the live ones' own and reaped
    ones' (Linux adds a waited-for child's time, its own reaped descendants' included, to its parent's children_*)."""
    times = process.cpu_times()
    if not tree:
        return times.user + times.system
    members = [process]
    with contextlib.suppress(psutil.Error):
        members += process.children(recursive=True)
    total = 0.0
    for member in members:
        with contextlib.suppress(psutil.Error):  # one that ended meanwhile is counted by its parent once reaped
            found = member.cpu_times()
            total += found.user + found.system + found.children_user + found.children_system
    return total


@dataclass(frozen=True)
class Sample:
    """The counters a reading is the difference of, read at one moment."""

    at: float  # seconds since the epoch (guidellm's clock for its levels' windows)
    load_1m: float
    cpu_seconds: float  # the monitored process tree's
    cores_busy_seconds: float | None


def reading_between(
    samples: list[Sample], start: float, end: float, threads: int, cores: int, machine_cpus: int
) -> LoadReading | None:
    """What competed with the work between `start` and `end` (a load level's window), from the samples that
    bracket it: the last one at or before `start` and the first at or after `end` (the window grows by up to a
    sampling period each side); None where the samples do not cover it."""
    before = [sample for sample in samples if sample.at <= start]
    after = [sample for sample in samples if sample.at >= end]
    if not before or not after:
        return None
    first, last = before[-1], after[0]
    busy = (
        None
        if first.cores_busy_seconds is None or last.cores_busy_seconds is None
        else last.cores_busy_seconds - first.cores_busy_seconds
    )
    return LoadReading(
        threads=threads,
        cores=cores,
        machine_cpus=machine_cpus,
        load_before=first.load_1m,
        load_after=last.load_1m,
        wall_seconds=last.at - first.at,
        cpu_seconds=last.cpu_seconds - first.cpu_seconds,
        cores_busy_seconds=busy,
    )


class LoadSampler:
    """Counters read now and then (`sample()`, e.g. while polling a load generator), so that each part of the work
    gets its own reading afterwards (`between`). `tree`: the process's descendants' CPU time is its own work."""

    def __init__(self, threads: int, tree: bool = True) -> None:
        self.threads, self.tree = threads, tree
        self.samples: list[Sample] = []
        self._cpus = _cpus()
        self._process = psutil.Process()

    def sample(self) -> None:
        busy = _busy_seconds(self._cpus)
        cpu = _own_cpu_seconds(self._process, self.tree)
        self.samples.append(Sample(time.time(), psutil.getloadavg()[0], cpu, busy))

    def between(self, start: float, end: float) -> LoadReading | None:
        machine = os.cpu_count() or len(self._cpus)
        return reading_between(self.samples, start, end, self.threads, len(self._cpus), machine)


class LoadMonitor:
    """Around the timed part of a stage: `reading` once it exits. `tree`: the work timed runs in this process's
    descendants too (the serve stage's server and load generator), so their CPU time is its own, not other work."""

    def __init__(self, threads: int, tree: bool = False):
        self.threads = threads
        self.tree = tree
        self._reading: LoadReading | None = None

    @property
    def reading(self) -> LoadReading:
        if self._reading is None:
            raise RuntimeError("the load is read when the monitored block ends")
        return self._reading

    def __enter__(self) -> LoadMonitor:
        self._cpus = _cpus()
        self._process = psutil.Process()
        self._load = psutil.getloadavg()[0]
        self._busy = _busy_seconds(self._cpus)
        self._cpu = _own_cpu_seconds(self._process, self.tree)
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._started
        cpu = _own_cpu_seconds(self._process, self.tree)
        busy = _busy_seconds(self._cpus)
        self._reading = LoadReading(
            threads=self.threads,
            cores=len(self._cpus),
            machine_cpus=os.cpu_count() or len(self._cpus),
            load_before=self._load,
            load_after=psutil.getloadavg()[0],
            wall_seconds=wall,
            cpu_seconds=cpu - self._cpu,
            cores_busy_seconds=None if busy is None or self._busy is None else busy - self._busy,
        )


QUIET_WINDOW_S = 1.0


def wait_until_quiet(threads: int, timeout_s: float, window_s: float = QUIET_WINDOW_S) -> LoadReading | None:
    """Waits, a window at a time, until other work keeps no more of the cores busy than `judge_contention` allows
    for `threads` (CPU time alone); the quiet window's reading, or None once `timeout_s` passed without one (at
    least one window is read)."""
    deadline = time.monotonic() + timeout_s
    while True:
        with LoadMonitor(threads, tree=True) as monitor:
            time.sleep(window_s)
        if not judge_contention(monitor.reading, load_average=False).contended:
            return monitor.reading
        if time.monotonic() + window_s > deadline:
            return None
