"""How fast does an unchanged sweep run again, and what does remembering the recipe check save?

A first, untimed sweep computes every variant of the recipe. Then each repetition runs the same
`quantlab sweep` twice more, alternating which goes first:
(a) as it is: every variant is copied from the finished runs, and the recipe check reads the
    model's layer widths and lm-eval's task names from `<cache>/recipe-checks`;
(b) with `<cache>/recipe-checks` removed first, so the recipe check reads the model's config
    through transformers and builds lm-eval's task index (~10k YAMLs), as every sweep did
    before the check was remembered.
Printed: wall seconds of each side (median, min, max), the ratio (b)/(a), and the part of (a)
spent in the sweep itself (its parent run's duration in MLflow); the rest is interpreter start,
imports and the recipe check.

    .venv/bin/python benchmarks/unchanged_rerun.py                       # tiny random Llama, bf16 + fp8
    .venv/bin/python benchmarks/unchanged_rerun.py --recipe recipes/smollm2-135m.yaml \\
        --work-dir /tmp/rerun                                            # the first sweep takes ~10 min
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml
from sweep_overhead import EVALS_DIR, run_benchmark, save_tiny_llama, summary_line, timed_process


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--recipe", type=Path, help="recipe to sweep (default: a tiny random Llama, bf16 + fp8, built here)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed pairs (default 3)")
    parser.add_argument("--work-dir", type=Path, help="keep the store and cache here (default: a temporary directory)")
    return parser.parse_args(argv)


def tiny_recipe(work: Path) -> Path:
    recipe = {
        "name": "unchanged-rerun",
        "model": {"source": str(save_tiny_llama(work / "tiny-llama"))},
        "baseline": "bf16",
        "variants": [{"name": "bf16", "method": "bf16"}, {"name": "fp8", "method": "fp8"}],
        "evals": {"include_path": str(EVALS_DIR), "batch_size": 8, "tasks": [{"name": "mmlu_dev", "limit": 8}]},
        "quality": {"max_tokens": 128, "window": 64},
        "measure": {"prompt_tokens": 8, "output_tokens": 4, "repeats": 1, "warmup": 0},
    }
    path = work / "unchanged-rerun.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def sweep(recipe: Path, work: Path) -> tuple[float, float]:
    """Wall seconds of one `quantlab sweep`, and the duration of the parent run it logged."""
    from quantlab import tracking

    store = f"sqlite:///{work / 'store.db'}"
    seconds, _ = timed_process(
        [
            sys.executable,
            "-m",
            "quantlab",
            "sweep",
            str(recipe.resolve()),
            "--tracking-uri",
            store,
            "--cache-dir",
            str(work / "cache"),
        ],
        work,
    )
    parent = tracking.latest_sweep(tracking.open_store(store), yaml.safe_load(recipe.read_text())["name"])
    return seconds, (parent.end_time - parent.start_time) / 1000


def benchmark(args: argparse.Namespace, work: Path) -> str:
    recipe = args.recipe or tiny_recipe(work)
    print(f"first sweep of {recipe} (untimed)", file=sys.stderr)
    first, _ = sweep(recipe, work)
    remembered, rebuilt, inside = [], [], []
    load_before = os.getloadavg()[0]
    for index in range(args.repeats):
        print(f"repetition {index + 1}/{args.repeats}", file=sys.stderr)
        for side in ("a", "b") if index % 2 == 0 else ("b", "a"):
            if side == "b":
                shutil.rmtree(work / "cache" / "recipe-checks", ignore_errors=True)
                rebuilt.append(sweep(recipe, work)[0])
            else:
                seconds, parent_seconds = sweep(recipe, work)
                remembered.append(seconds)
                inside.append(parent_seconds)
    return "\n".join(
        [
            f"recipe: {recipe}; first sweep {first:.1f} s; {args.repeats} interleaved pairs",
            f"1-minute load average {load_before:.2f} before the timed runs, {os.getloadavg()[0]:.2f} after",
            f"{'':<34} {'median':>10} {'min':>10} {'max':>10}",
            summary_line("(a) unchanged, check remembered", remembered),
            summary_line("(b) unchanged, check from scratch", rebuilt),
            summary_line("(a) of which the sweep itself", inside),
            f"ratio (b)/(a) of the medians: {statistics.median(rebuilt) / statistics.median(remembered):.2f}",
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_benchmark(benchmark, parse_args(argv), "quantlab-unchanged-rerun-")


if __name__ == "__main__":
    sys.exit(main())
