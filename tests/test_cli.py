"""The command line's contract: exit codes, one-line errors naming file and field, nothing half-written."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import free_port
from mlflow.tracking import MlflowClient
from test_sweep import quantlab

from quantlab import tracking
from quantlab.metrics import Declared, Scale, declared_tags, paired_key
from quantlab.paired import Aggregation, DocumentScores, compare
from quantlab.tracking import shown_uri
from recipes import tiny_recipe, write


def _variants(*extra):
    return [{"name": "bf16", "method": "bf16"}, *extra]


# One recipe per kind of bad input; each must stop a sweep before any work.
BROKEN = {
    "unknown variant": ({"baseline": "bf17"}, "baseline: 'bf17' is not a variant name (did you mean 'bf16'?)"),
    "yaml syntax": ("name: x\nvariants: [\n  - a\nbaseline: x\n", "line 3"),
    "wrong type": ({"calibration": {"num_samples": "many"}}, "calibration.num_samples: "),
    "unknown key": ({"colour": "red"}, "colour: unknown key"),
    "no variants": ({"variants": []}, "variants: "),
    "duplicate name": (
        {"variants": _variants({"name": "bf16", "method": "fp8"})},
        "variants[1] (bf16).name: duplicate",
    ),
    "group size": (
        {"variants": _variants({"name": "w4", "method": "awq_int4", "params": {"group_size": 48}})},
        "variants[1] (w4).params.group_size: ",
    ),
    "unknown task": (
        {"evals": {"tasks": [{"name": "mmlu_dve"}]}},
        "evals.tasks[0].name: lm-eval cannot resolve task 'mmlu_dve'",
    ),
    "negative samples": ({"calibration": {"num_samples": -4}}, "calibration.num_samples: "),
    "zero batch": ({"evals": {"batch_size": 0}}, "evals.batch_size: "),
    "escaping name": ({"variants": _variants({"name": "../../x", "method": "fp8"})}, "variants[1] (../../x).name: "),
    "escaping experiment": ({"name": "../escape"}, "name: must be 1-64 letters"),
    "missing file": ({"calibration": {"source": "missing.txt"}}, "calibration.source: no such file"),
    "missing recipe": (None, "no such recipe file"),
}


def _no_runs(uri: str, db: Path) -> bool:
    client = MlflowClient(uri)
    return not db.exists() or not client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.mark.parametrize("kind", BROKEN)
def test_bad_input_exits_2_with_one_line_and_leaves_nothing(tmp_path, tiny_llama, kind):
    edit, message = BROKEN[kind]
    if isinstance(edit, dict):  # a section edit keeps the rest of that section
        base = tiny_recipe(tiny_llama.path)
        edit = tiny_recipe(
            tiny_llama.path,
            **{key: base.get(key, {}) | value if isinstance(value, dict) else value for key, value in edit.items()},
        )
    broken = write(tmp_path / "broken.yaml", edit) if edit is not None else tmp_path / "broken.yaml"
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    result = quantlab("sweep", str(broken), "--tracking-uri", uri, "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {broken}: ") and message in line, line
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "cache").exists()
    assert _no_runs(uri, tmp_path / "store.db")


def test_validate_reports_bad_input_like_sweep(tmp_path, tiny_llama):
    broken = write(tmp_path / "broken.yaml", tiny_recipe(tiny_llama.path, baseline="bf17"))
    result = quantlab("validate", str(broken), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {broken}: {BROKEN['unknown variant'][1]}"


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("sqlite:///mlruns/mlflow.db", "sqlite:///mlruns/mlflow.db"),
        ("http://mlflow.internal:5000", "http://mlflow.internal:5000"),
        ("postgresql://bob:pw@db:5432/mlflow", "postgresql://bob:***@db:5432/mlflow"),
        ("https://alice:s3cret@host/prefix", "https://alice:***@host/prefix"),
        ("http://alice@host:5000", "http://alice@host:5000"),
    ],
)
def test_shown_uri_masks_passwords(uri, shown):
    assert shown_uri(uri) == shown


def test_unreachable_tracking_server_exits_2_before_any_work(tmp_path, tiny_llama):
    recipe = write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path))
    started = time.monotonic()
    result = quantlab(
        "sweep",
        str(recipe),
        "--tracking-uri",
        f"http://alice:s3cret@127.0.0.1:{free_port()}",
        "--cache-dir",
        str(tmp_path / "cache"),
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is unreachable" in result.stderr and "Traceback" not in result.stderr
    assert "alice:***@127.0.0.1" in result.stderr and "s3cret" not in result.stdout + result.stderr
    assert not (tmp_path / "cache").exists()
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("uri", ["file://{tmp}/filestore", "{tmp}/filestore"])
def test_a_file_store_that_mlflow_refuses_is_bad_input_before_any_work(tmp_path, tiny_llama, uri, monkeypatch):
    """MLflow 3 opens no file store unless MLFLOW_ALLOW_FILE_STORE is set: one line naming the way out, exit 2,
    nothing made (it was a traceback from the middle of the sweep, exit 1)."""
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    recipe = write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path))
    uri = uri.format(tmp=tmp_path)
    result = quantlab("sweep", str(recipe), "--tracking-uri", uri, "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    [line] = [line for line in result.stderr.splitlines() if line.strip()]
    assert (
        line.startswith("error: --tracking-uri: ") and "MLFLOW_ALLOW_FILE_STORE=true" in line and "sqlite:///" in line
    )
    assert not (tmp_path / "cache").exists() and not (tmp_path / "filestore").exists()


def test_a_file_store_is_opened_where_mlflow_is_told_to_allow_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    store = tracking.open_store((tmp_path / "filestore").as_uri())
    assert store.experiment_id("allowed") is not None and (tmp_path / "filestore").is_dir()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--executor", "slurm"], "--executor: 'slurm' is not one of: local, ray"),
        (["--only", "int3"], "--only: 'int3' is not a variant of recipe.yaml"),
        (["--executor", "ray", "--parallel", "2"], "--parallel: applies to --executor local only (ray runs every"),
    ],
)
def test_bad_flags_exit_2(tmp_path, tiny_llama, args, message):
    recipe = write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path))
    result = quantlab("sweep", str(recipe), "--tracking-uri", f"sqlite:///{tmp_path / 'store.db'}", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert _no_runs(f"sqlite:///{tmp_path / 'store.db'}", tmp_path / "store.db")


def test_pick_on_an_empty_store_is_bad_input(tmp_path):
    result = quantlab(
        "pick", "--experiment", "nothing", "--tracking-uri", f"sqlite:///{tmp_path / 'store.db'}", cwd=tmp_path
    )
    assert result.returncode == 2
    assert "no experiment named 'nothing'" in result.stderr


def test_help_explains_every_command(tmp_path):
    result = quantlab("--help", cwd=tmp_path)
    for command in ("sweep", "validate", "frontier", "pick", "report", "ui"):
        assert command in result.stdout
    assert "METRIC=LIMIT" in quantlab("pick", "--help", cwd=tmp_path).stdout


# --------------------------------------------------------------------------------------
# quantlab pick on hand-made runs logged into a real SQLite store with quantlab's tracking code
# --------------------------------------------------------------------------------------

ACC = "eval/mmlu_dev/acc"
PPL = "quality/ppl"
KLD = "quality/kld_mean"


def _acc_figures(right_to_wrong: int, wrong_to_right: int) -> dict[str, float]:
    """A variant's mmlu_dev score and its paired figures against a baseline that gets 600 of 1000
    right, from per-document 0/1 scores through the real paired comparison."""
    base = np.array([1.0] * 600 + [0.0] * 400)
    variant = base.copy()
    variant[:right_to_wrong] = 0.0
    variant[600 : 600 + wrong_to_right] = 1.0
    comparison = compare(
        "mmlu_dev", *(DocumentScores(Aggregation.MEAN, dict(enumerate(scores))) for scores in (base, variant))
    )
    return {
        ACC: comparison.variant,
        **{paired_key(ACC, stat): value for stat, value in comparison.statistics().items()},
    }


# name: (weight bytes, peak memory, figures); bf16 is the baseline.
RUNS = {
    "bf16": (270e6, 2e9, {ACC: 0.60, PPL: 10.0, KLD: 0.0}),
    "w8": (
        200e6,
        2e9,
        {
            **_acc_figures(3, 3),
            PPL: 10.05,
            **{paired_key(PPL, s): v for s, v in (("diff", 0.05), ("se", 0.01), ("n", 1000))},
        },
    ),
    # 2.5 points lost (28 right->wrong, 3 wrong->right): shown over a 1-point limit at the one-sided 97.5% of
    # issue 28, by Tango's lower bound (1.52 pts) and the Wald one on Agresti and Min's se (1.40 pts) alike (2 points,
    # the example of issue 8, no longer are: its lower bounds are 0.997 and 0.918 pts).
    "fp8": (170e6, 0.5e9, {**_acc_figures(28, 3), PPL: 10.05}),
    "int4": (90e6, 0.5e9, {**_acc_figures(12, 7), PPL: 10.05}),  # 0.5 points lost, give or take 0.7
}


@pytest.fixture(scope="module")
def picked_store(tmp_path_factory):
    work = tmp_path_factory.mktemp("pick")
    uri = f"sqlite:///{work / 'store.db'}"
    store = tracking.open_store(uri)
    experiment = store.experiment_id("picks")
    parent = store.start_run(experiment, "sweep", {tracking.ROLE: "sweep"})
    store.log_files(parent, {"recipe.yaml": yaml.safe_dump({"name": "picks", "baseline": "bf16"})})
    declared = declared_tags({ACC: Declared(True, Scale.FRACTION)})
    for name, (weights, memory, figures) in RUNS.items():
        tags = {
            tracking.ROLE: "variant",
            tracking.VARIANT: name,
            tracking.METHOD: name,
            tracking.CHECKPOINT: str(work / name),
            "quantlab.baseline": str(name == "bf16").lower(),
            **declared,
        }
        run = store.start_run(experiment, name, tags, parent=parent)
        store.log_values(run, {**figures, "cost/weight_bytes": weights, "cost/peak_memory_bytes": memory})
        store.finish(run, "FINISHED")
    store.finish(parent, "FINISHED")
    return work, uri


def _pick(picked_store, *args: str):
    work, uri = picked_store
    return quantlab("pick", "--experiment", "picks", "--tracking-uri", uri, *args, cwd=work)


def test_pick_explains_each_verdict_by_non_inferiority(picked_store):
    # quality/ppl=+2%: 10.00 -> 10.05 is within, where the old `=1` rejected it as "5 pts".
    result = _pick(picked_store, "--max-drop", f"{ACC}=1", "--max-drop", f"{PPL}=+2%")

    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Chosen: w8, the best by cost/weight_bytes (lower is better) at 200.0 MB")
    # The cheapest, but not enough evidence: 12 right->wrong, 7 wrong->right; the score test's sample size at those
    # rates, ((z_0.975 sd_0 + z_0.8 sd) / 0.005)^2 (sd_0 at the limit, on Tango's restricted rates): 6,444 at 80% power.
    assert "int4 would need ~6,444 documents" in lines[0]
    text = result.stdout
    # Each verdict with the checks it rests on; "over" Holm-corrected where two drop checks have paired figures.
    assert (
        'w8 (chosen; 2 checks: 2 drop limits ("over" Holm-corrected for 2)): eval/mmlu_dev/acc: shown within the '
        "limit: drop 0.00 pts, one-sided bounds from the flips [-0.74 pts at 98.75% (Holm, 2 checks), 0.61 pts at 97.5%]"
    ) in text
    assert "quality/ppl: shown within the limit: drop 0.05" in text and "limit +2% of the baseline (0.2)" in text
    # "Shown over" needs both lower bounds over the limit, and pick prints the smaller: the Wald one on Agresti and
    # Min's se, 2.50 - 1.960 * 0.5590 = 1.40 pts, under Tango's 1.52 (the upper bound is Tango's alone).
    assert (
        "fp8 (rejected; 2 checks: 2 drop limits): eval/mmlu_dev/acc: shown over the limit: drop 2.50 pts, one-sided "
        "97.5% bounds from the flips [1.40 pts, 3.75 pts], limit 1 pt (paired, n=1,000)"
    ) in text
    assert "fp8" in text and "quality/ppl: not enough evidence: no paired statistics logged" in text
    assert "int4 (rejected" not in text
    assert "int4 (not enough evidence; 2 checks: 2 drop limits): eval/mmlu_dev/acc: not enough evidence" in text


def test_pick_nothing_shown_within_exits_1_and_the_default_policy_uses_the_same_verdicts(picked_store):
    # A memory bound only the undecided int4 and the over-the-limit fp8 meet: nothing can be picked.
    result = _pick(picked_store, "--json", "--max-drop", f"{ACC}=1", "--max-memory", "1e9")
    assert result.returncode == 1, result.stdout + result.stderr
    record = json.loads(result.stdout)
    assert record["chosen"] is None
    assert record["summary"].startswith("No variant shown within the limits; nothing chosen")
    assert "int4 would need ~6,444 documents" in record["summary"]

    default = _pick(picked_store, "--json")
    assert default.returncode == 0, default.stdout + default.stderr
    record = json.loads(default.stdout)
    assert record["chosen"] == "w8"
    assert record["policy"]["max_drop_any_task"] == 1.0
    verdicts = {v["name"]: v for v in record["variants"]}
    assert verdicts["int4"]["status"] == "undecided" and verdicts["int4"]["documents_needed"] > 1000
    assert verdicts["fp8"]["checks"][0]["outcome"] == "shown over the limit"
    assert record["policy"]["one_sided_alpha"] == 0.025 and record["policy"]["power"] == 0.8


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--max-drop", f"{PPL}=1pts"],
            f"--max-drop: {PPL}=1pts: is not a 0-1 metric (perplexity)",
            id="points-on-ppl",
        ),
        pytest.param(
            ["--max-drop", f"{ACC}=+2%"], f"--max-drop: {ACC}=+2%: is a 0-1 metric", id="percent-on-declared-fraction"
        ),
        pytest.param(
            ["--max-drop", "cost/weight_bytes=1"], "--max-drop: cost/weight_bytes=1: is a cost", id="cost-metric"
        ),
        pytest.param(["--max-drop", "eval/mmlu_dev/ac=1"], f"did you mean {ACC}?", id="typo"),
        pytest.param(["--max-kld", "-1"], "--max-kld: ", id="negative-kld"),
        pytest.param(
            ["--max-drop", f"{KLD}=+5%"],
            f"--max-drop: {KLD}=+5%: is relative to the baseline, whose value is 0",
            id="relative-to-a-zero-baseline",
        ),
    ],
)
def test_pick_limits_that_do_not_fit_are_bad_input(picked_store, args, message):
    result = _pick(picked_store, *args)

    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_pick_states_the_error_rate_of_the_choice_and_takes_the_candidates_control(picked_store):
    result = _pick(picked_store, "--max-drop", f"{ACC}=1")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.splitlines()[1].startswith(
        "The chance of shipping a variant truly over a drop limit is at most 2.5%: the 3 candidates tested in a "
        "fixed sequence (w8, fp8, int4), each at 2.5%"
    )
    assert result.stdout.splitlines()[2].startswith("w8's figures are selected")  # with its adjusted intervals
    uncorrected = _pick(picked_store, "--json", "--max-drop", f"{ACC}=1", "--candidates", "none")
    assert json.loads(uncorrected.stdout)["error_control"]["error_rate"] == pytest.approx(0.075)
    declared = _pick(picked_store, "--json", "--sequence", "int4", "--sequence", "w8")
    assert json.loads(declared.stdout)["error_control"]["order"] == ["int4", "w8", "fp8"]
    refused = _pick(picked_store, "--candidates", "holm")
    assert refused.returncode == 2
    assert refused.stderr.strip() == "error: --candidates: 'holm' is not one of fixed_sequence, bonferroni, none"
    unknown = _pick(picked_store, "--sequence", "nf4")
    assert unknown.returncode == 2 and "sequence names nf4, not among the candidates (fp8, int4, w8)" in unknown.stderr
