"""Is every stage honest under load? One sweep alone, then the same sweep three times at once on this machine.

Three sweeps at once share the cores: a stage that takes 3x its time alone got its fair share of the machine;
more than that is what thread oversubscription costs (every variant process running torch / OpenMP on every
core, so its threads wait for each other on busy cores). Printed per variant and stage: seconds alone, seconds
in each of the concurrent sweeps, the worst of them as a ratio to the fair share (3x alone), and whether it
is within `--max-ratio` (default 1.2); then the same per stage over all variants, and whether the measure
stage flagged its timing as contended (it should when three run at once, and should not alone).

Nothing is shared or reused between the sweeps: each has its own MLflow store and its own cache directory
(`--cache-dir`, and QUANTLAB_CACHE_DIR), into which the model source's conversion (`sources/`, e.g. the
embedded GGUF converted to a checkpoint) is copied from a primed cache first, so that every sweep quantizes,
evaluates and measures from scratch and none converts the GGUF. The primed cache starts from the user's
(`--source-cache`, default QUANTLAB_CACHE_DIR or ~/.cache/quantlab) when it holds the conversion.

    .venv/bin/python benchmarks/concurrent_sweeps.py                    # mini embedded recipe: bf16 + fp8, limits 20
    .venv/bin/python benchmarks/concurrent_sweeps.py --split-threads    # each concurrent sweep: QUANTLAB_THREADS=cores/3
    .venv/bin/python benchmarks/concurrent_sweeps.py --recipe recipes/smollm2-135m.yaml --limit 0
    .venv/bin/python benchmarks/concurrent_sweeps.py --model tiny --limit 4 --copies 2   # a quick check, ~2 min
    .venv/bin/python benchmarks/concurrent_sweeps.py --dry-run          # the plan only: recipe, folders, commands

Run it on a machine nothing else uses: the point is the ratio between its own sweeps.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from sweep_overhead import EVALS_DIR, OFFLINE_ENV, REPO, run_benchmark  # puts tests/ on sys.path
from tiny import save_tiny_llama

from quantlab.cache import default_root

EMBEDDED_RECIPE = REPO / "recipes" / "smollm2-135m.yaml"
MINI_VARIANTS = ("bf16", "fp8")


@dataclass
class SweepRun:
    """One `quantlab sweep` of the benchmark, in a folder of its own."""

    label: str
    folder: Path
    env: dict[str, str] = field(default_factory=dict)
    options: list[str] = field(default_factory=list)  # more `quantlab sweep` options, e.g. ["--parallel", "2"]
    wall_seconds: float = 0.0
    # variant -> stage -> seconds (time/<stage>_seconds); variant -> its contention verdict (tag), load average
    stages: dict[str, dict[str, float]] = field(default_factory=dict)
    contended: dict[str, str] = field(default_factory=dict)
    load: dict[str, float] = field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # variant -> every metric it logged

    @property
    def store(self) -> str:
        return f"sqlite:///{self.folder / 'store.db'}"

    @property
    def cache(self) -> Path:
        return self.folder / "cache"

    def command(self, recipe: Path) -> list[str]:
        return [
            sys.executable, "-m", "quantlab", "sweep", str(recipe),
            "--tracking-uri", self.store, "--cache-dir", str(self.cache), *self.options,
        ]  # fmt: skip

    def start(self, recipe: Path) -> tuple[subprocess.Popen, float]:
        env = {**os.environ, **OFFLINE_ENV, "QUANTLAB_CACHE_DIR": str(self.cache), **self.env}
        output = (self.folder / "sweep.out").open("w")
        process = subprocess.Popen(
            self.command(recipe), cwd=self.folder, stdout=output, stderr=subprocess.STDOUT, env=env
        )
        output.close()
        return process, time.perf_counter()

    def finish(self, process: subprocess.Popen, started: float) -> None:
        code = process.wait()
        self.wall_seconds = time.perf_counter() - started
        if code != 0:
            tail = (self.folder / "sweep.out").read_text(errors="replace")[-3000:]
            raise SystemExit(f"sweep {self.label} exited {code}:\n{tail}")

    def read(self, experiment: str) -> None:
        """Each variant's stage seconds and contention verdict, from this sweep's store."""
        from quantlab import tracking

        store = tracking.open_store(self.store)
        for run in tracking.child_runs(store, tracking.latest_sweep(store, experiment).run_id):
            self.stages[run.variant] = {
                key.removeprefix("time/").removesuffix("_seconds"): value
                for key, value in run.metrics.items()
                if key.startswith("time/") and key.endswith("_seconds")
            }
            self.contended[run.variant] = run.tags.get("quantlab.cost_contended", "not recorded")
            if "measure/load_1m" in run.metrics:
                self.load[run.variant] = run.metrics["measure/load_1m"]
            self.metrics[run.variant] = run.metrics


def add_folder_arguments(parser: argparse.ArgumentParser) -> None:
    """--source-cache and --work-dir, shared with parallel_sweep.py."""
    parser.add_argument(
        "--source-cache",
        type=Path,
        default=default_root(),
        help="a cache whose sources/ (converted model sources) each sweep starts with",
    )
    parser.add_argument("--work-dir", type=Path, help="keep stores, caches and outputs here (default: a temporary one)")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, help="recipe to sweep (default: a mini recipe written here)")
    parser.add_argument(
        "--model",
        choices=("embedded", "tiny"),
        default="embedded",
        help="the default recipe's model: the embedded SmolLM2-135M (GGUF), or a tiny random Llama (seconds)",
    )
    parser.add_argument(
        "--limit", type=int, default=20, help="documents per eval task, at most (default 20; 0: the recipe's own)"
    )
    parser.add_argument("--copies", type=int, default=3, help="sweeps at once (default 3)")
    parser.add_argument(
        "--split-threads",
        action="store_true",
        help="give each concurrent sweep QUANTLAB_THREADS = visible cores / copies (default: each variant's share of the host)",
    )
    parser.add_argument("--max-ratio", type=float, default=1.2, help="allowed ratio to the fair share (default 1.2)")
    add_folder_arguments(parser)
    parser.add_argument("--dry-run", action="store_true", help="write the recipe and print the plan; run nothing")
    args = parser.parse_args(argv)
    if args.copies < 1 or args.limit < 0:
        parser.error("--copies must be at least 1 and --limit at least 0")
    return args


def visible_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def write_recipe(args: argparse.Namespace, work: Path) -> Path:
    """The recipe to sweep, with eval limits capped at --limit and paths made absolute (sweeps run elsewhere)."""
    if args.recipe is not None:
        source_path = args.recipe.resolve()
        recipe = yaml.safe_load(source_path.read_text())
        name = "concurrent-" + recipe["name"]
    elif args.model == "tiny":
        source_path, name = work / "tiny.yaml", "concurrent-tiny"
        recipe = {
            "name": name,
            "model": {"source": str(save_tiny_llama(work / "tiny-llama"))},
            "baseline": "bf16",
            "variants": [{"name": variant, "method": variant} for variant in MINI_VARIANTS],
            "evals": {"include_path": str(EVALS_DIR), "batch_size": 8, "tasks": [{"name": "mmlu_dev", "limit": 20}]},
            "quality": {"max_tokens": 128, "window": 64},
            "measure": {"prompt_tokens": 16, "output_tokens": 8, "repeats": 2, "warmup": 1},
        }
    else:  # the embedded recipe, cut down: BF16 and FP8 only
        source_path, name = EMBEDDED_RECIPE, "concurrent-mini"
        recipe = yaml.safe_load(EMBEDDED_RECIPE.read_text())
        recipe["variants"] = [variant for variant in recipe["variants"] if variant["name"] in MINI_VARIANTS]
    recipe["name"] = name
    evals = recipe.setdefault("evals", {})
    if evals.get("include_path"):
        evals["include_path"] = str((source_path.parent / evals["include_path"]).resolve())
    for task in evals.get("tasks", []):
        if isinstance(task, dict) and args.limit:
            task["limit"] = min(task.get("limit") or args.limit, args.limit)
    for section in ("calibration", "quality"):  # a local corpus file, relative to the recipe
        for key in ("source", "corpus"):
            value = (recipe.get(section) or {}).get(key)
            if isinstance(value, str) and not value.startswith("builtin:") and (source_path.parent / value).exists():
                recipe[section][key] = str((source_path.parent / value).resolve())
    model = recipe["model"]
    if not str(model["source"]).startswith("pkg://") and (source_path.parent / model["source"]).exists():
        model["source"] = str((source_path.parent / model["source"]).resolve())
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def prime(recipe: Path, source_cache: Path, primed: Path) -> None:
    """A cache holding the model source's conversion (copied from the user's, else made here) and nothing else."""
    from quantlab.models import materialize, resolve_source
    from quantlab.recipe import load_recipe

    primed.mkdir(parents=True, exist_ok=True)  # a local model directory needs no conversion: it stays empty
    if (source_cache / "sources").is_dir():
        shutil.copytree(source_cache / "sources", primed / "sources", symlinks=True, dirs_exist_ok=True)
    loaded = load_recipe(recipe)
    materialize(resolve_source(loaded.recipe.model, recipe.parent), primed)


def fair_share_lines(
    alone: SweepRun, together: Sequence[SweepRun], max_ratio: float, order: Sequence[str] = ()
) -> tuple[list[str], dict[str, float]]:
    """The table, variants in `order` first; and the worst ratio to the fair share per stage, summed over variants."""
    copies = len(together)
    header = (
        f"{'variant':<10} {'stage':<14} {'alone':>8} "
        + " ".join(f"{f'#{i + 1}':>8}" for i in range(copies))
        + f" {'ratio':>7}  within {max_ratio:g}x"
    )
    lines = [header]

    def row(variant: str, stage: str, base: float, others: Sequence[float]) -> float:
        worst = max(others) / (copies * base) if base > 0 else float("inf")
        verdict = "yes" if worst <= max_ratio else "NO"
        shown = " ".join(f"{value:>7.1f}s" for value in others)
        lines.append(f"{variant:<10} {stage:<14} {base:>7.1f}s {shown} {worst:>6.2f}x  {verdict}")
        return worst

    variants = sorted(alone.stages, key=lambda name: (list(order).index(name) if name in order else len(order), name))
    for variant in variants:
        for stage, base in alone.stages[variant].items():
            if all(stage in run.stages.get(variant, {}) for run in together):
                row(variant, stage, base, [run.stages[variant][stage] for run in together])
    lines.append("")
    totals: dict[str, float] = {}
    stages = list(dict.fromkeys(stage for found in alone.stages.values() for stage in found))
    for stage in stages:

        def total(run: SweepRun, stage: str = stage) -> float:
            return sum(found.get(stage, 0.0) for found in run.stages.values())

        totals[stage] = row("(all)", stage, total(alone), [total(run) for run in together])
    row("(sweep)", "wall", alone.wall_seconds, [run.wall_seconds for run in together])
    return lines, totals


def contention_lines(runs: Sequence[SweepRun]) -> list[str]:
    lines = ["measure stage's verdict (quantlab.cost_contended) and 1-minute load average while timing:"]
    for run in runs:
        verdicts = ", ".join(
            f"{variant} {run.contended[variant]}" + (f" (load {run.load[variant]:.2f})" if variant in run.load else "")
            for variant in run.contended
        )
        lines.append(f"  {run.label:<8} {verdicts}")
    return lines


def benchmark(args: argparse.Namespace, work: Path) -> str:
    recipe = write_recipe(args, work)
    experiment = yaml.safe_load(recipe.read_text())["name"]
    cores = visible_cores()
    alone = SweepRun("alone", work / "alone")
    together = [SweepRun(f"#{index + 1}", work / f"together-{index + 1}") for index in range(args.copies)]
    if args.split_threads:
        for run in together:
            run.env["QUANTLAB_THREADS"] = str(max(1, cores // args.copies))
    context = [
        f"recipe: {recipe} (experiment {experiment})",
        f"machine: {cores} visible cores; thread share per variant: "
        + (
            f"QUANTLAB_THREADS={cores // args.copies or 1} when {args.copies} at once"
            if args.split_threads
            else "its share of the host (visible cores / the quantlab variants running on it, recounted as they come and go)"
        ),
    ]
    if args.dry_run:
        plan = [f"{run.label}: {run.env or ''} {' '.join(run.command(recipe))}" for run in [alone, *together]]
        return "\n".join([*context, "dry run: nothing swept", *plan])

    primed = work / "primed-cache"
    print(f"priming {primed} with the model source's conversion", file=sys.stderr)
    prime(recipe, args.source_cache, primed)
    for run in (alone, *together):
        run.folder.mkdir(parents=True, exist_ok=True)
        shutil.copytree(primed, run.cache, symlinks=True, dirs_exist_ok=True)

    load_before = os.getloadavg()[0]
    print("sweep alone", file=sys.stderr)
    alone.finish(*alone.start(recipe))
    print(f"{args.copies} sweeps at once", file=sys.stderr)
    started = [(run, *run.start(recipe)) for run in together]
    for run, process, at in started:
        run.finish(process, at)
    for run in (alone, *together):
        run.read(experiment)

    recipe_data = yaml.safe_load(recipe.read_text())
    order = [recipe_data["baseline"], *(variant["name"] for variant in recipe_data["variants"])]
    table, totals = fair_share_lines(alone, together, args.max_ratio, order)
    over = [stage for stage, ratio in totals.items() if ratio > args.max_ratio]
    verdict = (
        f"every stage within {args.max_ratio:g}x its fair share"
        if not over
        else f"over {args.max_ratio:g}x its fair share: {', '.join(over)}"
    )
    return "\n".join(
        [
            *context,
            f"1-minute load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after",
            f"fair share: {args.copies} sweeps at once, so {args.copies}x the time alone; ratio = worst of the "
            f"{args.copies} / ({args.copies} x alone)",
            "",
            *table,
            "",
            *contention_lines([alone, *together]),
            "",
            verdict,
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    return run_benchmark(benchmark, parse_args(argv), "quantlab-concurrent-sweeps-")


if __name__ == "__main__":
    sys.exit(main())
