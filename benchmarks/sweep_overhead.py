"""What does quantlab add on top of lm-eval? Score one quantized checkpoint both ways, side by side.

(a) lm-eval directly: a fresh Python process runs `lm_eval.simple_evaluate` with
    `HFLM(pretrained=<checkpoint dir>)` and `TaskManager(include_path=evals/)`.
(b) `quantlab sweep --only <variant>` of a recipe whose only variant (so also its baseline) is
    that checkpoint, with the same task(s), limit and batch size, `quality.enabled: false` and
    `measure.enabled: false`.

Both score the same checkpoint on the same device and dtype (quantlab's runtime default:
BF16 on CUDA and on CPUs with BF16 instructions, else float32) and both are timed from the parent as whole processes, so
interpreter start and imports count on both sides. A first, untimed sweep quantizes the
checkpoint into a shared `--cache-dir` (and warms the page cache and the datasets cache).
A sweep copies an unchanged finished run of its experiment instead of recomputing it, so every
timed sweep starts from a clean slate: by default a new experiment (the recipe's name) in the
store the first sweep made, as a user's next sweep would find it; with `--isolation store` a
fresh MLflow store, which also times creating the store's tables (seconds, paid once per store
in real use). Either way the shared cache makes the sweep reuse the checkpoint. Repetitions interleave the two, alternating which goes first (a b, b a, a b, ...)
so that a drift in machine load does not favour one side.

Printed: wall seconds of each side (median, min, max), the ratio (b)/(a), the direct run's own
phases, and the sweep's per-stage times read from its MLflow run (`time/<stage>_seconds`);
"outside the stages" is the sweep's wall time minus its stages (start, recipe validation,
MLflow bookkeeping, the variant's spawned process, publishing the frontier).

    .venv/bin/python benchmarks/sweep_overhead.py                       # tiny random Llama, fp8, 3 repeats
    .venv/bin/python benchmarks/sweep_overhead.py --model embedded      # SmolLM2-135M (GGUF), minutes
    .venv/bin/python benchmarks/sweep_overhead.py --task mmlu_dev --task pydoc_cloze --limit 20 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
EVALS_DIR = REPO / "evals"
# The tests' tiny random Llama (one definition for both); tests/ is a folder of modules, not a package.
sys.path.insert(0, str(REPO / "tests"))
from tiny import EMBEDDED_GGUF as EMBEDDED_SOURCE  # noqa: E402
from tiny import save_tiny_llama  # noqa: E402

# Variant name -> (quantlab method, params); AWQ's group must divide the model's layer widths
# (64 and 128 for the tiny model, 576 and 1536 for SmolLM2-135M): 32 fits both.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "bf16": ("bf16", {}),
    "fp8": ("fp8", {}),
    "awq-int4-g32": ("awq_int4", {"group_size": 32}),
}
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
DIRECT_FLAG = "--direct-lm-eval"  # internal: this script, run as side (a) in its own process


@dataclass(frozen=True)
class Repetition:
    direct_seconds: float
    sweep_seconds: float
    direct_phases: dict[str, float]  # phase -> seconds, as the direct process timed itself
    sweep_stages: dict[str, float]  # stage -> seconds, from the sweep's MLflow run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model",
        choices=("tiny", "embedded"),
        default="tiny",
        help="tiny: a 2-layer random Llama built here (seconds); embedded: SmolLM2-135M from the GGUF (minutes)",
    )
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="fp8")
    parser.add_argument(
        "--task",
        action="append",
        dest="tasks",
        default=None,
        help="bundled lm-eval task (repeatable; default mmlu_dev)",
    )
    parser.add_argument("--limit", type=int, default=40, help="documents per task (default 40)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each side (default 3)")
    parser.add_argument(
        "--isolation",
        choices=("experiment", "store"),
        default="experiment",
        help="what each timed sweep gets fresh so that nothing is copied (default experiment)",
    )
    parser.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="keep the model, cache and stores here (default: a temporary directory)",
    )
    parser.add_argument(DIRECT_FLAG, dest="direct_checkpoint", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.tasks = args.tasks or ["mmlu_dev"]
    return args


# --- side (a): lm-eval on its own, in the process this script starts --------------------------


def direct_lm_eval(checkpoint: Path, tasks: Sequence[str], limit: int, batch_size: int) -> dict[str, Any]:
    """lm-eval as a user would call it on a checkpoint directory; returns its phases' seconds."""
    phases: dict[str, float] = {}
    started = time.perf_counter()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from quantlab.models import pick_device, pick_dtype
    from quantlab.recipe import RuntimeSettings

    phases["import"] = time.perf_counter() - started
    # The device and dtype a sweep with `runtime: auto` uses, so both sides do the same work.
    runtime = RuntimeSettings()
    device = pick_device(runtime)
    dtype = str(pick_dtype(runtime, device)).removeprefix("torch.")
    mark = time.perf_counter()
    language_model = HFLM(pretrained=str(checkpoint), device=device, dtype=dtype, batch_size=batch_size)
    phases["load"] = time.perf_counter() - mark
    mark = time.perf_counter()
    manager = TaskManager(include_path=str(EVALS_DIR))
    phases["task index"] = time.perf_counter() - mark
    mark = time.perf_counter()
    results = lm_eval.simple_evaluate(model=language_model, tasks=list(tasks), limit=limit, task_manager=manager)
    phases["evaluate"] = time.perf_counter() - mark
    scores = {
        task: {k: v for k, v in metrics.items() if isinstance(v, float)} for task, metrics in results["results"].items()
    }
    return {"phases": phases, "scores": scores}


