"""What the decode path costs the embedded sweep: the recipe as shipped against the same recipe without it, cold.

Issue 47's goal: the embedded sweep's cold time grows by at most 60 s with the default on-policy pass
(`quality.generate`) and the generation and retrieval tasks (`pydoc_recall`, `pydoc_passkey_512`). The copy written
beside the stores drops those three (the tasks' drop limits with them) and changes nothing else. Each sweep runs
`--force` into a store and a cold cache of its own (the GGUF's conversion, every checkpoint and the baseline's
reference pass built in both). `--rounds 2` runs the sides in the order without, shipped, shipped, without (ABBA): on
a machine whose speed drifts under sustained load, a steady drift then counts as much against each side. Printed:
every wall and each side's mean, their difference, each variant's evaluate and damage stage seconds (means over the
rounds), and the intervals the decode path's figures reach (paired with the baseline).

Run it alone on the machine:

    .venv/bin/python benchmarks/decode_path_cost.py --work-dir /tmp/decode-path-cost --rounds 2
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import yaml
from serving_agreement import sweep  # one cold `quantlab sweep --force` into a folder's own store and cache, timed

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "smollm2-135m.yaml"
DECODE_TASKS = ("pydoc_recall", "pydoc_passkey_512")
GOAL_SECONDS = 60.0


def without_decode_path(recipe: dict) -> dict:
    """The recipe with no on-policy pass and none of the decode path's tasks or their drop limits."""
    stripped = yaml.safe_load(yaml.safe_dump(recipe))
    stripped["evals"]["include_path"] = str(REPO / "evals")  # the copy is written elsewhere
    stripped["evals"]["tasks"] = [task for task in stripped["evals"]["tasks"] if task["name"] not in DECODE_TASKS]
    stripped["quality"]["generate"] = {"enabled": False}
    limits = stripped["frontier"]["default_policy"]["max_drop"]
    for key in [key for key in limits if key.split("/")[1] in DECODE_TASKS]:
        del limits[key]
    return stripped


def variant_metrics(work: Path, experiment: str) -> dict[str, dict[str, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], "tags.`quantlab.role` = 'variant'")
    return {run.data.tags["quantlab.variant"]: run.data.metrics for run in runs}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, required=True, help="stores, logs and caches go here")
    parser.add_argument("--rounds", type=int, default=1, help="sweeps per side, in ABBA order (default 1)")
    args = parser.parse_args(argv)
    work = args.work_dir.resolve()
    shipped = yaml.safe_load(RECIPE.read_text())
    stripped_path = work / "without-decode-path.yaml"
    work.mkdir(parents=True, exist_ok=True)
    stripped_path.write_text(yaml.safe_dump(without_decode_path(shipped), sort_keys=False))
    recipes = {"without": stripped_path, "shipped": RECIPE}
    order = [side for round_ in range(args.rounds) for side in (recipes if round_ % 2 == 0 else reversed(recipes))]
    folders: dict[str, list[Path]] = {side: [] for side in recipes}
    seconds: dict[str, list[float]] = {side: [] for side in recipes}
    for side in order:
        folder = work / f"{side}-{len(folders[side]) + 1}"
        print(f"sweeping {side} the decode path ({folder.name}) ...", flush=True)
        folders[side].append(folder)
        seconds[side].append(sweep(recipes[side], folder))
    mean = {side: sum(walls) / len(walls) for side, walls in seconds.items()}
    grown = mean["shipped"] - mean["without"]
    verdict = "within" if grown <= GOAL_SECONDS else "over"
    walls = {side: " / ".join(f"{wall:.1f}" for wall in walls) for side, walls in seconds.items()}
    print(
        f"\nembedded sweep, cold, --force, in the order {', '.join(order)}: without the decode path {walls['without']} s "
        f"(mean {mean['without']:.1f}), as shipped {walls['shipped']} s (mean {mean['shipped']:.1f}): "
        f"+{grown:.1f} s ({verdict} the {GOAL_SECONDS:.0f} s goal)\n"
    )
    runs = {side: [variant_metrics(folder, shipped["name"]) for folder in folders[side]] for side in recipes}
    metrics = {side: found[-1] for side, found in runs.items()}

    def stage_mean(side: str, name: str, stage: str) -> float | None:
        found = [
            run[name][f"time/{stage}_seconds"] for run in runs[side] if f"time/{stage}_seconds" in run.get(name, {})
        ]
        return sum(found) / len(found) if found else None

    print(f"{'variant':<14}{'evaluate without':>17}{'shipped':>9}{'damage without':>16}{'shipped':>9}")
    for name in metrics["shipped"]:
        cells = [stage_mean(side, name, stage) for stage in ("evaluate", "damage") for side in ("without", "shipped")]
        print(
            f"{name:<14}" + "".join(f"{'-' if c is None else f'{c:.0f} s':>{w}}" for c, w in zip(cells, (17, 9, 16, 9)))
        )
    print("\nthe decode path's figures (as shipped), each with its paired 95% interval against the baseline:")
    for name, found in metrics["shipped"].items():
        for key in sorted(found):
            decode = any(f"/{task}/" in key for task in DECODE_TASKS) or "quality/on_policy/" in key
            if decode and key.startswith("quality/paired/") and key.endswith("/diff"):
                low, high = found.get(key.replace("/diff", "/ci95_low")), found.get(key.replace("/diff", "/ci95_high"))
                if low is not None and high is not None:
                    print(
                        f"  {name:<14}{key.removeprefix('quality/paired/').removesuffix('/diff'):<62} {found[key]:+.4f} [{low:+.4f}, {high:+.4f}]"
                    )


if __name__ == "__main__":
    main()
