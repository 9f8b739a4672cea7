"""Does running two variants side by side beat running them one after the other on this machine?

Issue 15's overlap question for a CPU: while one variant evaluates, should the next one start? Two
evaluations of the embedded model (quantlab's own `run_tasks`, the embedded recipe's task and limit)
run in separate processes, as a sweep's variants do, in two ways, in one run of this script:

  one after the other: each process with all the cores (torch threads = cores), as a sweep runs now
  side by side:        both processes at once, the cores split between them

Each process imports and loads before a barrier; the time is from the barrier to the last process's
end, so imports and loading count in neither. The order alternates over `--repeats` for the drift
of the machine. Printed: seconds per way and the ratio side-by-side / one-after-the-other (below 1:
overlap would pay on this CPU).

    .venv/bin/python benchmarks/overlap.py
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sweep_overhead import EVALS_DIR, OFFLINE_ENV, REPO


def _evaluate(checkpoint: str, task: str, limit: int, threads: int, start, done) -> None:
    os.environ.update(OFFLINE_ENV)
    import torch

    from quantlab.evaluate.lm_eval_runner import TaskRequest, run_tasks, task_manager
    from quantlab.models import load_checkpoint

    torch.set_num_threads(threads)
    task_manager(EVALS_DIR)
    model, tokenizer = load_checkpoint(Path(checkpoint), torch.float32, "cpu")
    start.wait()
    run_tasks(model, tokenizer, [TaskRequest(task, limit=limit)], EVALS_DIR, 16)
    done.put(time.perf_counter())


def _timed(checkpoint: str, task: str, limit: int, threads: int, jobs: int) -> float:
    """Seconds from the barrier until the last of `jobs` processes (started together) is done."""
    context = multiprocessing.get_context("spawn")
    start, done = context.Barrier(jobs + 1), context.Queue()
    processes = [
        context.Process(target=_evaluate, args=(checkpoint, task, limit, threads, start, done)) for _ in range(jobs)
    ]
    for process in processes:
        process.start()
    start.wait()
    began = time.perf_counter()
    ends = [done.get() for _ in processes]
    for process in processes:
        process.join()
        if process.exitcode:
            raise SystemExit(f"an evaluation process failed (exit {process.exitcode})")
    return max(ends) - began


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="pydoc_cloze", help="lm-eval task (default pydoc_cloze)")
    parser.add_argument("--limit", type=int, default=40, help="documents per evaluation (default 40)")
    parser.add_argument("--repeats", type=int, default=2, help="pairs of measurements (default 2)")
    args = parser.parse_args(argv)
    os.environ.update(OFFLINE_ENV)
    import yaml

    from quantlab.measure.provenance import cpu_model_name, visible_cores
    from quantlab.models import materialize, resolve_source
    from quantlab.recipe import ModelSpec

    cores = visible_cores()
    if cores < 2:
        raise SystemExit("side by side needs at least 2 cores")
    embedded = yaml.safe_load((REPO / "recipes" / "smollm2-135m.yaml").read_text())["model"]
    with tempfile.TemporaryDirectory(prefix="quantlab-overlap-") as scratch:
        source = materialize(resolve_source(ModelSpec(**embedded), REPO / "recipes"), Path(scratch))
        load_before = os.getloadavg()[0]
        sequential, side_by_side = [], []
        for repeat in range(args.repeats):
            ways = [
                (sequential, lambda: sum(_timed(source.location, args.task, args.limit, cores, 1) for _ in range(2))),
                (side_by_side, lambda: _timed(source.location, args.task, args.limit, cores // 2, 2)),
            ]
            for seconds, measure in ways if repeat % 2 == 0 else reversed(ways):
                seconds.append(measure())
        load_after = os.getloadavg()[0]
    one_after, together = statistics.median(sequential), statistics.median(side_by_side)
    print(f"embedded model, two evaluations of lm-eval {args.task} limit {args.limit} (batch 16, float32)")
    print(
        f"machine: {cpu_model_name()}, {cores} cores; 1-minute load average {load_before:.2f} before, {load_after:.2f} after"
    )
    print(f"one after the other ({cores} threads each): {', '.join(f'{s:.1f}' for s in sequential)} s")
    print(f"side by side ({cores // 2} threads each):      {', '.join(f'{s:.1f}' for s in side_by_side)} s")
    print(f"side by side / one after the other (medians): {together / one_after:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