# --- the benchmark -----------------------------------------------------------------------------


def write_recipe(
    path: Path, name: str, model_source: str, variant: str, tasks: Sequence[str], limit: int, batch_size: int
) -> Path:
    """One variant, which is also the baseline, so `--only` runs that variant alone. The name
    (the MLflow experiment) is no part of the checkpoint's cache key."""
    method, params = VARIANTS[variant]
    recipe = {
        "name": name,
        "model": {"source": model_source},
        "baseline": variant,
        "variants": [{"name": variant, "method": method, "params": params}],
        "calibration": {"num_samples": 8, "seq_len": 128},
        "evals": {
            "include_path": str(EVALS_DIR),
            "batch_size": batch_size,
            "tasks": [{"name": task, "limit": limit} for task in tasks],
        },
        "quality": {"enabled": False},
        "measure": {"enabled": False},
    }
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def timed_process(command: Sequence[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess]:
    started = time.perf_counter()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env={**os.environ, **OFFLINE_ENV})
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(
            f"{' '.join(map(str, command))} exited {result.returncode}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return seconds, result


def run_sweep(
    recipe: Path, variant: str, store: Path, cache_dir: Path, cwd: Path
) -> tuple[float, dict[str, float], Any]:
    """Wall seconds of `quantlab sweep --only`, its variant run's stage times, and that MLflow run."""
    from quantlab import tracking

    command = [
        sys.executable,
        "-m",
        "quantlab",
        "sweep",
        str(recipe),
        "--only",
        variant,
        "--tracking-uri",
        f"sqlite:///{store}",
        "--cache-dir",
        str(cache_dir),
    ]
    seconds, _ = timed_process(command, cwd)
    tracking_store = tracking.open_store(f"sqlite:///{store}")
    sweep = tracking.latest_sweep(tracking_store, yaml.safe_load(recipe.read_text())["name"])
    (run,) = tracking.child_runs(tracking_store, sweep.run_id)
    stages = {
        key.removeprefix("time/").removesuffix("_seconds"): value
        for key, value in run.metrics.items()
        if key.startswith("time/") and key.endswith("_seconds")
    }
    return seconds, stages, run


def run_direct(checkpoint: Path, args: argparse.Namespace, cwd: Path) -> tuple[float, dict[str, float], dict[str, Any]]:
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        DIRECT_FLAG,
        str(checkpoint),
        "--limit",
        str(args.limit),
        "--batch-size",
        str(args.batch_size),
        *(part for task in args.tasks for part in ("--task", task)),
    ]
    seconds, result = timed_process(command, cwd)
    report = json.loads(result.stdout.strip().splitlines()[-1])
    return seconds, report["phases"], report["scores"]


