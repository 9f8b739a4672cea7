"""`python -m quantlab.serving.guidellm_runner READY SCENARIO`: guidellm's `run`, imported before its scenario exists.

Most of guidellm's start is its import (its tokenizer module brings torch and transformers), and guidellm starts a
manager and workers again for every load run, each from its fork server (GUIDELLM__MP_CONTEXT_TYPE), which imports
guidellm's scheduler and backends once for the whole load. Started early, beside the variant's other stages and its
server's own start, this process does both imports first (its own, and the fork server's, preloaded and waited for),
says so (creates the file READY), then waits for the file SCENARIO and runs `guidellm run --scenario` on it, in this
process, as `python -m guidellm run` would. quantlab.serving.load.LoadGenerator drives it; benchmarks/guidellm_runs.py
measures what the preload takes off the timed load.

The top level imports only what guidellm's own __main__ does: the fork server re-imports the main module, which
should stay as light as guidellm's. Standard library otherwise: run as a script there, this file cannot import
quantlab.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import sys
import time
from pathlib import Path

from guidellm.cli import cli

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


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m quantlab.serving.guidellm_runner READY SCENARIO", file=sys.stderr)
        return 2
    ready, scenario = (Path(arg) for arg in argv)
    # What `guidellm run` imports once it starts (its benchmark entry point, the data loaders and the tokenizer).
    import guidellm.benchmark.entrypoints  # noqa: F401

    start_fork_server()
    ready.touch()
    while not scenario.exists():  # written whole (renamed into place) once the server is ready and warmed up
        time.sleep(POLL_S)
    try:  # exits the process with guidellm's own exit code (click's standalone mode)
        cli.main(["run", "--scenario", str(scenario), "--disable-console-interactive"], prog_name="guidellm")
    finally:
        stop_fork_server()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
