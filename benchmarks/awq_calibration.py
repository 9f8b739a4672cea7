"""What does AWQ's calibration cost, and what does it buy? Time against damage on the embedded model.

For each calibration setting (samples x sequence length) and AWQ grid size (`n_grid`, the scales tried per layer
mapping) one `quantlab sweep` of the embedded recipe's
BF16 baseline and its AWQ INT4 group-64 variant, nothing else: no lm-eval tasks, no cost measurement,
the recipe's own token-damage corpus and windows. Every setting quantizes afresh (its calibration is
part of the checkpoint's identity); the baseline and its reference pass are computed by the first sweep
and reused by the others. Printed per setting: the quantize stage's seconds (calibration and the AWQ
grid search; the GGUF conversion is the "prepare model" stage, paid once), and the damage the
variant logged against BF16: mean KL, top-1 agreement, perplexity (BF16's beside it).

    .venv/bin/python benchmarks/awq_calibration.py                                  # the default grid, ~15 min
    .venv/bin/python benchmarks/awq_calibration.py --setting 8x128 --setting 16x256
    .venv/bin/python benchmarks/awq_calibration.py --setting 8x128 --n-grid 20 --n-grid 10
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml
from sweep_overhead import REPO, run_benchmark, timed_process

EMBEDDED_RECIPE = REPO / "recipes" / "smollm2-135m.yaml"
AWQ = "awq-int4-g64"
DEFAULT_SETTINGS = ("4x128", "8x128", "16x128", "8x256", "16x256")


def setting(text: str) -> tuple[int, int]:
    samples, _, length = text.partition("x")
    try:
        return int(samples), int(length)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected SAMPLESxSEQ_LEN, e.g. 16x256") from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--setting",
        type=setting,
        action="append",
        help=f"calibration samples x sequence length (repeatable; default {', '.join(DEFAULT_SETTINGS)})",
    )
    parser.add_argument(
        "--n-grid", type=int, action="append", help="AWQ's grid size (repeatable; default the recipe's)"
    )
    parser.add_argument("--work-dir", type=Path, help="keep the store and cache here (default: a temporary directory)")
    args = parser.parse_args(argv)
    args.setting = args.setting or [setting(text) for text in DEFAULT_SETTINGS]
    args.n_grid = args.n_grid or [None]
    return args


def write_recipe(work: Path, samples: int, length: int, n_grid: int | None) -> Path:
    recipe = yaml.safe_load(EMBEDDED_RECIPE.read_text())
    variants = [variant for variant in recipe["variants"] if variant["name"] in ("bf16", AWQ)]
    for variant in variants:
        if variant["name"] == AWQ and n_grid is not None:
            variant["params"] = variant.get("params", {}) | {"n_grid": n_grid}
    recipe |= {
        "name": "awq-calibration",
        "variants": variants,
        "calibration": recipe["calibration"] | {"num_samples": samples, "seq_len": length},
        "evals": {"tasks": []},
        "measure": {"enabled": False},
    }
    path = work / "awq-calibration.yaml"  # its pkg:// model source resolves from anywhere
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def benchmark(args: argparse.Namespace, work: Path) -> str:
    from quantlab import tracking

    store = f"sqlite:///{work / 'store.db'}"
    rows, baseline_ppl = [], None
    load_before = os.getloadavg()[0]
    for (samples, length), n_grid in ((each, grid) for each in args.setting for grid in args.n_grid):
        print(f"calibration {samples} x {length}, n_grid {n_grid or 'as the recipe'}", file=sys.stderr)
        recipe = write_recipe(work, samples, length, n_grid)
        command = [sys.executable, "-m", "quantlab", "sweep", str(recipe), "--tracking-uri", store]
        seconds, _ = timed_process([*command, "--cache-dir", str(work / "cache")], work)
        opened = tracking.open_store(store)
        sweep = tracking.latest_sweep(opened, "awq-calibration")
        runs = {run.variant: run for run in tracking.child_runs(opened, sweep.run_id)}
        awq, bf16 = runs[AWQ].metrics, runs["bf16"].metrics
        baseline_ppl = bf16["quality/ppl"]
        grid = runs[AWQ].params.get("variant.params.n_grid", "?")
        rows.append(
            f"| {samples} x {length} | {grid} | {samples * length:,} | {awq['time/quantize_seconds']:.1f} | {seconds:.0f} "
            f"| {awq['quality/kld_mean']:.4f} | {awq['quality/top1_agreement']:.4f} | {awq['quality/ppl']:.3f} |"
        )
    return "\n".join(
        [
            f"embedded model, {AWQ}; 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after",
            f"BF16 perplexity on the recipe's corpus: {baseline_ppl:.3f}",
            "sweep wall s: the whole `quantlab sweep` process; the first also converts the GGUF and runs the baseline",
            "",
            "| calibration | n_grid | tokens | quantize s | sweep wall s | KL mean | top-1 agreement | perplexity |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_benchmark(benchmark, parse_args(argv), "quantlab-awq-calibration-")


if __name__ == "__main__":
    sys.exit(main())