def summary_line(label: str, values: Sequence[float], unit: str = "s") -> str:
    return f"{label:<34} {statistics.median(values):>9.2f}{unit} {min(values):>9.2f}{unit} {max(values):>9.2f}{unit}"


def phase_lines(title: str, per_repetition: Sequence[Mapping[str, float]]) -> list[str]:
    names = list(dict.fromkeys(name for phases in per_repetition for name in phases))
    lines = [title]
    for name in names:
        values = [phases[name] for phases in per_repetition if name in phases]
        lines.append(summary_line(f"  {name}", values))
    return lines


def report(args: argparse.Namespace, repetitions: Sequence[Repetition], context: Mapping[str, str]) -> str:
    direct = [rep.direct_seconds for rep in repetitions]
    sweep = [rep.sweep_seconds for rep in repetitions]
    ratios = [rep.sweep_seconds / rep.direct_seconds for rep in repetitions]
    outside = [rep.sweep_seconds - sum(rep.sweep_stages.values()) for rep in repetitions]
    direct_evaluate = [rep.direct_phases["evaluate"] for rep in repetitions]
    sweep_evaluate = [rep.sweep_stages["evaluate"] for rep in repetitions]
    evaluate_ratios = [b / a for a, b in zip(direct_evaluate, sweep_evaluate)]
    header = f"{'':<34} {'median':>10} {'min':>10} {'max':>10}"
    lines = [f"{key}: {value}" for key, value in context.items()]
    lines += [
        "",
        header,
        summary_line("(a) lm-eval direct, whole process", direct),
        summary_line("(b) quantlab sweep --only, whole", sweep),
        f"{'ratio (b)/(a)':<34} {statistics.median(sweep) / statistics.median(direct):>10.2f} "
        f"{min(ratios):>10.2f} {max(ratios):>10.2f}   (medians' ratio; min/max over repetitions)",
        f"{'difference (b)-(a)':<34} {statistics.median(sweep) - statistics.median(direct):>9.2f}s",
        f"{'evaluate: (b) stage / (a) phase':<34} "
        f"{statistics.median(sweep_evaluate) / statistics.median(direct_evaluate):>10.2f} "
        f"{min(evaluate_ratios):>10.2f} {max(evaluate_ratios):>10.2f}   (the scoring alone, same checkpoint and tasks)",
        "",
        *phase_lines("(a) phases, as the direct process timed them:", [rep.direct_phases for rep in repetitions]),
        "",
        *phase_lines(
            "(b) stages, from the sweep's MLflow run (time/<stage>_seconds):", [rep.sweep_stages for rep in repetitions]
        ),
        summary_line("  outside the stages", outside),
    ]
    return "\n".join(lines)


def same_scores(direct_scores: Mapping[str, Mapping[str, float]], sweep_metrics: Mapping[str, float]) -> str:
    """Whether both sides did the same work: lm-eval's "acc,none" against the sweep's eval/<task>/acc."""
    pairs = {
        task: (metrics["acc,none"], sweep_metrics.get(f"eval/{task}/acc"))
        for task, metrics in direct_scores.items()
        if "acc,none" in metrics
    }
    agree = all(sweep is not None and abs(direct - sweep) < 1e-9 for direct, sweep in pairs.values())
    shown = ", ".join(
        f"{task} acc {direct:.3f} direct vs {'-' if sweep is None else f'{sweep:.3f}'} sweep"
        for task, (direct, sweep) in pairs.items()
    )
    return f"{'yes' if agree else 'NO'} ({shown}; last repetition)"


