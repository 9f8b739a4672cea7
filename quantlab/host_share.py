"""A variant's share of the host's cores: one `HostShare` per variant process, made by the executor and handed to
the runner with the job. The runner says where it is used: it follows each model it loads (`follow`), and wraps
the stages it times in the host's timing lock (`timing`).

Every process of torch (OpenMP) starts one intra-op thread per core. Several variants on one machine (Ray runs
them side by side, `--parallel` too, and several sweeps can share a host) then run several threads per core;
torch's threads wait for each other at the end of every op, so one preempted thread stalls them all, and short
ops suffer most. So each variant process sizes its pool to its share of the cores (`thread_share`).

Light on purpose (no torch at import): the sweep's own process computes thread shares without loading torch.
Nothing here is global: what a variant process holds (its seat, whether it is timing) lives in its HostShare.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantlab.errors import bad_input

logger = logging.getLogger(__name__)

THREADS_ENV = "QUANTLAB_THREADS"  # overrides every variant's thread share
# Variables read by OpenMP, MKL and OpenBLAS when they start: a library that starts after the variant
# process sized its share, or a process it starts, then uses the share too. torch, already imported in a
# forked variant, is sized by torch.set_num_threads.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


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


# --- Timing alone ---------------------------------------------------------------------------------------------

# A timed stage (measure, serve) times a variant's speed; variants of this sweep run side by side (--parallel) or
# of other sweeps on the host would slow it and flag it contended. So it holds the host's timing lock exclusively
# while it times, and every seated variant takes it shared, for an instant, before each forward pass of its models
# (the hooks of HostShare.follow): they pause at their next forward pass until the timing is done. Work between
# forward passes (tokenizing, a quantizer's search inside one block) goes on; the contention verdict still
# reports what competed. Two timed stages on one host take turns.
TIMING_LOCK = "timing.lock"
TIMING_WAIT_SECONDS = 1800.0  # a wait this long means a stuck process, not a slow one: go on (and say so)


class HostShare:
    """This variant process's share of the host: its torch threads (`share`; None: torch's default, not sized by
    quantlab), and, for a local variant holding a seat, the seat count its threads follow and the host's timing
    lock. Make it with `fixed` or `seated` (they size the threads), or `HostShare()` for a process quantlab does
    not size (a runner called directly)."""

    def __init__(self, share: ThreadShare | None = None, seats: Seats | None = None):
        self.share = share
        self._seats = seats  # held by this process; None: no seat (its threads follow nothing, it waits for no one)
        self._counted_at = 0.0
        self._timing = False  # inside `timing`: its own forward passes neither wait for the lock nor resize
        self._gave_up_waiting = False  # once gone on past TIMING_WAIT_SECONDS, it does not wait for the lock again

    @classmethod
    def fixed(cls, share: ThreadShare, environment: bool = True) -> HostShare:
        """A share decided elsewhere (Ray's reservation, QUANTLAB_THREADS): sized once, no seat, no timing lock.
        With `environment`, the OpenMP / MKL / OpenBLAS variables too (for libraries that start later and for
        child processes). Works in a variant forked from the preloaded server: torch is imported there, but its
        pool starts on first use, in the variant."""
        _size_threads(share.threads, environment)
        return cls(share)

    @classmethod
    def seated(cls, environment: bool = True, directory: Path | None = None) -> HostShare:
        """A local variant's share: QUANTLAB_THREADS if set; otherwise a seat on this host (in `directory`, default
        `seats_dir()`) and the cores divided by the seats held, followed as others come and go. Where no seat can
        be made (no writable temporary folder), the variant counts alone, as if no other sweep ran."""
        if os.environ.get(THREADS_ENV, "").strip():
            return cls.fixed(local_share(), environment)
        try:
            seats = Seats(directory or seats_dir()).take()
        except OSError:
            return cls.fixed(local_share(), environment)
        share = local_share(seats)
        _size_threads(share.threads, environment)
        return cls(share, seats)

    @property
    def threads_from(self) -> str:
        return self.share.source if self.share is not None else "torch's default (not sized by quantlab)"

    def leave(self) -> None:
        """Give up the seat (for a process that lives on after its variant: the in-process executor's sweep, a
        notebook): other variants on the host stop counting it, and the models it follows stop following."""
        if self._seats is not None:
            self._seats.leave()
        self._seats = None

    @contextlib.contextmanager
    def aside(self) -> Iterator[None]:
        """Give up the seat for the block, and take one again after it: a variant that waits, idle, for its turn
        to serve (quantlab.executors.LocalExecutor) must not shrink the thread share of those that run meanwhile,
        nor of the servers they start."""
        if self._seats is None:
            yield
            return
        self._seats.leave()
        try:
            yield
        finally:
            self._seats.take()

    def follow(self, model: Any) -> None:
        """Count the seats again (at most every RECOUNT_SECONDS) before the forward passes of `model` and of the
        blocks in its module lists (its decoder layers: llm-compressor's calibration calls them one by one), and
        resize torch's pool when the share changed; wait there while another variant times. Torch's thread count
        belongs to the thread that sets it, so it is set here, in the thread that runs the model, not from a
        timer. Nothing without a seat."""
        if self._seats is None:
            return
        from torch import nn

        blocks = [model] + [
            block for module in model.modules() if isinstance(module, nn.ModuleList) for block in module
        ]
        for block in blocks:
            block.register_forward_pre_hook(self._before_forward)

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Hold the host's timing lock for the block (waiting for another variant's timed stage to finish first):
        the other seated variants pause at their next forward pass. This process's threads keep their count
        meanwhile (what is timed runs with one count; the measure stage records it). Nothing where this process
        holds no seat (Ray, QUANTLAB_THREADS, no writable temporary folder), or past TIMING_WAIT_SECONDS of waiting."""
        if self._seats is None:
            yield
            return
        try:
            descriptor = os.open(self._seats.directory / TIMING_LOCK, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
        except OSError:
            yield
            return
        try:
            self._lock_within(descriptor, fcntl.LOCK_EX)
            self._timing = True
            yield
        finally:
            self._timing = False
            os.close(descriptor)

    def _before_forward(self, module: Any, args: Any) -> None:
        if self._seats is None or self._timing:
            return
        self._wait_while_another_variant_times()
        now = time.monotonic()
        if now - self._counted_at < RECOUNT_SECONDS:
            return
        self._counted_at = now
        import torch

        threads = thread_share(visible_cores(), self._seats.live()).threads
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)

    def _wait_while_another_variant_times(self) -> None:
        try:
            descriptor = os.open(self._seats.directory / TIMING_LOCK, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:  # no variant has timed on this host yet
            return
        try:
            self._lock_within(descriptor, fcntl.LOCK_SH)
        finally:
            os.close(descriptor)  # releases it

    def _lock_within(self, descriptor: int, mode: int) -> bool:
        """Take the flock `mode` on `descriptor`, waiting at most TIMING_WAIT_SECONDS (polled, not a blocking flock:
        a process stuck while holding the lock must not stop every variant on the host for ever); False if not."""
        deadline = time.monotonic() + (0.0 if self._gave_up_waiting else TIMING_WAIT_SECONDS)
        while True:
            try:
                fcntl.flock(descriptor, mode | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    if not self._gave_up_waiting:
                        self._gave_up_waiting = True
                        logger.warning(
                            "another quantlab variant has held the host's timing lock (%s) for %.0f s; going on "
                            "without it from now on (speed figures timed meanwhile are flagged if they were contended)",
                            TIMING_LOCK,
                            TIMING_WAIT_SECONDS,
                        )
                    return False
                time.sleep(0.05)
            except OSError:  # a file system without locks
                return False


def _size_threads(threads: int, environment: bool) -> None:
    import torch

    if environment:
        for name in THREAD_VARIABLES:
            os.environ[name] = str(threads)
    torch.set_num_threads(threads)
