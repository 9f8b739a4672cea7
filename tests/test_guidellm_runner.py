"""quantlab.serving.guidellm_runner, the process a serve stage's load runs in: its fork server's CPU time stays in the
stage's process tree (quantlab.measure.contention counts the tree's time as the stage's own, the rest as other work)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from quantlab.serving.load import guidellm_environment
from quantlab.serving.load_queue import end_file, exit_file, scenario_file, write_whole


def _cpu(times) -> float:
    return times.user + times.system


def _children_cpu() -> float:
    times = psutil.Process().cpu_times()
    return times.children_user + times.children_system


def test_the_fork_servers_cpu_time_is_counted_as_the_runners_own(tmp_path):
    """Orphaned at the runner's exit, the fork server (which imported guidellm's scheduler for every load run) would
    take its CPU time, and its workers', out of the tree: the runner stops and reaps it, so once the runner is reaped
    its time is this process's children's. A scenario guidellm cannot run gets its exit code, and the runner waits for
    the next one until told to end."""
    ready, scenarios = tmp_path / "imported", tmp_path / "scenario"
    before = _children_cpu()
    command = [sys.executable, "-m", "quantlab.serving.guidellm_runner", str(ready), str(scenarios)]
    env = {**os.environ, **guidellm_environment(1)}
    with open(tmp_path / "runner.log", "w") as log:
        runner = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    _wait_for(ready.exists, runner, tmp_path)
    found = psutil.Process(runner.pid)
    (fork_server,) = [child for child in found.children() if "forkserver" in " ".join(child.cmdline())]
    fork_server_cpu = _cpu(fork_server.cpu_times())
    assert fork_server_cpu > 0.5  # its preload: guidellm's scheduler and backends

    write_whole(scenario_file(scenarios, 1), "{}")  # no target: guidellm refuses it
    _wait_for(exit_file(scenarios, 1).exists, runner, tmp_path)
    assert int(exit_file(scenarios, 1).read_text()) != 0
    assert runner.poll() is None and fork_server.is_running()  # waiting for the next scenario
    runner_cpu = _cpu(found.cpu_times())

    end_file(scenarios).touch()
    assert runner.wait(timeout=60) == 0
    counted = _children_cpu() - before
    assert counted >= runner_cpu + 0.9 * fork_server_cpu, (counted, runner_cpu, fork_server_cpu)
    assert not fork_server.is_running()


def _wait_for(condition, runner: subprocess.Popen, tmp_path) -> None:
    deadline = time.monotonic() + 300
    while not condition():
        assert runner.poll() is None and time.monotonic() < deadline, (tmp_path / "runner.log").read_text()
        time.sleep(0.1)
