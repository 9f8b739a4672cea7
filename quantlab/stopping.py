"""One way a command stops on SIGINT (Ctrl-C) or SIGTERM (a scheduler): in bounded time, leaving no process.

The first signal raises `Stopped` (a KeyboardInterrupt) in the main thread, so the command's own cleanup runs: the
sweep kills its variant processes and marks its runs KILLED with the reason. That cleanup has `grace_s`. The
signal also reaches a watcher thread, through the file descriptor CPython's C-level handler writes each caught
signal to (`signal.set_wakeup_fd`): the watcher does not depend on the main thread reaching its next bytecode,
which a thread blocked in C, or an interpreter stuck at exit joining a thread, never does. When the grace runs
out, or at once on a second signal, the watcher stops the process itself: every process it started is SIGKILLed,
the `on_force` callbacks get a few seconds (ending runs), and it exits 128 + the first signal's number.

SIGINT is handled even when the process started with it ignored, which Python otherwise keeps: a process that a
non-interactive shell starts in the background inherits SIGINT ignored (POSIX), and so did every sweep of a test
suite run that way; Ctrl-C sent to such a sweep's group did nothing, and its runs stayed RUNNING. To keep a sweep out
of a terminal's Ctrl-C, start it in a session of its own (`setsid quantlab sweep ...`).

One piece of module state, `_CURRENT`: the watcher of the block the main thread is in. Signal handlers are the
process's, one set at a time, so the watcher that handles them is the process's too; `on_force`, `stopped` and
`raise_if_stopped` find it there, deep in a sweep, without every layer handing it on.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psutil

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 20.0  # the command's own cleanup, before the watcher stops it
FORCE_CALLBACK_S = 5.0  # what `on_force` callbacks get, together, when the watcher stops the process


class Stopped(KeyboardInterrupt):
    """The command was asked to stop by `signum`; exits 128 + signum, as a shell reports a process the signal killed."""

    def __init__(self, signum: int):
        super().__init__(describe(signum))
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def describe(signum: int) -> str:
    return "interrupted by SIGINT (Ctrl-C)" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"


def stopped(error: BaseException) -> Stopped | None:
    """The stop behind `error`, or None when it is an error of its own. Any error raised once a stop signal was
    caught counts as the stop: a library can turn the KeyboardInterrupt into an error of its own (a C extension
    interrupted while it initialises raises "ImportError: initialization failed")."""
    if isinstance(error, Stopped):
        return error
    watcher = _CURRENT.watcher
    if watcher is not None and watcher.first is not None:
        return Stopped(watcher.first)
    return Stopped(signal.SIGINT) if isinstance(error, KeyboardInterrupt) else None


def raise_if_stopped() -> None:
    """`Stopped` if a stop signal was caught: for the places a long command passes often (a stage starting, an
    executor's poll), since the first raise can be swallowed where it lands. A library that guards an optional import
    with `except ImportError` loses it when the signal interrupts a C extension's initialisation (which turns it
    into "ImportError: initialization failed"): an in-process sweep signalled while it loaded its model ran on to
    the end (interrupt_trials seed 1, trial 34)."""
    watcher = _CURRENT.watcher
    if watcher is not None and watcher.first is not None:
        raise Stopped(watcher.first)


def exit_code(error: BaseException) -> int:
    """130 for Ctrl-C, 143 for SIGTERM."""
    stop = stopped(error)
    return stop.exit_code if stop is not None else 1


def reason(error: BaseException) -> str:
    """Why a run ends: the signal that stopped the command, or the error that ended it."""
    if (stop := stopped(error)) is not None:
        return str(stop)
    return f"the sweep ended on {type(error).__name__}: {error}".rstrip(": ")


class _Watcher:
    """What the stop signals do while `stop_on_signals` holds."""

    def __init__(self, grace_s: float, say: Callable[[str], None]):
        self.grace_s, self.say = grace_s, say
        self.first: int | None = None  # the first stop signal, as the main thread's handler saw it
        self.first_caught = signal.SIGINT  # the first stop signal, as the watcher read it
        self.callbacks: list[Callable[[str], object]] = []  # each told why the runs end
        self.read_end, self.write_end = os.pipe()
        os.set_blocking(self.write_end, False)  # set_wakeup_fd's demand: a signal handler never blocks

    def handle(self, signum: int, frame) -> None:
        """In the main thread: the first signal raises; later ones are the watcher's (it already has them)."""
        if self.first is None:
            self.first = signum
            raise Stopped(signum)

    def watch(self) -> None:
        first_at = None
        while True:
            wait = None if first_at is None else max(0.0, first_at + self.grace_s - time.monotonic())
            ready, _, _ = select.select([self.read_end], [], [], wait)
            if not ready:  # the grace is over
                self.force(f"still stopping after {self.grace_s:.0f} s")
                return
            read = os.read(self.read_end, 64)
            if first_at is None and _BLOCK_ENDED in read:  # the block ended without a stop signal
                os.close(self.read_end)
                return
            caught = [number for number in read if number in STOP_SIGNALS]
            if not caught:
                continue
            if first_at is None:
                first_at = time.monotonic()
                self.first_caught = caught[0]  # the main thread's handler may not have run yet
                caught = caught[1:]
            if caught:
                self.force(f"a second {signal.Signals(caught[0]).name}")
                return

    def force(self, why: str) -> None:
        """Stop now: every process this one started is killed, the callbacks get their seconds, exit."""
        signum = self.first or self.first_caught
        kill_descendants()
        self.say(f"Stopping at once ({why}): every process this command started is killed.")
        done = threading.Event()

        failed: list[str] = []

        def callbacks() -> None:
            for callback in list(self.callbacks):
                try:
                    callback(f"{describe(signum)}; stopped at once ({why})")
                except Exception as error:  # noqa: BLE001 - told below; the stop goes on
                    failed.append(f"{type(error).__name__}: {error}")
            done.set()

        threading.Thread(target=callbacks, name="stop-callbacks", daemon=True).start()
        if not done.wait(FORCE_CALLBACK_S) or failed:
            what = "; ".join(failed) or f"no answer within {FORCE_CALLBACK_S:.0f} s"
            self.say(f"Runs this sweep left RUNNING are marked KILLED by the next sweep of its recipe ({what}).")
        kill_descendants()  # anything a callback or the main thread started meanwhile
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(128 + signum)


