"""Adaptive against full evaluation as whole `quantlab sweep` runs, side by side in one run: documents and seconds each
variant's tasks take, and whether `quantlab pick`'s verdict on every check is the same wherever full evaluation decided
it (issue 45's benchmark; its goal: at most half the documents for variants whose verdict is clear).

Two recipes, each swept twice with everything identical but `evals.adaptive` (false, then true):

- mmlu: an MMLU-shaped sweep. mmlu_shaped_pick.py's tiny random Llama, its group over lm-eval's own mmlu subject
  configs (local synthetic data: 30, 60, 120 and 240 questions) and its recipe (bf16, fp8, awq-int4-g32), given a
  `frontier.default_policy` of 5 points on any task, which the group can show half way through (see MMLU_SHAPED_POLICY).
- schemes: recipes/smollm2-135m-schemes.yaml (the embedded SmolLM2-135M, 6 variants, every document of its bundled
  tasks: mmlu_dev 281, pydoc_cloze 448; the embedded recipe's limits on them), its `evals.include_path` written
  absolute, since the copy lives elsewhere than recipes/, and its serving off (`serving.enabled: false`): the load
  stage has no part in what is compared, and would add about half an hour of the 12 sweeps' time on 2 cores.
  (Before the recipe scored every document it had 40 and 100, and adaptive evaluation could not stop its 40-question
  task early at a 12-point limit: with no answer changed, 20 questions show 30.5 points at the half-way stage's
  O'Brien-Fleming level of 0.0015, and 30 show 15.6 at the third stage's, 0.009; 141 of 281 show 5.9.)

The full sweep runs first and builds the checkpoints the cache lacks (one both sweeps share); the adaptive one reuses
them, so what differs between the two is evaluation, not quantization (the sweeps' wall times still differ by any
quantization the first did: compare the evaluate seconds). No `--force`: it would rebuild the cached checkpoints.
Instead each sweep logs into a store of its own, emptied first, so neither copies a finished run (of the other, or of
an earlier run of this script); a sweep that says it reused or logged a kept result is an error. Verdicts are
`quantlab pick --json` on each store under the recipe's default policy; evaluate seconds are each variant's logged
`time/evaluate_seconds`.

Prints one table per recipe, then documents used of total and how many verdicts full evaluation decided are the same
under adaptive evaluation; exits 1 if any differs. A drop check that a variant's damage made moot (its tasks stopped at
their first stage because the variant already fails a plain limit, such as max_kld) is counted apart, and the
variants' own verdicts are compared as well.

    .venv/bin/python benchmarks/adaptive_sweeps.py --recipe mmlu --work-dir /tmp/adaptive-sweeps   # a few minutes
    .venv/bin/python benchmarks/adaptive_sweeps.py --recipe schemes --work-dir /tmp/adaptive-sweeps   # ~15 min, 2 cores
    .venv/bin/python benchmarks/adaptive_sweeps.py --recipe schemes --only fp8   # bf16 and fp8 only
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import yaml
from mmlu_shaped_pick import OFFLINE_ENV, SUBJECTS, save_tiny_llama, write_tasks
from mmlu_shaped_pick import recipe as mmlu_shaped_recipe

from quantlab.adaptive import StopReason

REPO = Path(__file__).resolve().parents[1]
SCHEMES = REPO / "recipes" / "smollm2-135m-schemes.yaml"
MODES = ("full", "adaptive")  # swept in this order: full builds the checkpoints, adaptive finds them cached
MMLU_SIZES = dict(zip(SUBJECTS, (30, 60, 120, 240)))  # mmlu_shaped_pick's default: 450 questions in the group
# The tiny random model has no true drop, so any limit is about what the documents can show. The group's 450
# questions are judged as one score; adaptive stages end at 25/50/75/100% of them (113/225/338/450) at O'Brien-Fleming
# levels of 7e-6, 0.0015, 0.009 and 0.022. No answer changed, the one-sided bounds are then 14.3, 3.8, 1.6 and 0.9
# points (one changed: 15.7, 4.6, 2.2, 1.3; two: 17.1, 5.3, 2.7, 1.7). 5 points is a limit that half the group can
# settle for a variant that changes an answer or two, and that all of it settles with room to spare: the 1-point
# default could stop nothing before the last stage.
MMLU_SHAPED_POLICY = {"max_drop_any_task": 5}
EVALUATE_SECONDS = "time/evaluate_seconds"
ADAPTIVE_TAG = "quantlab.adaptive/"
ADAPTIVE_METRIC = "quality/adaptive/"  # quantlab.metrics.adaptive_key: <this><task>/documents_used, documents_total


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--recipe",
        choices=("mmlu", "schemes", "both"),
        default="both",
        help="which sweeps to run (both: mmlu and schemes)",
    )
    parser.add_argument(
        "--only", action="append", default=[], metavar="NAME", help="only this variant (repeatable; with the baseline)"
    )
    parser.add_argument("--work-dir", type=Path, help="recipes, stores and logs (default: a fresh temporary one)")
    parser.add_argument(
        "--cache-dir", type=Path, help="checkpoint cache both sweeps share (default: <work-dir>/<recipe>/cache)"
    )
    parser.add_argument("--table-only", action="store_true", help="print the tables from the stores already there")
    return parser.parse_args(argv)


def mmlu_recipe(work: Path) -> dict:
    """mmlu_shaped_pick's recipe over its tiny model and MMLU-shaped group, with a policy the group can show."""
    model = work / "tiny-llama"
    if not (model / "config.json").is_file():
        save_tiny_llama(model)
    recipe = mmlu_shaped_recipe(model, write_tasks(work / "tasks", MMLU_SIZES))
    recipe["frontier"] = {"default_policy": MMLU_SHAPED_POLICY}
    return recipe


