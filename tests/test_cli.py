"""The command line's contract: exit codes, one-line errors naming file and field, nothing half-written."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from conftest import free_port
from quantlab.tracking import shown_uri
from recipes import tiny_recipe, write
from test_sweep import quantlab


def _variants(*extra):
    return [{"name": "bf16", "method": "bf16"}, *extra]


# One recipe per kind of bad input; each must stop a sweep before any work.
BROKEN = {
    "unknown variant": ({"baseline": "bf17"}, "baseline: 'bf17' is not a variant name (did you mean 'bf16'?)"),
    "yaml syntax": ("name: x\nvariants: [\n  - a\nbaseline: x\n", "line 3"),
    "wrong type": ({"calibration": {"num_samples": "many"}}, "calibration.num_samples: "),
    "unknown key": ({"colour": "red"}, "colour: unknown key"),
    "no variants": ({"variants": []}, "variants: "),
    "duplicate name": ({"variants": _variants({"name": "bf16", "method": "fp8"})}, "variants[1] (bf16).name: duplicate"),
    "group size": ({"variants": _variants({"name": "w4", "method": "awq_int4", "params": {"group_size": 48}})},
                   "variants[1] (w4).params.group_size: "),
    "unknown task": ({"evals": {"tasks": [{"name": "mmlu_dve"}]}}, "evals.tasks[0].name: lm-eval cannot resolve task 'mmlu_dve'"),
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
        edit = tiny_recipe(tiny_llama.path, **{key: base.get(key, {}) | value if isinstance(value, dict) else value
                                               for key, value in edit.items()})
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
    result = quantlab("sweep", str(recipe), "--tracking-uri", f"http://alice:s3cret@127.0.0.1:{free_port()}",
                      "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is unreachable" in result.stderr and "Traceback" not in result.stderr
    assert "alice:***@127.0.0.1" in result.stderr and "s3cret" not in result.stdout + result.stderr
    assert not (tmp_path / "cache").exists()
    assert time.monotonic() - started < 60


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--executor", "slurm"], "--executor: 'slurm' is not one of: local, ray"),
        (["--only", "int3"], "--only: 'int3' is not a variant of recipe.yaml"),
    ],
)
def test_bad_flags_exit_2(tmp_path, tiny_llama, args, message):
    recipe = write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path))
    result = quantlab("sweep", str(recipe), "--tracking-uri", f"sqlite:///{tmp_path / 'store.db'}", *args, cwd=tmp_path)
    assert result.returncode == 2
    assert message in result.stderr
    assert _no_runs(f"sqlite:///{tmp_path / 'store.db'}", tmp_path / "store.db")


def test_pick_on_an_empty_store_is_bad_input(tmp_path):
    result = quantlab("pick", "--experiment", "nothing", "--tracking-uri", f"sqlite:///{tmp_path / 'store.db'}", cwd=tmp_path)
    assert result.returncode == 2
    assert "no experiment named 'nothing'" in result.stderr


def test_help_explains_every_command(tmp_path):
    result = quantlab("--help", cwd=tmp_path)
    for command in ("sweep", "validate", "frontier", "pick", "report", "ui"):
        assert command in result.stdout
    assert "METRIC=POINTS" in quantlab("pick", "--help", cwd=tmp_path).stdout
