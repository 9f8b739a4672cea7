"""A real OpenAI-compatible server for one checkpoint (its command line comes from quantlab.serving.engines), started
on a free loopback port in a process group of its own, health-checked, and stopped with its whole group.

However the stage ends (done, failed, interrupted) the `with` block stops the group; when the variant's process
dies outright (SIGKILL, or the sweep's death killing it), the group's guard (quantlab.serving.guard) kills it, so
no server, nor any process it forked, outlives the variant that started it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from quantlab.serving.engines.base import HOST

STOP_GRACE_S = 10.0  # SIGTERM, then SIGKILL for what still runs
LOG_TAIL_LINES = 40


class ServerFailed(RuntimeError):
    """The server did not start, did not become healthy, or died; the message ends with its log's tail."""


def free_port() -> int:
    """A loopback port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


def port_taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        return probe.connect_ex((HOST, port)) == 0


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.is_file():
        return "(no log)"
    return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]) or "(empty log)"


def start_group(
    command: Sequence[str], log_path: Path, env: Mapping[str, str], cwd: Path | None = None
) -> subprocess.Popen:
    """`command` in a new process group under a guard (quantlab.serving.guard) that kills the group if this process
    dies; output to `log_path`. The returned process is the guard: it exits as the command does."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    guarded = [sys.executable, "-m", "quantlab.serving.guard", str(os.getpid()), "--", *command]
    with open(log_path, "wb") as log:
        return subprocess.Popen(
            guarded,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
        )


def stop_group(process: subprocess.Popen, grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process's group, SIGKILL what is left after `grace_s`; reaps the leader."""
    for sent in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sent)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and _group_alive(process.pid):
            process.poll()
            time.sleep(0.1)
        if not _group_alive(process.pid):
            break
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace_s)


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class RunningServer:
    engine: str
    url: str
    port: int
    command: tuple[str, ...]
    process: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)  # its start-up time counts from here

    def died(self) -> str | None:
        """Why the server is gone (with its log's tail), or None while it runs."""
        code = self.process.poll()
        if code is None:
            return None
        how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"the {self.engine} server {how}; its log ends:\n{log_tail(self.log_path)}"


@contextlib.contextmanager
def running_server(
    command_for: Callable[[int], list[str]],
    engine: str,
    log_path: Path,
    env: Mapping[str, str],
    startup_timeout_s: float,
    port: int | None = None,
) -> Iterator[RunningServer]:
    """A started, healthy server (GET /health answers 200) on `port` (default: a free one); stopped on exit."""
    with launched_server(command_for, engine, log_path, env, port) as server:
        wait_healthy(server, startup_timeout_s)
        yield server


@contextlib.contextmanager
def launched_server(
    command_for: Callable[[int], list[str]],
    engine: str,
    log_path: Path,
    env: Mapping[str, str],
    port: int | None = None,
) -> Iterator[RunningServer]:
    """A server started on `port` (default: a free one) and not waited for (`wait_healthy`); stopped on exit."""
    port = port or free_port()
    if port_taken(port):
        raise ServerFailed(f"port {port} on {HOST} is taken by another process: the {engine} server cannot listen")
    command = command_for(port)
    if shutil.which(command[0]) is None and not Path(command[0]).exists():
        raise ServerFailed(f"cannot run {command[0]}")
    process = start_group(command, log_path, env)
    try:
        yield RunningServer(engine, f"http://{HOST}:{port}", port, tuple(command), process, log_path)
    finally:
        stop_group(process)


def wait_healthy(server: RunningServer, timeout_s: float) -> None:
    """Returns once GET /health answers 200; ServerFailed when the server dies first, or is not healthy `timeout_s`
    after it was started (a server started early, beside other stages, has had that long). Asked at least once: a
    server started early may be first waited for after its deadline, long healthy."""
    deadline = server.started_at + timeout_s
    while True:
        if (why := server.died()) is not None:
            raise ServerFailed(f"the server stopped before it was healthy: {why}")
        with (
            contextlib.suppress(OSError, urllib.error.URLError),
            urllib.request.urlopen(f"{server.url}/health", timeout=2) as answer,
        ):
            if answer.status == 200:
                return
        if time.monotonic() >= deadline:
            break
        time.sleep(0.25)
    raise ServerFailed(
        f"the {server.engine} server did not answer {server.url}/health within {timeout_s:g} s "
        f"(serving.startup_timeout_s); its log ends:\n{log_tail(server.log_path)}"
    )
