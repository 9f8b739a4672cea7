"""Where does a sweep's time go? A profile by stage and inside the stages.

(1) Imports: each heavy library imported alone in a fresh interpreter, minus the interpreter's own
    start; a variant process of the local executor pays these again (forkserver aside).
(2) One sweep of the recipe (default: the embedded one) with the in-process executor under cProfile,
    in a fresh store and cache (or `--cache-dir`, e.g. to skip the GGUF conversion). Printed: the
    cumulative seconds and calls of the functions that make up a sweep (recipe checks, model
    preparation, calibration, llm-compressor, loading, lm-eval's task index, requests and forward
    passes, the baseline's reference pass, KL, measurement, MLflow logging, publishing), summed over
    the variants, and every variant's stage times as its MLflow run logged them.

    .venv/bin/python benchmarks/profile_sweep.py                          # embedded recipe, ~10 min on 2 cores
    .venv/bin/python benchmarks/profile_sweep.py --recipe my.yaml --pstats sweep.pstats
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from sweep_overhead import OFFLINE_ENV, REPO, run_benchmark

IMPORTS = {
    "quantlab CLI": "import quantlab.cli",
    "torch": "import torch",
    "transformers (+ causal LM auto class)": "from transformers import AutoModelForCausalLM",
    "lm-eval (evaluator + HF model)": "import lm_eval.evaluator, lm_eval.models.huggingface",
    "llm-compressor": "import llmcompressor",
    "mlflow": "import mlflow",
}
# (what, file path suffix, function name, indent): the functions whose cumulative time the table shows.
PROFILED = [
    ("recipe checks (the CLI, before the sweep)", "quantlab/checks.py", "validate", 0),
    ("whole sweep", "quantlab/sweep.py", "run_sweep", 0),
    ("prepare model (GGUF -> HF)", "quantlab/models.py", "materialize", 1),
    ("quantize stage", "quantlab/stages/quantize.py", "quantize_variant", 1),
    ("calibration samples", "quantlab/stages/calibration.py", "calibration_dataset", 2),
    ("llm-compressor oneshot", "llmcompressor/entrypoints/oneshot.py", "oneshot", 2),
    ("load checkpoint", "quantlab/models.py", "load_checkpoint", 1),
    ("evaluate stage", "quantlab/stages/evaluate.py", "evaluate_tasks", 1),
    ("lm-eval task index (TaskManager)", "lm_eval/tasks/manager.py", "__init__", 2),
    ("lm-eval simple_evaluate", "lm_eval/evaluator.py", "simple_evaluate", 2),
    ("building requests", "lm_eval/api/task.py", "build_all_requests", 3),
    ("loglikelihood forward passes", "lm_eval/models/huggingface.py", "_loglikelihood_tokens", 3),
    ("token damage stage", "quantlab/stages/evaluate.py", "token_damage", 1),
    ("baseline reference pass", "quantlab/evaluate/reference.py", "write_reference", 2),
    ("variant vs reference (KL)", "quantlab/evaluate/reference.py", "compare_tokens", 2),
    ("measure stage", "quantlab/measure/cost.py", "measure_cost", 1),
    ("MLflow: log a variant", "quantlab/tracking.py", "log_variant", 1),
    ("publish (frontier, report, plots)", "quantlab/publish.py", "publish_sweep", 1),
]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2-135m.yaml")
    parser.add_argument("--cache-dir", type=Path, help="checkpoint cache (default: a fresh one in the work dir)")
    parser.add_argument("--pstats", type=Path, help="also save the raw profile here (for snakeviz, pstats)")
    parser.add_argument("--work-dir", type=Path, help="keep the store and cache here (default: a temporary directory)")
    return parser.parse_args(argv)


def import_seconds(statement: str) -> float:
    """Median wall seconds of a fresh interpreter running `statement`, less one running `pass`, over 3 runs."""

    def run(code: str) -> float:
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, **OFFLINE_ENV})
        return time.perf_counter() - started

    samples = sorted(run(statement) - run("pass") for _ in range(3))
    return samples[1]


def profiled_rows(profile: pstats.Stats) -> list[str]:
    found: dict[str, tuple[int, float]] = {}
    for (path, _, name), (_, calls, _, cumulative, _) in profile.stats.items():  # type: ignore[attr-defined]
        for what, suffix, function, _ in PROFILED:
            if name == function and path.replace(os.sep, "/").endswith(suffix):
                seen_calls, seen = found.get(what, (0, 0.0))
                found[what] = (seen_calls + calls, max(seen, cumulative))
    return [
        f"| {'&nbsp;' * 4 * indent}{what} | {found[what][1]:.1f} | {found[what][0]} |"
        if what in found
        else f"| {'&nbsp;' * 4 * indent}{what} | - | 0 |"
        for what, _, _, indent in PROFILED
    ]


def benchmark(args: argparse.Namespace, work: Path) -> str:
    from quantlab import tracking
    from quantlab.cli import app

    load_before = os.getloadavg()[0]
    print("timing imports", file=sys.stderr)
    imports = [f"| {what} | {import_seconds(statement):.2f} |" for what, statement in IMPORTS.items()]
    store = f"sqlite:///{work / 'store.db'}"
    command = ["sweep", str(args.recipe.resolve()), "--executor", "inprocess", "--tracking-uri", store]
    command += ["--cache-dir", str(args.cache_dir or work / "cache")]
    print(f"profiling quantlab {' '.join(command)}", file=sys.stderr)
    profiler = cProfile.Profile()
    started = time.perf_counter()
    profiler.enable()
    try:
        app(command, standalone_mode=False)
    finally:
        profiler.disable()
    wall = time.perf_counter() - started
    if args.pstats:
        profiler.dump_stats(args.pstats)
    opened = tracking.open_store(store)
    stages = []
    for run in tracking.child_runs(opened, tracking.latest_sweep(opened, None).run_id):
        times = {key[5:-8]: value for key, value in run.metrics.items() if key.startswith("time/")}
        stages.append(
            f"| {run.variant} | " + ", ".join(f"{stage} {value:.1f}" for stage, value in times.items()) + " |"
        )
    return "\n".join(
        [
            f"recipe {args.recipe.name}; 1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after",
            "",
            "| import, in a fresh interpreter | seconds |",
            "|---|---:|",
            *imports,
            "",
            f"In-process sweep under cProfile: {wall:.0f} s wall (cProfile adds its own overhead to Python-heavy code)",
            "",
            "| where | cumulative seconds | calls |",
            "|---|---:|---:|",
            *profiled_rows(pstats.Stats(profiler)),
            "",
            "| variant | stage seconds (its MLflow run) |",
            "|---|---|",
            *stages,
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_benchmark(benchmark, parse_args(argv), "quantlab-profile-")


if __name__ == "__main__":
    sys.exit(main())
