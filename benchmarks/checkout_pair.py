"""One sweep, timed from two checkouts of quantlab in turn, each run from an empty cache and a new store.

Both sides run `python -m quantlab sweep RECIPE` with PYTHONPATH naming their checkout (its `quantlab` package comes
first, before the installed one), in the environment this script was started in (not the variables its own imports
add), alternating which goes first (A B, B A, ...) so that a drift
in the machine's speed does not favour one side. Each run gets a fresh `--cache-dir` and MLflow store: a first sweep
of a model, as every test's sweep is (GGUF conversion, quantizing and the recipe check's model lookups included).

Printed per side: wall seconds (median, min, max) and, read from its MLflow runs, the seconds from the process's
start to its first variant run's start (start-up: imports, the recipe check, the store, the fork server) and from its
last variant run's end to the process's exit (publishing the frontier and report, shutting down); then the ratio
B / A of the wall seconds, pair by pair.

    .venv/bin/python benchmarks/checkout_pair.py --a /tmp/quantlab-before --b .            # tiny random Llama
    .venv/bin/python benchmarks/checkout_pair.py --a /tmp/before --b . --recipe recipes/smollm2-135m.yaml --repeats 1

`--a`/`--b`: checkouts (e.g. `git worktree add /tmp/quantlab-before <commit>`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# As the shell gave it, before this script imports anything: making the tiny model imports torch, transformers and
# sklearn, which set variables of their own (quantlab.executors.SET_BY_IMPORTS) that a user's sweep starts without.
SHELL_ENV = dict(os.environ)

from sweep_overhead import OFFLINE_ENV, save_tiny_llama, summary_line, timed_process  # noqa: E402


@dataclass(frozen=True)
class Timed:
    wall_s: float
    before_first_variant_s: float
    after_last_variant_s: float


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, required=True, help="checkout A (the yardstick)")
    parser.add_argument("--b", type=Path, required=True, help="checkout B")
    parser.add_argument("--recipe", type=Path, help="a recipe (default: the tiny random Llama, bf16 + fp8 + awq)")
    parser.add_argument("--repeats", type=int, default=5, help="pairs of runs (default 5)")
    return parser.parse_args(argv)


def tiny_recipe(work: Path) -> Path:
    """The tests' tiny recipe (tests/recipes.py; sweep_overhead put tests/ on the path): bf16, fp8 and AWQ of a
    random 2-layer Llama, two bundled tasks."""
    from recipes import tiny_recipe as recipe
    from recipes import write

    return write(work / "recipe.yaml", recipe(save_tiny_llama(work / "tiny-llama")))


def run_side(checkout: Path, recipe: Path, work: Path) -> Timed:
    from mlflow.tracking import MlflowClient

    work.mkdir(parents=True)
    store = f"sqlite:///{work / 'store.db'}"
    command = [sys.executable, "-m", "quantlab", "sweep", str(recipe), "--tracking-uri", store]
    ours = dict(os.environ)
    os.environ.clear()
    os.environ.update({**SHELL_ENV, **OFFLINE_ENV, "PYTHONPATH": str(checkout.resolve())})
    try:
        started = time.time()
        wall, _ = timed_process([*command, "--cache-dir", str(work / "cache")], cwd=work)
    finally:
        os.environ.clear()
        os.environ.update(ours)
    ended = started + wall
    client = MlflowClient(store)
    experiments = [experiment.experiment_id for experiment in client.search_experiments()]
    variants = client.search_runs(experiments, "tags.`quantlab.role` = 'variant'")
    first = min(run.info.start_time for run in variants) / 1000
    last = max(run.info.end_time for run in variants) / 1000
    return Timed(wall, first - started, ended - last)


def benchmark(args: argparse.Namespace, work: Path) -> str:
    recipe = (args.recipe or tiny_recipe(work)).resolve()
    sides: dict[str, list[Timed]] = {"A": [], "B": []}
    for repetition in range(args.repeats):
        order = ("A", "B") if repetition % 2 == 0 else ("B", "A")
        for side in order:
            checkout = args.a if side == "A" else args.b
            timed = run_side(checkout, recipe, work / f"{side}-{repetition}")
            sides[side].append(timed)
            print(f"  {repetition + 1}/{args.repeats} {side}: {timed.wall_s:.2f} s", file=sys.stderr, flush=True)
    lines = [f"{'':<34} {'median':>10} {'min':>10} {'max':>10}"]
    for side, checkout in (("A", args.a), ("B", args.b)):
        runs = sides[side]
        lines.append(f"{side}: {checkout}")
        lines.append(summary_line("  wall", [run.wall_s for run in runs]))
        lines.append(summary_line("  start to first variant", [run.before_first_variant_s for run in runs]))
        lines.append(summary_line("  last variant to exit", [run.after_last_variant_s for run in runs]))
    ratios = [b.wall_s / a.wall_s for a, b in zip(sides["A"], sides["B"])]
    lines.append(summary_line("B / A (pair by pair)", ratios, unit=" "))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(OFFLINE_ENV)
    with tempfile.TemporaryDirectory(prefix="checkout-pair-") as work:
        print(f"recipe: {args.recipe or 'tiny random Llama (tests/recipes.py)'}, {args.repeats} pairs")
        print(benchmark(args, Path(work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
