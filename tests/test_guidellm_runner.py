"""quantlab.serving.guidellm_runner, the process a serve stage's load runs in: its fork server's CPU time stays in the
stage's process tree (quantlab.measure.contention counts the tree's time as the stage's own, the rest as other work)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil

from quantlab.serving.load import guidellm_environment


def _cpu(times) -> float:
    return times.user + times.system


def _children_cpu() -> float:
    times = psutil.Process().cpu_times()
    return times.children_user + times.children_system


def test_the_fork_servers_cpu_time_is_counted_as_the_runners_own(tmp_path):
    """Orphaned at the runner's exit, the fork server (which imported guidellm's scheduler for every load run) would
    take its CPU time, and its workers', out of the tree: the runner stops and reaps it, so once the runner is reaped
    its time is this process's children's. A scenario guidellm cannot run makes the runner exit right after READY."""
    ready, scenario = tmp_path / "imported", tmp_path / "scenario.json"
    before = _children_cpu()
    command = [sys.executable, "-m", "quantlab.serving.guidellm_runner", str(ready), str(scenario)]
    env = {**os.environ, **guidellm_environment(1)}
    with open(tmp_path / "runner.log", "w") as log:
        runner = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while not ready.exists():
        assert runner.poll() is None and time.monotonic() < deadline, (tmp_path / "runner.log").read_text()
        time.sleep(0.1)
    found = psutil.Process(runner.pid)
    (fork_server,) = [child for child in found.children() if "forkserver" in " ".join(child.cmdline())]
    fork_server_cpu, runner_cpu = _cpu(fork_server.cpu_times()), _cpu(found.cpu_times())
    assert fork_server_cpu > 0.5  # its preload: guidellm's scheduler and backends

    scenario.write_text("{}")  # no target: guidellm refuses it
    assert runner.wait(timeout=300) != 0

    counted = _children_cpu() - before
    assert counted >= runner_cpu + 0.9 * fork_server_cpu, (counted, runner_cpu, fork_server_cpu)
    assert not fork_server.is_running()