def schemes_recipe() -> dict:
    """The schemes recipe with its include_path absolute (a relative one resolves from the recipe file's directory,
    which the copy does not share) and no load stage."""
    recipe = yaml.safe_load(SCHEMES.read_text())
    recipe["evals"]["include_path"] = str((SCHEMES.parent / recipe["evals"]["include_path"]).resolve())
    recipe["serving"] = {**recipe.get("serving", {}), "enabled": False}
    return recipe


def quantlab(
    *args: str, cwd: Path, stdout: int | IO[str] = subprocess.PIPE, stderr: int | IO[str] = subprocess.PIPE
) -> subprocess.CompletedProcess:
    """`quantlab ARGS` in `cwd`, offline; its output captured unless told where it goes."""
    env = {**os.environ, **OFFLINE_ENV, "COLUMNS": "4000"}  # no line of the sweep's or pick's output wrapped
    return subprocess.run(
        [sys.executable, "-m", "quantlab", *args], cwd=cwd, env=env, stdout=stdout, stderr=stderr, text=True
    )


def store_uri(mode_dir: Path) -> str:
    return f"sqlite:///{mode_dir / 'store.db'}"


def sweep(recipe_path: Path, cache: Path, only: Sequence[str]) -> float:
    """`quantlab sweep` of the recipe copy into its own emptied store (output: sweep.log beside it); wall seconds."""
    mode_dir = recipe_path.parent
    # An earlier run's store (its finished runs would be copied, not swept again) and the artifacts beside it.
    (mode_dir / "store.db").unlink(missing_ok=True)
    shutil.rmtree(mode_dir / "artifacts", ignore_errors=True)
    selected = [argument for name in only for argument in ("--only", name)]
    arguments = ("sweep", str(recipe_path), "--tracking-uri", store_uri(mode_dir), "--cache-dir", str(cache), *selected)
    log = mode_dir / "sweep.log"
    started = time.perf_counter()
    with log.open("w") as written:  # as it goes: a long sweep can be followed there
        swept = quantlab(*arguments, cwd=mode_dir, stdout=written, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if swept.returncode != 0:
        raise SystemExit(f"{recipe_path} sweep exited {swept.returncode}: see {log}")
    output = log.read_text()
    if "Reused (unchanged" in output or "Logged from the cache" in output:  # cli.py's words for results not computed
        raise SystemExit(f"{recipe_path} sweep did not compute every variant: see {log}")
    (mode_dir / "seconds").write_text(f"{seconds:.1f}")
    return seconds


def picked(experiment: str, mode_dir: Path) -> dict[str, dict]:
    """`quantlab pick --json` under the recipe's default policy: each variant's verdict, by name."""
    arguments = ("pick", "--experiment", experiment, "--tracking-uri", store_uri(mode_dir), "--json")
    done = quantlab(*arguments, cwd=mode_dir)  # stdout: the JSON record alone
    if done.returncode not in (0, 1):  # 1: nothing chosen, still a decision
        raise SystemExit(f"quantlab pick on {mode_dir} exited {done.returncode}:\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout)
    return {verdict["name"]: verdict for verdict in record["variants"]}


def variant_runs(experiment: str, mode_dir: Path) -> dict:
    """The store's newest run of each variant."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store_uri(mode_dir))
    found = client.get_experiment_by_name(experiment)
    runs = client.search_runs([found.experiment_id], "tags.`quantlab.role` = 'variant'")
    newest: dict = {}
    for run in sorted(runs, key=lambda r: r.info.start_time):
        newest[run.data.tags["quantlab.variant"]] = run
    return newest


@dataclass
class Tally:
    """Documents the adaptive sweep's variants used of what they had, and verdicts full evaluation decided."""

    used: int = 0
    total: int = 0
    clear_used: int = 0  # of variants whose every drop check full evaluation decided
    clear_total: int = 0
    same: int = 0
    different: int = 0
    unjudged: int = 0  # drop checks left unsettled because the variant's damage had already rejected it
    variants_same: int = 0
    variants_different: int = 0

    def add(self, other: Tally) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def words(self) -> str:
        share = lambda used, total: f"{used:,} of {total:,} ({used / total:.0%})" if total else "none"  # noqa: E731
        return (
            f"documents used by adaptive evaluation: {share(self.used, self.total)}; by variants whose every drop "
            f"check full evaluation decided: {share(self.clear_used, self.clear_total)}. Verdicts full evaluation "
            f"decided: {self.same} same, {self.different} different, {self.unjudged} left unsettled by a variant its "
            f"damage had rejected; variants' verdicts: {self.variants_same} same, {self.variants_different} different"
        )


def table(label: str, recipe: dict, work: Path, seconds: dict[str, float]) -> Tally:
    """Print the recipe's table: per variant, each check's documents and verdict under both modes, and why each task
    of the adaptive sweep stopped."""
    experiment = recipe["name"]
    requests = [task["name"] for task in recipe["evals"]["tasks"]]
    verdicts = {mode: picked(experiment, work / mode) for mode in MODES}
    runs = {mode: variant_runs(experiment, work / mode) for mode in MODES}
    policy = recipe["frontier"]["default_policy"]
    reused = [run.data.tags.get("quantlab.checkpoint_reused") == "true" for run in runs["adaptive"].values()]
    print(f"\n{label}: experiment {experiment}, policy {json.dumps(policy)}")
    print(
        "sweep wall seconds: "
        + ", ".join(f"{mode} {seconds.get(mode, float('nan')):.0f}" for mode in MODES)
        + f"; checkpoints the adaptive sweep found cached: {sum(reused)} of {len(reused)}"
    )
    header = (
        f"{'variant':<20} {'check':<42} {'docs full':>9} {'adaptive':>8}  {'full':<11} {'adaptive':<11} "
        f"{'eval s full':>11} {'adaptive':>8}  adaptive stopped"
    )
    print(header + "\n" + "-" * len(header))
    tally = Tally()
    for name in [variant["name"] for variant in recipe["variants"] if variant["name"] in verdicts["full"]]:
        full_verdict = verdicts["full"][name]
        adaptive_verdict = verdicts["adaptive"].get(name, {"status": "missing", "checks": []})
        evaluate = [
            runs[mode][name].data.metrics.get(EVALUATE_SECONDS) if name in runs[mode] else None for mode in MODES
        ]
        shown = [f"{value:.1f}" if value is not None else "-" for value in evaluate]
        is_baseline = name == recipe["baseline"]  # its checks are against itself: the same by construction
        row = "(baseline verdict)" if is_baseline else "(verdict)"
        print(
            f"{name:<20} {row:<42} {'':>9} {'':>8}  {full_verdict['status']:<11} "
            f"{adaptive_verdict['status']:<11} {shown[0]:>11} {shown[1]:>8}"
        )
        adaptive_checks = {check["metric"]: check for check in adaptive_verdict["checks"]}
        adaptive_tags = runs["adaptive"][name].data.tags if name in runs["adaptive"] else {}
        if not is_baseline:
            same = full_verdict["status"] == adaptive_verdict["status"]
            tally.variants_same, tally.variants_different = (
                tally.variants_same + same,
                tally.variants_different + (not same),
            )
        drops_decided = True
        for check in full_verdict["checks"]:
            other = adaptive_checks.get(check["metric"], {"status": "missing", "n": None})
            decided = check["status"] != "undecided"
            # The task the check is on: the request of the same name (a group is checked as its own score).
            task = next((r for r in requests if check["metric"].startswith(f"eval/{r}/")), None)
            stopped = adaptive_tags.get(ADAPTIVE_TAG + task, "") if task else ""
            if decided and not is_baseline:
                if other["status"] == "undecided" and stopped.startswith(StopReason.REJECTED.value):
                    tally.unjudged += 1
                else:
                    same = check["status"] == other["status"]
                    tally.same, tally.different = tally.same + same, tally.different + (not same)
            drops_decided = drops_decided and (decided or not check["is_drop"])
            docs = [f"{value:,}" if value is not None else "" for value in (check["n"], other["n"])]
            print(
                f"{'':<20} {check['metric']:<42} {docs[0]:>9} {docs[1]:>8}  {check['status']:<11} "
                f"{other['status']:<11} {'':>11} {'':>8}  {stopped}"
            )
        if name in runs["adaptive"]:  # the baseline scores every document and logs no adaptive figures
            metrics = runs["adaptive"][name].data.metrics
            for task in requests:
                used = metrics.get(f"{ADAPTIVE_METRIC}{task}/documents_used")
                total = metrics.get(f"{ADAPTIVE_METRIC}{task}/documents_total")
                if used is None or total is None:
                    continue
                tally.used, tally.total = tally.used + int(used), tally.total + int(total)
                if drops_decided and full_verdict["checks"]:
                    tally.clear_used, tally.clear_total = tally.clear_used + int(used), tally.clear_total + int(total)
    print(f"{label}: {tally.words()}")
    return tally


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="adaptive-sweeps-"))).resolve()
    import quantlab as imported

    print(f"quantlab from {Path(imported.__file__).parent}; work in {work}", flush=True)
    chosen = ("mmlu", "schemes") if args.recipe == "both" else (args.recipe,)
    overall = Tally()
    for which in chosen:
        recipe_work = work / which
        recipe_work.mkdir(parents=True, exist_ok=True)
        recipe = mmlu_recipe(recipe_work) if which == "mmlu" else schemes_recipe()
        cache = (args.cache_dir or recipe_work / "cache").resolve()
        seconds = {}
        for mode in MODES:
            mode_dir = recipe_work / mode
            mode_dir.mkdir(exist_ok=True)
            if args.table_only:
                seconds[mode] = float((mode_dir / "seconds").read_text())
                continue
            copy = recipe | {"evals": recipe["evals"] | {"adaptive": mode == "adaptive"}}
            path = mode_dir / "recipe.yaml"
            path.write_text(yaml.safe_dump(copy, sort_keys=False))
            print(f"{which}: sweeping with evals.adaptive {mode == 'adaptive'} ...", flush=True)
            seconds[mode] = sweep(path, cache, args.only)
            print(f"{which}: {mode} sweep {seconds[mode]:.0f} s", flush=True)
        label = "MMLU-shaped group, tiny model" if which == "mmlu" else "schemes recipe, embedded SmolLM2-135M"
        overall.add(table(label, recipe, recipe_work, seconds))
    if len(chosen) > 1:
        print(f"\nall: {overall.words()}")
    return 1 if overall.different else 0


if __name__ == "__main__":
    sys.exit(main())