def benchmark(args: argparse.Namespace, work: Path) -> str:
    import torch

    from quantlab.measure.provenance import cpu_model_name, visible_cores

    model_source = (
        str(save_tiny_llama(work / "tiny-llama", max_position_embeddings=2048))
        if args.model == "tiny"
        else EMBEDDED_SOURCE
    )

    def recipe_named(name: str) -> Path:
        return write_recipe(
            work / f"{name}.yaml", name, model_source, args.variant, args.tasks, args.limit, args.batch_size
        )

    cache_dir = work / "cache"
    first_store = work / "store.db"
    print("first sweep: quantizes the checkpoint into the shared cache (untimed)", file=sys.stderr)
    first_seconds, _, first_run = run_sweep(recipe_named("sweep-overhead"), args.variant, first_store, cache_dir, work)
    checkpoint = Path(first_run.tags["quantlab.checkpoint"])

    repetitions = []
    load_before = os.getloadavg()[0]
    for index in range(args.repeats):
        print(f"repetition {index + 1}/{args.repeats}", file=sys.stderr)
        sides = ["direct", "sweep"] if index % 2 == 0 else ["sweep", "direct"]
        measured: dict[str, Any] = {}
        for side in sides:
            if side == "direct":
                measured["direct"] = run_direct(checkpoint, args, work)
            else:
                if args.isolation == "store":
                    recipe, store = recipe_named("sweep-overhead"), work / f"store-{index}.db"
                else:
                    recipe, store = recipe_named(f"sweep-overhead-{index}"), first_store
                measured["sweep"] = run_sweep(recipe, args.variant, store, cache_dir, work)
        (direct_seconds, direct_phases, direct_scores), (sweep_seconds, sweep_stages, sweep_run) = (
            measured["direct"],
            measured["sweep"],
        )
        if sweep_run.tags.get("quantlab.checkpoint_reused") != "true":
            raise SystemExit("the timed sweep re-quantized instead of reusing the cached checkpoint")
        repetitions.append(Repetition(direct_seconds, sweep_seconds, direct_phases, sweep_stages))

    device = "cuda" if torch.cuda.is_available() else "cpu"
    context = {
        "model": f"{args.model} ({model_source})",
        "checkpoint": f"{args.variant}: {checkpoint}",
        "work": f"tasks {', '.join(args.tasks)}, limit {args.limit}, batch size {args.batch_size}, {args.repeats} repetitions "
        "(interleaved, alternating which side goes first)",
        "isolation": {
            "experiment": "each timed sweep logs to a new experiment of one existing MLflow store",
            "store": "each timed sweep logs to a fresh MLflow store (its table creation is timed too)",
        }[args.isolation],
        "machine": f"{cpu_model_name()}, {visible_cores()} cores visible, device {device}",
        "load": f"1-minute load average {load_before:.2f} before the timed runs, {os.getloadavg()[0]:.2f} after",
        "first sweep (untimed)": f"{first_seconds:.1f} s, checkpoint "
        + (
            "reused from the cache"
            if first_run.tags.get("quantlab.checkpoint_reused") == "true"
            else "quantized into the cache"
        ),
        "same scores both sides": same_scores(direct_scores, sweep_run.metrics),
    }
    return report(args, repetitions, context)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
    if args.direct_checkpoint is not None:
        print(json.dumps(direct_lm_eval(args.direct_checkpoint, args.tasks, args.limit, args.batch_size)))
        return 0
    return run_benchmark(benchmark, args, "quantlab-sweep-overhead-")


def run_benchmark(benchmark: Callable[[argparse.Namespace, Path], str], args: argparse.Namespace, prefix: str) -> int:
    """Print `benchmark(args, work)`, run offline in `args.work_dir` or else a temporary directory."""
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
    if args.work_dir is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        print(benchmark(args, args.work_dir.resolve()))
        return 0
    with tempfile.TemporaryDirectory(prefix=prefix) as work:
        print(benchmark(args, Path(work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