_BLOCK_ENDED = 0  # not a signal number: what `stop_on_signals` writes to its watcher when the block ends


@dataclass
class _Current:
    watcher: _Watcher | None = None  # of the `stop_on_signals` block the main thread is in


_CURRENT = _Current()


@contextlib.contextmanager
def stop_on_signals(say: Callable[[str], None], grace_s: float = GRACE_S) -> Iterator[_Watcher | None]:
    """SIGINT and SIGTERM stop the block with `Stopped`; the watcher bounds how long that takes (module docstring).
    `say` prints one line to the user (from the watcher's thread). Yields the watcher (its `first` is the first
    stop signal caught); None outside the main thread, whose signal handlers these are."""
    if threading.current_thread() is not threading.main_thread():
        yield None
        return
    watcher = _Watcher(grace_s, say)
    previous = {number: signal.signal(number, watcher.handle) for number in STOP_SIGNALS}
    previous_fd = signal.set_wakeup_fd(watcher.write_end, warn_on_full_buffer=False)
    threading.Thread(target=watcher.watch, name="stop-watcher", daemon=True).start()
    _CURRENT.watcher = watcher
    try:
        yield watcher
    finally:
        _CURRENT.watcher = None
        # After a stop signal the process is on its way out: the watcher stays in charge of its exit (an interpreter
        # can hang at exit, joining a thread), a second signal included. Without one, all is as it was.
        if watcher.first is None:
            signal.set_wakeup_fd(previous_fd)
            for number, handler in previous.items():
                signal.signal(number, handler)
            os.write(watcher.write_end, bytes([_BLOCK_ENDED]))
            os.close(watcher.write_end)


@contextlib.contextmanager
def on_force(callback: Callable[[str], object]) -> Iterator[None]:
    """While the block runs, a forced stop calls `callback` with why (e.g. to end the sweep's runs with that reason);
    no-op outside `stop_on_signals`."""
    watcher = _CURRENT.watcher
    if watcher is not None:
        watcher.callbacks.append(callback)
    try:
        yield
    finally:
        if watcher is not None:
            watcher.callbacks.remove(callback)


def kill_descendants() -> None:
    """SIGKILL every live process this one started, at any depth (servers in sessions of their own included)."""
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for child in children:
        with contextlib.suppress(psutil.Error):
            child.kill()
