"""Honest timings on a shared machine: how many threads a variant's process runs torch with (its CPU share), and
whether other work competed for its cores while the measure stage timed it.

Light on purpose (no torch at import): the sweep's own process computes thread shares, and `quantlab pick` reads
the tags, without loading torch.

Every process of torch (OpenMP) starts one intra-op thread per core. Several variants on one machine (Ray runs
them side by side; several sweeps can share a host) then run several threads per core; torch's threads wait
for each other at the end of every op, so one preempted thread stalls them all, and short ops suffer most.
Each variant process therefore sizes its pool to its share of the cores (`thread_share`), and the measure
stage records what competed with it (`LoadMonitor`) and judges whether its speed figures are honest
(`judge_contention`).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from quantlab.errors import bad_input

logger = logging.getLogger(__name__)

THREADS_ENV = "QUANTLAB_THREADS"  # overrides every variant's thread share
# Variables read by OpenMP, MKL and OpenBLAS when they start: a library that starts after the variant
# process sized its share, or a process it starts, then uses the share too. torch, already imported in a
# forked variant, is sized by torch.set_num_threads.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
CONTENDED_TAG = "quantlab.cost_contended"  # "true" | "false": whether other work competed while timing
CONTENTION_TAG = "quantlab.cost.contention"  # the verdict in words, with the figures it rests on

# Figures that other work on the variant's cores distorts: timings and what is derived from them. Sizes and
# memory are not (the modeled figures neither).
_TIMING = re.compile(
    r"^cost/(prefill_tokens_per_s|decode_tokens_per_s|ttft_ms_p\d+|itl_ms_p\d+|energy_joules_per_token"
    r"|local_roofline_decode_tokens_per_s|roofline_efficiency)(_bs\d+)?$"
    r"|^cost/(measured_bandwidth_bytes_per_s|load_seconds)$|^time/"
)


def is_timing_metric(key: str) -> bool:
    return _TIMING.match(key) is not None


def visible_cores() -> int:
    """Cores this process may run on (its affinity), not the machine's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# --- The thread share ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ThreadShare:
    threads: int
    source: str  # where the number comes from, in words (logged as runtime.threads_from)


