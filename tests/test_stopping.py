"""quantlab.stopping with real signals to real processes: a cleanup that hangs, an interpreter that hangs at exit,
a second Ctrl-C, SIGTERM's exit code, and no process left behind; then a seeded handful of the interrupt benchmark's
trials (benchmarks/interrupt_trials.py: tiny sweeps interrupted at random moments, both executors)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]

# A command under stop_on_signals (grace 2 s) that starts a child process (a server it would stop), says it is
# ready, then waits; what it does when stopped is the test's BEHAVIOUR.
PROGRAM = """
import os, subprocess, sys, threading, time
from quantlab import stopping

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
print(child.pid, flush=True)
ended = []
with stopping.stop_on_signals(lambda line: print(line, file=sys.stderr, flush=True), grace_s=2.0):
    with stopping.on_force(lambda why: ended.append(why) or print("on_force:", why, flush=True)):
        try:
            print("ready", flush=True)
            time.sleep(600)
        except KeyboardInterrupt as error:
            print("cleanup:", stopping.reason(error), flush=True)
            {behaviour}
            child.kill()
            sys.exit(stopping.exit_code(error))
"""

BEHAVIOURS = {
    "prompt": "pass",
    "cleanup hangs": "threading.Event().wait()",  # a lock that is never released, as a library's can be
    "exit hangs": "threading.Thread(target=threading.Event().wait).start()",  # joined forever at exit
}


def _start(behaviour: str, tmp_path: Path) -> tuple[subprocess.Popen, int]:
    script = tmp_path / "command.py"
    script.write_text(textwrap.dedent(PROGRAM).replace("{behaviour}", BEHAVIOURS[behaviour]))
    process = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    child = int(process.stdout.readline())
    assert process.stdout.readline().strip() == "ready"
    return process, child


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize(
    ("behaviour", "signals", "code", "forced", "most_s"),
    [
        ("prompt", [signal.SIGINT], 130, False, 1.5),
        ("prompt", [signal.SIGTERM], 143, False, 1.5),
        ("cleanup hangs", [signal.SIGINT], 130, True, 4.0),  # the watcher stops it once the grace (2 s) is over
        ("cleanup hangs", [signal.SIGTERM], 143, True, 4.0),
        ("cleanup hangs", [signal.SIGINT, signal.SIGINT], 130, True, 1.5),  # a second Ctrl-C: at once
        ("exit hangs", [signal.SIGINT], 130, True, 4.0),  # stuck joining a thread after the block ended
    ],
)
def test_a_stop_signal_ends_the_command_in_bounded_time_with_its_code(
    tmp_path, behaviour, signals, code, forced, most_s
):
    process, child = _start(behaviour, tmp_path)
    started = time.monotonic()
    for number in signals:
        os.killpg(process.pid, number)  # the foreground group, as a terminal's Ctrl-C
        time.sleep(0.3)
    try:
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        psutil.Process(child).kill() if _alive(child) else None
    seconds = time.monotonic() - started
    assert process.returncode == code, (out, err)
    assert seconds < most_s, f"{seconds:.1f} s\n{out}\n{err}"
    reason = "interrupted by SIGINT (Ctrl-C)" if signals[0] == signal.SIGINT else "stopped by SIGTERM"
    assert f"cleanup: {reason}" in out
    assert ("Stopping at once" in err) == forced, err
    if forced:  # the forced stop killed the child the cleanup never reached
        assert not _alive(child)
    # and told the callbacks of the blocks it stopped why (a block already left has none)
    assert (f"on_force: {reason}; stopped at once" in out) == (behaviour == "cleanup hangs"), out


def test_without_a_signal_the_block_leaves_handlers_and_threads_as_they_were():
    from quantlab import stopping

    before = {number: signal.getsignal(number) for number in stopping.STOP_SIGNALS}
    with stopping.stop_on_signals(print) as watcher:
        assert signal.getsignal(signal.SIGINT) == watcher.handle
    assert {number: signal.getsignal(number) for number in stopping.STOP_SIGNALS} == before
    deadline = time.monotonic() + 5
    while any(thread.name == "stop-watcher" for thread in __import__("threading").enumerate()):
        assert time.monotonic() < deadline, "the watcher thread outlived its block"
        time.sleep(0.05)


# quantlab's own entry point with one more command that has no stop handling of its own (as the sweep command
# before its imports are done): typer turns the KeyboardInterrupt into exit 130, click into "Aborted!" and exit 1.
PLAIN_COMMAND = """
import sys, time
from quantlab import cli

