"""What the decode path costs the embedded sweep: the recipe as shipped against the same recipe without it, cold.

Issue 47's goal: the embedded sweep's cold time grows by at most 60 s with the default on-policy pass
(`quality.generate`) and the generation and retrieval tasks (`pydoc_recall`, `pydoc_passkey_512`). The copy written
beside the stores drops those three (the tasks' drop limits with them) and changes nothing else. Each sweep runs
`--force` into a store and a cold cache of its own (the GGUF's conversion, every checkpoint and the baseline's
reference pass built in both), the copy first: on a machine that slows under sustained load, the shipped recipe runs
second, so a slowdown counts against it. Printed: both walls and their difference, each variant's evaluate and
damage stage seconds on each side, and the intervals the decode path's figures reach (paired with the baseline).

Run it alone on the machine:

    .venv/bin/python benchmarks/decode_path_cost.py --work-dir /tmp/decode-path-cost
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
    args = parser.parse_args(argv)
    work = args.work_dir.resolve()
    shipped = yaml.safe_load(RECIPE.read_text())
    stripped_path = work / "without-decode-path.yaml"
    work.mkdir(parents=True, exist_ok=True)
    stripped_path.write_text(yaml.safe_dump(without_decode_path(shipped), sort_keys=False))
    seconds = {}
    for side, recipe in (("without", stripped_path), ("shipped", RECIPE)):
        print(f"sweeping {side} the decode path ...", flush=True)
        seconds[side] = sweep(recipe, work / side)
    grown = seconds["shipped"] - seconds["without"]
    verdict = "within" if grown <= GOAL_SECONDS else "over"
    print(
        f"\nembedded sweep, cold, --force: without the decode path {seconds['without']:.1f} s, as shipped "
        f"{seconds['shipped']:.1f} s: +{grown:.1f} s ({verdict} the {GOAL_SECONDS:.0f} s goal)\n"
    )
    metrics = {side: variant_metrics(work / side, shipped["name"]) for side in seconds}
    print(f"{'variant':<14}{'evaluate without':>17}{'shipped':>9}{'damage without':>16}{'shipped':>9}")
    for name in metrics["shipped"]:
        cells = [
            metrics[side].get(name, {}).get(f"time/{stage}_seconds")
            for stage in ("evaluate", "damage")
            for side in ("without", "shipped")
        ]
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