def thread_share(
    cores: int, concurrent: int = 1, ray_cpus: float | None = None, override: str | None = None
) -> ThreadShare:
    """A variant's intra-op threads: `override` (QUANTLAB_THREADS) if set; under Ray the CPUs its task reserved
    (`runtime.cpus`, at least 1); otherwise the `cores` it may run on divided among the `concurrent` variants
    that run on them at once (at least 1). BadInput for an override that is not a whole number above 0."""
    if override is not None and override.strip():
        try:
            threads = int(override.strip())
        except ValueError:
            threads = 0
        if threads < 1:
            raise bad_input(THREADS_ENV, "", f"must be a whole number of threads above 0, got {override!r}")
        return ThreadShare(threads, f"{THREADS_ENV}={threads}")
    if ray_cpus is not None:
        return ThreadShare(max(1, int(ray_cpus)), f"runtime.cpus={ray_cpus:g} (the CPUs Ray reserved for the variant)")
    concurrent = max(1, concurrent)
    variants = "1 variant" if concurrent == 1 else f"{concurrent} variants"
    return ThreadShare(max(1, cores // concurrent), f"{cores} visible cores / {variants} at a time")


def local_share(seats: Seats | None = None) -> ThreadShare:
    """The share of a variant run on this machine by the local (or in-process) executor: with `seats`, the
    cores divided among every quantlab variant holding a seat on this host (other sweeps' too)."""
    override = os.environ.get(THREADS_ENV)
    if seats is None or (override is not None and override.strip()):
        return thread_share(visible_cores(), override=override)
    cores, live = visible_cores(), seats.live()
    share = thread_share(cores, live)
    if live == 1:
        return ThreadShare(share.threads, f"{cores} visible cores, no other quantlab variant on this host")
    return ThreadShare(share.threads, f"{cores} visible cores / {live} quantlab variants on this host")


# --- Sharing the host's cores with other sweeps -------------------------------------------------------------

# Independent sweeps on one host (two users, a test suite, a script per model) know nothing of each other, and
# each would give its variant every core. So each local variant holds a seat in a host-wide folder (a file it
# keeps locked: the kernel drops the lock however the process ends, so a dead variant's seat frees itself and
# no pid can be mistaken for a reused one), and divides the cores by the seats held. Sweeps on one host share
# it only if they see the same temporary folder: a container with its own /tmp counts alone (set
# QUANTLAB_THREADS there).
SEATS_ENV = "QUANTLAB_SEATS_DIR"  # where the seats are (default: <tmp>/quantlab-seats): a host-local folder
RECOUNT_SECONDS = 1.0  # how often a running variant counts the seats again (at most, at its next forward pass)


def seats_dir() -> Path:
    """The host's seat folder, writable by every user (sticky, like /tmp); a folder of this user's own where
    another user made the shared one without letting others in (their variants are then not counted)."""
    if os.environ.get(SEATS_ENV):
        shared = Path(os.environ[SEATS_ENV])
        shared.mkdir(parents=True, exist_ok=True)
        return shared
    shared = Path(tempfile.gettempdir()) / "quantlab-seats"
    try:
        shared.mkdir(exist_ok=True)
        if shared.stat().st_uid == os.getuid():
            shared.chmod(0o1777)
        if os.access(shared, os.W_OK | os.X_OK):
            return shared
    except OSError:
        pass
    own = Path(tempfile.gettempdir()) / f"quantlab-seats-{os.getuid()}"
    own.mkdir(exist_ok=True)
    return own


class Seats:
    """The seats of the quantlab variants running on this host; `take` one for this process."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._held: int | None = None  # the descriptor that keeps this process's seat locked

    def take(self) -> Seats:
        """Hold a seat until this process ends (or `leave`). Made under a name the counters skip, locked, then
        renamed: a counter never sees a seat that is not locked yet (it would take it for a dead one)."""
        name = f"{socket.gethostname()}-{os.getpid()}"
        making = self.directory / f".{name}.making"
        descriptor = os.open(making, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        fcntl.flock(descriptor, fcntl.LOCK_EX)
        os.rename(making, self.directory / f"{name}.seat")
        self._held = descriptor
        return self

    def leave(self) -> None:
        if self._held is not None:
            with contextlib.suppress(OSError):
                (self.directory / f"{socket.gethostname()}-{os.getpid()}.seat").unlink()
            os.close(self._held)
            self._held = None

    def live(self) -> int:
        """Seats held now (this process's too), at least 1. A seat nobody holds is removed."""
        live = 0
        for seat in self.directory.glob("*.seat"):
            try:
                descriptor = os.open(seat, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:  # removed meanwhile, or not ours to read
                continue
            try:
                fcntl.flock(descriptor, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                live += 1
            else:
                with contextlib.suppress(OSError):
                    seat.unlink()
            finally:
                os.close(descriptor)
        return max(1, live)


_applied: ThreadShare | None = None  # the share use_threads gave this process
_following: Seats | None = None  # the seats whose count this process's threads follow, if any
_pinned = 0  # how many pinned_threads blocks are open: the threads were set on purpose, following waits
_counted_at = 0.0


def use_threads(share: ThreadShare, environment: bool = True, follow: Seats | None = None) -> ThreadShare:
    """Size this process's torch intra-op pool (and, with `environment`, the OpenMP / MKL / OpenBLAS variables,
    for libraries that start later and for child processes) to the share. Works in a variant forked from the
    preloaded server: torch is imported there, but its pool starts on first use, in the variant.

    With `follow`, the share is counted again as variants elsewhere on the host start and end, at the forward
    passes of every model loaded afterwards (`follow_share`): a variant that started alone gives back cores
    when another sweep's variant starts, and takes them again when it ends."""
    global _applied, _following
    import torch

    if environment:
        for name in THREAD_VARIABLES:
            os.environ[name] = str(share.threads)
    torch.set_num_threads(share.threads)
    _applied, _following = share, follow
    return share


def applied_share() -> ThreadShare | None:
    return _applied


_seat: Seats | None = None  # this process's seat on the host, once taken


def use_host_share(environment: bool = True) -> ThreadShare:
    """A local variant's threads: QUANTLAB_THREADS if set; otherwise a seat on this host (one per process) and
    the cores divided by the seats held, followed as others come and go. Where no seat can be made (no
    writable temporary folder), the variant counts alone, as if no other sweep ran."""
    global _seat
    if os.environ.get(THREADS_ENV, "").strip():
        return use_threads(local_share(), environment)
    try:
        _seat = _seat or Seats(seats_dir()).take()
    except OSError:
        return use_threads(local_share(), environment)
    return use_threads(local_share(seats=_seat), environment, follow=_seat)


def leave_host_share() -> None:
    """Give up this process's seat (for a process that lives on after its variant: the in-process executor's
    sweep, a notebook): other variants on the host stop counting it, and its threads stop following."""
    global _seat, _following
    if _seat is not None:
        _seat.leave()
    _seat = _following = None


def follow_share(model: Any) -> None:
    """Count the seats again (at most every RECOUNT_SECONDS) before the forward passes of `model` and of the
    blocks in its module lists (its decoder layers: llm-compressor's calibration calls them one by one), and
    resize torch's pool when the share changed. Torch's thread count belongs to the thread that sets it, so
    it is set here, in the thread that runs the model, not from a timer. Nothing without a followed share."""
    if _following is None:
        return
    from torch import nn

    blocks = [model] + [block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module]
    for block in blocks:
        block.register_forward_pre_hook(_recount)


def _recount(module: Any, args: Any) -> None:
    global _counted_at
    if _following is None:
        return
    if not _timing:
        _wait_while_another_variant_times(_following.directory)
    now = time.monotonic()
    if _pinned or now - _counted_at < RECOUNT_SECONDS:
        return
    _counted_at = now
    import torch

    threads = thread_share(visible_cores(), _following.live()).threads
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


# --- Timing alone ---------------------------------------------------------------------------------------------

# A measure stage times a variant's speed; variants of this sweep run side by side (--parallel) or of other
# sweeps on the host would slow it and flag it contended. So it holds the host's timing lock exclusively while
# it times, and every seated variant takes it shared, for an instant, before each forward pass of its models
# (the hooks of follow_share): they pause at their next forward pass until the timing is done. Work between
# forward passes (tokenizing, a quantizer's search inside one block) goes on; the contention verdict still
# reports what competed. Two measure stages on one host take turns.
TIMING_LOCK = "timing.lock"
_timing = False  # this process holds the timing lock: its own forward passes must not wait for it


TIMING_WAIT_SECONDS = 1800.0  # a wait this long means a stuck process, not a slow one: go on (and say so)
_gave_up_waiting = False  # once gone on, this process does not wait for the timing lock again


def _lock_within(descriptor: int, mode: int) -> bool:
    """Take the flock `mode` on `descriptor`, waiting at most TIMING_WAIT_SECONDS (polled, not a blocking flock:
    a process stuck while holding the lock must not stop every variant on the host for ever); False if not."""
    global _gave_up_waiting
    deadline = time.monotonic() + (0.0 if _gave_up_waiting else TIMING_WAIT_SECONDS)
    while True:
        try:
            fcntl.flock(descriptor, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                if not _gave_up_waiting:
                    _gave_up_waiting = True
                    logger.warning(
                        "another quantlab variant has held the host's timing lock (%s) for %.0f s; going on without "
                        "it from now on (speed figures timed meanwhile are flagged if they were contended)",
                        TIMING_LOCK,
                        TIMING_WAIT_SECONDS,
                    )
                return False
            time.sleep(0.05)
        except OSError:  # a file system without locks
            return False


def _wait_while_another_variant_times(directory: Path) -> None:
    try:
        descriptor = os.open(directory / TIMING_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no variant has timed on this host yet
        return
    try:
        _lock_within(descriptor, fcntl.LOCK_SH)
    finally:
        os.close(descriptor)  # releases it


@contextlib.contextmanager
def timing_alone() -> Iterator[None]:
    """Hold the host's timing lock for the block (waiting for another variant's measure stage to finish first):
    the other seated variants pause at their next forward pass. Nothing where this process holds no seat
    (Ray, QUANTLAB_THREADS, no writable temporary folder), or past TIMING_WAIT_SECONDS of waiting."""
    global _timing
    if _following is None:
        yield
        return
    try:
        descriptor = os.open(_following.directory / TIMING_LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
    except OSError:
        yield
        return
    try:
        _timing = _lock_within(descriptor, fcntl.LOCK_EX)
        yield
    finally:
        _timing = False
        os.close(descriptor)


@contextlib.contextmanager
def pinned_threads(threads: int | None) -> Iterator[None]:
    """Run the block with `threads` torch threads, not resized by the seat count, then go back to the threads
    before it. None: nothing pinned (the threads keep following the host's share, if they do)."""
    global _pinned
    import torch

    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    _pinned += 1
    try:
        yield
    finally:
        _pinned -= 1
        torch.set_num_threads(before)


# --- Contention while timing ------------------------------------------------------------------------------------

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
    cpu_seconds: float  # this process's user + system CPU time over the timed part
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

    def to_metrics(self) -> dict[str, float]:
        metrics = {
            "measure/load_1m": self.load_1m,
            "measure/cpu_seconds_per_wall_second": self.own_cores,
            "measure/threads": float(self.threads),
        }
        if self.other_cores is not None:
            metrics["measure/other_cores_busy"] = self.other_cores
        return metrics

    def describe(self) -> str:
        return (
            f"1-minute load average {self.load_before:.2f} before, {self.load_after:.2f} after, on {self.cores} "
            f"cores ({self.machine_cpus} on the machine); {self.threads} torch threads used {self.own_cores:.2f} "
            f"CPU s per wall s over {self.wall_seconds:.2f} s"
        )


@dataclass(frozen=True)
class Contention:
    contended: bool
    reason: str


def judge_contention(reading: LoadReading) -> Contention:
    """Whether other work competed for the variant's cores while it was timed (pure). Either is enough:

    - CPU time: other processes kept more of this process's cores busy than its threads left free, by
      more than OTHER_CORES_MARGIN (plus what the counters' ticks cannot resolve over so short a window);
    - load: the machine's 1-minute load average held more runnable threads besides the variant's than the
      CPUs its threads leave free, by more than LOAD_MARGIN.
    Its own threads beyond its cores (QUANTLAB_THREADS set too high) are not other work: not contention."""
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


class LoadMonitor:
    """Around the timed part of the measure stage: `reading` once it exits."""

    def __init__(self, threads: int):
        self.threads = threads
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
        times = self._process.cpu_times()
        self._cpu = times.user + times.system
        self._started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._started
        times = self._process.cpu_times()
        busy = _busy_seconds(self._cpus)
        self._reading = LoadReading(
            threads=self.threads,
            cores=len(self._cpus),
            machine_cpus=os.cpu_count() or len(self._cpus),
            load_before=self._load,
            load_after=psutil.getloadavg()[0],
            wall_seconds=wall,
            cpu_seconds=times.user + times.system - self._cpu,
            cores_busy_seconds=None if busy is None or self._busy is None else busy - self._busy,
        )