@cli.app.command("nap")
def nap(abort: bool = False) -> None:
    print("ready", flush=True)
    try:
        time.sleep(600)
    except KeyboardInterrupt:
        if abort:
            import typer
            raise typer.Abort() from None
        raise

sys.argv = ["quantlab", "nap", *sys.argv[1:]]
cli.main()
"""


@pytest.mark.parametrize(
    ("sent", "flags", "code", "line"),
    [
        (signal.SIGTERM, [], 143, "Stopped by SIGTERM."),
        (signal.SIGINT, [], 130, "Interrupted by SIGINT (Ctrl-C)."),
        (signal.SIGTERM, ["--abort"], 143, "Stopped by SIGTERM."),
    ],
)
def test_a_command_without_stop_handling_exits_with_the_signals_code(sent, flags, code, line):
    """SIGTERM is 143 wherever it lands: typer's exit 130 for a KeyboardInterrupt no command caught (a scheduler's
    SIGTERM during the sweep command's imports exited 130, in silence) and click's exit 1 are the signal's."""
    process = subprocess.Popen(
        [sys.executable, "-c", PLAIN_COMMAND, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout.readline().strip() == "ready"
    os.killpg(process.pid, sent)
    _, err = process.communicate(timeout=60)
    assert process.returncode == code, err
    assert err.strip().splitlines()[-1] == line


def test_seeded_interrupts_of_tiny_sweeps_stop_cleanly(tmp_path):
    """The benchmark's checks on a handful of trials (the full run is in benchmarks/README.md): exit code, time to
    exit within 30 s, no run RUNNING, every stopped run with its reason, no process left."""
    result = subprocess.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "interrupt_trials.py"),
            "--trials",
            "3",
            "--seed",
            "7",
            "--recipes",
            "core",
            "--neighbours",
            "quiet",
            "--work-dir",
            str(tmp_path / "trials"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "0 failed" in result.stdout


def test_an_error_raised_once_a_stop_signal_was_caught_counts_as_the_stop():
    """A library can turn the KeyboardInterrupt into its own error (pybind11's module init: "ImportError:
    initialization failed", seen when a SIGTERM landed while the recipe check imported scipy): once a stop signal was
    caught, any error is the stop; before it, an error is its own, and a bare KeyboardInterrupt is Ctrl-C's."""
    from quantlab import stopping

    with stopping.stop_on_signals(print) as watcher:
        assert stopping.stopped(ImportError("initialization failed")) is None
        assert stopping.reason(ImportError("initialization failed")) == (
            "the sweep ended on ImportError: initialization failed"
        )
        assert stopping.exit_code(KeyboardInterrupt()) == 130
        watcher.first = signal.SIGTERM  # as the handler records it
        try:
            assert stopping.exit_code(ImportError("initialization failed")) == 143
            assert stopping.reason(ImportError("initialization failed")) == "stopped by SIGTERM"
        finally:
            watcher.first = None  # the block then restores the handlers as after a quiet run


def test_a_stop_whose_first_raise_was_swallowed_is_raised_again_where_the_command_checks():
    from quantlab import stopping

    with stopping.stop_on_signals(print) as watcher:
        stopping.raise_if_stopped()  # no signal: nothing
        watcher.first = signal.SIGINT  # caught, and its Stopped lost (e.g. in an `except ImportError` of a library)
        try:
            with pytest.raises(stopping.Stopped, match=r"interrupted by SIGINT \(Ctrl-C\)"):
                stopping.raise_if_stopped()
        finally:
            watcher.first = None
    stopping.raise_if_stopped()  # outside the block: nothing
