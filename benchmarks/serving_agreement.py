"""Does the frontier's cost ordering hold from one cold sweep to the next? The embedded sweep, N times from cold.

Runs `quantlab sweep --force` on a recipe (default: recipes/smollm2-135m.yaml, the default serving repeats) N times,
each into a store and a cold cache of its own (the GGUF's conversion and every checkpoint built again), and prints:

1. each sweep's wall time (the serving issue's goal for the embedded sweep: within 300 s cold on a quiet 2-core
   machine);
2. per cost axis of the frontier, each variant's cost with its 95% interval in every run;
3. per cost axis and pair of variants, the order the frontier calls in each run (`quantlab.frontier.cost_order`:
   cheaper beyond the noise, or a tie: where both were served in the same rounds, their ratio paired round by round,
   shown beside the order, holds 1; otherwise their intervals overlap), and whether every order called (not a tie) is
   the same in all runs. A pair called one way in one run and the other way in another is a contradiction; one
   called in one run and tied in another is counted apart;
4. each variant's output tokens/s in every run of each load level (serving.repeats of them, in rounds across the
   variants where the sweep interleaves them: serving.interleave), sweep by sweep: a wide interval above is either
   a variant's own spread or the machine changing speed over the stage, which only these runs tell apart. Beside
   each run, its measured requests' median inter-token latency over its own warm-up requests' (those guidellm's
   sample holds that ended before the measured window opened): at 1.5x and more the serve stage judges that the run
   slowed while it was timed, and re-runs it (quantlab.measure.contention.judge_slowdown);
5. each sweep's serving phase, from the first load run's start to the last one's end, split into the parts
   guidellm timed: the measured windows, the warm-ups before them, the gaps between a turn's levels (guidellm
   starting the next level) and between turns (a variant's report read, the next variant's turn, its scenario's
   start).

Run it alone on the machine (another job's load moves the figures it compares):

    .venv/bin/python benchmarks/serving_agreement.py --work-dir /tmp/serving-agreement
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ORDER = {1: "<", -1: ">", 0: "tie"}  # first's cost against second's: better (cheaper / faster), worse, tie


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, required=True, help="each run's store, log and cache go here")
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2-135m.yaml")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--reuse", action="store_true", help="print the tables from the stores already there")
    return parser.parse_args(argv)


def sweep(recipe: Path, folder: Path) -> float:
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "quantlab", "sweep", str(recipe), "--force"]
    command += ["--tracking-uri", f"sqlite:///{folder / 'mlflow.db'}", "--cache-dir", str(folder / "cache")]
    started = time.perf_counter()
    with open(folder / "sweep.log", "w") as log:
        done = subprocess.run(command, cwd=folder, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"the sweep in {folder} exited {done.returncode}: see {folder / 'sweep.log'}")
    (folder / "seconds").write_text(f"{seconds:.1f}")
    return seconds


def latest_sweep(folder: Path):
    """The store a run of this script left in `folder`, and its sweep's run id."""
    from quantlab import tracking

    store = tracking.open_store(f"sqlite:///{folder / 'mlflow.db'}")
    return store, tracking.latest_sweep(store, None).run_id


def frontier_results(folder: Path):
    from quantlab.publish import frontiers, read_sweep

    return frontiers(read_sweep(*latest_sweep(folder))).results


def load_reports(folder: Path, retakes: bool = False) -> dict[str, list[dict]]:
    """Each variant's guidellm report (every round's levels, in the order run), as the serve stage logged it; with
    `retakes`, then its re-runs' of contended runs (serving/guidellm-retake-<n>.json), in order."""
    from quantlab import tracking
    from quantlab.stages.serve import REPORT_ARTIFACT

    store, sweep_id = latest_sweep(folder)
    found = {}
    for run in tracking.child_runs(store, sweep_id):
        report = store.read_artifact(run.run_id, REPORT_ARTIFACT)
        if report is None:
            continue
        found[run.variant] = [json.loads(report)]
        while retakes and (
            again := store.read_artifact(run.run_id, f"serving/guidellm-retake-{len(found[run.variant])}.json")
        ):
            found[run.variant].append(json.loads(again))
    return found


def level_runs(sweep_reports: dict[str, list[dict]]) -> dict[str, dict[str, list[str]]]:
    """Each variant's output tokens/s in every run of each load level, in the order guidellm ran them (its reports,
    `load_reports`), with the run's measured median ITL over its warm-up's (what
    quantlab.measure.contention.judge_slowdown reads)."""
    from quantlab.serving.levels import load_levels

    found: dict[str, dict[str, list[str]]] = {}
    for variant, reports in sweep_reports.items():
        for number, report in enumerate(reports):
            for level in load_levels(report):
                shown = f"{'re-run ' if number else ''}{level.output_tokens_per_s:.1f}"
                if math.isnan(level.itl_ms_p50):  # guidellm measured too few requests for a median
                    shown += f" ({level.succeeded} measured)"
                elif level.warm_up_itl_ms:
                    shown += f" ({level.itl_ms_p50 / level.warm_up_itl_ms:.2f}x)"
                found.setdefault(variant, {}).setdefault(level.label, []).append(shown)
    return found


