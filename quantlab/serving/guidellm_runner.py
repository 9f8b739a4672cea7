"""`python -m quantlab.serving.guidellm_runner READY SCENARIOS`: guidellm's `run`, imported before its scenarios exist,
for as many scenarios as it is handed.

Most of guidellm's start is its import (its tokenizer module brings torch and transformers), and guidellm starts a
manager and workers again for every load run, each from its fork server (GUIDELLM__MP_CONTEXT_TYPE), which imports
guidellm's scheduler and backends once for the whole load. Started early, beside the variant's other stages and its
server's own start, this process does both imports first (its own, and the fork server's, preloaded and waited for),
says so (creates the file READY), then runs `guidellm run --scenario` in this process, as `python -m guidellm run`
would, on each scenario in turn: SCENARIOS-1.json, SCENARIOS-2.json, ..., writing guidellm's exit code to
SCENARIOS-<n>.exit after each, until the file SCENARIOS.end appears. One import then serves a variant's every load
run: the rounds of its levels (quantlab.stages.serve) and their re-runs. quantlab.serving.load.LoadGenerator drives
it; benchmarks/guidellm_runs.py measures what the preload takes off the timed load.

The top level imports only what guidellm's own __main__ does: the fork server re-imports the main module, which
should stay as light as guidellm's. Standard library otherwise, and quantlab.serving.load_queue (the files' names,
standard library only).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import sys
import time
from pathlib import Path

from guidellm.cli import cli

from quantlab.serving.load_queue import end_file, exit_file, scenario_file, write_whole

POLL_S = 0.05
# What each load run's manager and workers import in guidellm's fork server, once, before the first run.
FORK_SERVER_PRELOAD = ["guidellm.benchmark.entrypoints", "guidellm.scheduler.worker_group", "guidellm.backends"]


def start_fork_server() -> None:
    """guidellm's fork server, started now and done importing FORK_SERVER_PRELOAD: a process forked from it returns
    only once the server has imported its preload (the standard library's forkserver)."""
    multiprocessing.set_forkserver_preload(FORK_SERVER_PRELOAD)
    first = multiprocessing.get_context("forkserver").Process(target=time.sleep, args=(0,))
    first.start()
    first.join()


def stop_fork_server() -> None:
    """Stops the fork server and waits for it. Left to outlive this process, it would be orphaned, and its CPU time,
    with that of every manager and worker it forked (it reaps them), would leave the serve stage's process tree:
    counted as other work, not the load's own (quantlab.measure.contention)."""
    # The standard library's only way to stop its fork server and reap it (multiprocessing's own tests use it).
    multiprocessing.forkserver._forkserver._stop()


def run_scenario(path: Path) -> int:
    """guidellm's exit code for `guidellm run --scenario path` (click's standalone mode exits with it)."""
    try:
        cli.main(["run", "--scenario", str(path), "--disable-console-interactive"], prog_name="guidellm")
    except SystemExit as exit:
        code = exit.code
        return code if isinstance(code, int) else 0 if code is None else 1
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m quantlab.serving.guidellm_runner READY SCENARIOS", file=sys.stderr)
        return 2
    ready, prefix = (Path(arg) for arg in argv)
    # What `guidellm run` imports once it starts (its benchmark entry point, the data loaders and the tokenizer).
    import guidellm.benchmark.entrypoints  # noqa: F401

    start_fork_server()
    ready.touch()
    try:
        number = 1
        while not end_file(prefix).exists():
            scenario = scenario_file(prefix, number)
            if not scenario.exists():  # written whole (renamed into place) once the server is ready and warmed up
                time.sleep(POLL_S)
                continue
            write_whole(exit_file(prefix, number), str(run_scenario(scenario)))
            number += 1
    finally:
        stop_fork_server()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
