"""Does `quantlab sweep --parallel 2` finish sooner than one variant at a time, with the same numbers?

Issue 15's overlap on a CPU: after the baseline, the local executor can run two variants at once (one
quantizes or evaluates while the other does); they split the cores through their seats on the host, and
each measure stage times alone (the other pauses at its next forward pass). Whether that pays depends on
how well one variant alone uses the cores. This script sweeps the same recipe twice from identical caches
(the model source's conversion only) into separate stores: `--parallel 1`, then `--parallel 2`, and prints
both sweeps' wall times and their ratio, each variant's stage times, each variant's contention verdict
(it should stay false: the timing lock), and the logged quality figures side by side (they should agree
within the float noise of other thread counts).

    .venv/bin/python benchmarks/parallel_sweep.py                       # the embedded recipe: about 10 min
    .venv/bin/python benchmarks/parallel_sweep.py --model tiny --limit 4  # a check that it runs

Run it alone on the machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml
from concurrent_sweeps import EMBEDDED_RECIPE, SweepRun, add_folder_arguments, contention_lines, prime, write_recipe
from sweep_overhead import run_benchmark

QUALITY = ("quality/ppl", "quality/kl_mean", "quality/top1_agreement")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=EMBEDDED_RECIPE, help="recipe to sweep (default: embedded)")
    parser.add_argument("--model", choices=("embedded", "tiny"), default="embedded", help="tiny: a random Llama")
    parser.add_argument("--limit", type=int, default=0, help="documents per eval task, at most (0: the recipe's)")
    parser.add_argument("--parallel", type=int, default=2, help="variants at once in the second sweep (default 2)")
    add_folder_arguments(parser)
    args = parser.parse_args(argv)
    if args.model == "tiny":
        args.recipe = None  # write_recipe's tiny recipe
    return args


def benchmark(args: argparse.Namespace, work: Path) -> str:
    recipe = write_recipe(args, work)
    experiment = yaml.safe_load(recipe.read_text())["name"]
    runs = [
        SweepRun("parallel 1", work / "parallel-1"),
        SweepRun(
            f"parallel {args.parallel}", work / f"parallel-{args.parallel}", options=["--parallel", str(args.parallel)]
        ),
    ]
    primed = work / "primed-cache"
    print(f"priming {primed} with the model source's conversion", file=sys.stderr)
    prime(recipe, args.source_cache, primed)
    load_before = os.getloadavg()[0]
    for run in runs:
        run.folder.mkdir(parents=True, exist_ok=True)
        shutil.copytree(primed, run.cache, symlinks=True, dirs_exist_ok=True)
        print(f"sweep: {run.label}", file=sys.stderr)
        run.finish(*run.start(recipe))
        run.read(experiment)
    one, many = runs
    lines = [
        f"recipe: {recipe} (experiment {experiment}); {len(os.sched_getaffinity(0))} visible cores",
        f"1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after",
        "",
        f"{'sweep':<12} {'wall':>8}",
        *(f"{run.label:<12} {run.wall_seconds:>7.1f}s" for run in runs),
        f"ratio {many.label} / {one.label}: {many.wall_seconds / one.wall_seconds:.3f}",
        "",
        f"{'variant':<14} {'stage':<14} {one.label:>12} {many.label:>12}",
    ]
    for variant, stages in one.stages.items():
        for stage, seconds in stages.items():
            other = many.stages.get(variant, {}).get(stage)
            shown = f"{other:>11.1f}s" if other is not None else f"{'-':>12}"
            lines.append(f"{variant:<14} {stage:<14} {seconds:>11.1f}s {shown}")
    lines += ["", f"{'variant':<14} {'figure':<24} {one.label:>12} {many.label:>12}"]
    for variant, metrics in one.metrics.items():
        for key in (*QUALITY, *sorted(k for k in metrics if k.startswith("eval/") and k.endswith("/acc"))):
            if key in metrics and key in many.metrics.get(variant, {}):
                lines.append(f"{variant:<14} {key:<24} {metrics[key]:>12.5g} {many.metrics[variant][key]:>12.5g}")
    return "\n".join([*lines, "", *contention_lines(runs)])


def main(argv: Sequence[str] | None = None) -> int:
    return run_benchmark(benchmark, parse_args(argv), "quantlab-parallel-sweep-")


if __name__ == "__main__":
    sys.exit(main())