def serving_phase(sweep_reports: dict[str, list[dict]]) -> dict[str, float]:
    """Seconds of the sweep's serving phase and of its parts, from guidellm's own clocks (its reports, `load_reports`):
    each run's scheduler start and end and its measured window. Runs of one variant in a row are one turn; the gaps
    between them are a turn's level starts, the others the hand-overs between turns."""
    runs = sorted(
        (benchmark["scheduler_state"]["start_time"], benchmark["scheduler_state"]["end_time"], benchmark, variant)
        for variant, reports in sweep_reports.items()
        for report in reports
        for benchmark in report["benchmarks"]
    )
    parts = dict.fromkeys(("phase", "measured", "warm-up", "between levels", "between turns"), 0.0)
    parts["phase"] = runs[-1][1] - runs[0][0]
    for index, (start, _, benchmark, variant) in enumerate(runs):
        parts["measured"] += benchmark["end_time"] - benchmark["start_time"]
        parts["warm-up"] += benchmark["start_time"] - start
        if index:
            previous_end, previous_variant = runs[index - 1][1], runs[index - 1][3]
            parts["between levels" if variant == previous_variant else "between turns"] += start - previous_end
    return parts


def interval_text(point) -> str:
    low, high = point.cost_interval or (point.cost, point.cost)
    return f"{point.cost:,.4g} [{low:,.4g}, {high:,.4g}]"


def order_text(order: int, first, second) -> str:
    """The order called, and the ratio first / second paired round by round where both were served in the same rounds
    (serving.interleave: what the frontier then judges by)."""
    from quantlab.repeats import paired_ratio

    ratio = paired_ratio(first.cost_rounds, second.cost_rounds)
    return ORDER[order] if ratio is None else f"{ORDER[order]} ({ratio.mean:.3g} [{ratio.low:.3g}, {ratio.high:.3g}])"


def main(argv: Sequence[str] | None = None) -> None:
    from quantlab.frontier import cost_order

    args = parse_args(argv)
    work = args.work_dir.resolve()
    folders = [work / f"run-{index + 1}" for index in range(args.runs)]
    seconds = []
    for folder in folders:
        if args.reuse and (folder / "seconds").is_file():
            seconds.append(float((folder / "seconds").read_text()))
        else:
            seconds.append(sweep(args.recipe.resolve(), folder))
    print(f"## {args.recipe.name}: {args.runs} cold sweeps\n")
    print("| run | wall s |\n|---|---|")
    print("\n".join(f"| {index + 1} | {value:.1f} |" for index, value in enumerate(seconds)))

    runs = [{result.pair.cost.metric: result for result in frontier_results(folder)} for folder in folders]
    called = contradictions = called_then_tied = 0
    for metric in runs[0]:
        results = [run[metric] for run in runs if metric in run]
        points = [{point.name: point for point in result.points} for result in results]
        names = sorted(set.intersection(*(set(found) for found in points)))
        print(f"\n### {metric}\n\n| variant | " + " | ".join(f"run {i + 1}" for i in range(len(points))) + " |")
        print("|---" * (len(points) + 1) + "|")
        for name in names:
            print(f"| {name} | " + " | ".join(interval_text(found[name]) for found in points) + " |")
        print("\n| pair | " + " | ".join(f"run {i + 1}" for i in range(len(points))) + " | agrees |")
        print("|---" * (len(points) + 2) + "|")
        for first, second in itertools.combinations(names, 2):
            orders = [cost_order(results[0].pair.cost, found[first], found[second]) for found in points]
            calls = {order for order in orders if order != 0}
            agrees = "-" if not calls else ("yes" if len(calls) == 1 and 0 not in orders else "no")
            called += bool(calls)
            contradictions += len(calls) > 1
            called_then_tied += len(calls) == 1 and 0 in orders
            cells = [order_text(order, found[first], found[second]) for order, found in zip(orders, points)]
            print(f"| {first} vs {second} | " + " | ".join(cells) + f" | {agrees} |")
    print(
        f"\nPairs the frontier called (not a tie) in some run: {called}; called the same way in every run: "
        f"{called - contradictions - called_then_tied}; called one way in one run and the other in another: "
        f"{contradictions}; called in one run and tied in another: {called_then_tied}."
    )

    print("\n### output tokens/s of each run of a level, in the order run (measured ITL / warm-up ITL)\n")
    print("| variant | level | " + " | ".join(f"sweep {i + 1}" for i in range(len(folders))) + " |")
    print("|---" * (len(folders) + 2) + "|")
    reports = [load_reports(folder, retakes=True) for folder in folders]
    sweeps = [level_runs(found) for found in reports]
    for name in sorted(set().union(*sweeps)):
        for label in dict.fromkeys(label for found in sweeps for label in found.get(name, {})):  # as guidellm ran them
            cells = [", ".join(found.get(name, {}).get(label, [])) for found in sweeps]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |")

    print("\n### the serving phase, seconds (guidellm's clocks)\n")
    phases = [serving_phase(found) for found in reports]
    print("| part | " + " | ".join(f"sweep {i + 1}" for i in range(len(folders))) + " |")
    print("|---" * (len(folders) + 1) + "|")
    for part in phases[0]:
        print(f"| {part} | " + " | ".join(f"{phase[part]:.1f}" for phase in phases) + " |")


if __name__ == "__main__":
    main()
