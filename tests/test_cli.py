"""The command line's contract: exit codes, one-line errors naming file and field, nothing half-written."""

from __future__ import annotations

import time

import pytest
from mlflow.tracking import MlflowClient

from conftest import free_port
from recipes import tiny_recipe, write
from test_sweep import quantlab




@pytest.fixture
def broken(tmp_path, tiny_llama):
    return write(tmp_path / "broken.yaml", tiny_recipe(tiny_llama.path, baseline="bf17"))


@pytest.mark.parametrize("command", ["validate", "sweep"])
def test_broken_recipe_exits_2_with_one_line_and_no_run(tmp_path, broken, command):
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    args = [command, str(broken)] + (["--tracking-uri", uri, "--cache-dir", str(tmp_path / "cache")] if command == "sweep" else [])
    result = quantlab(*args, cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {broken}: baseline: 'bf17' is not a variant name (did you mean 'bf16'?)"
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "cache").exists()
    assert not (tmp_path / "store.db").exists() or not MlflowClient(uri).search_runs(
        [e.experiment_id for e in MlflowClient(uri).search_experiments()])


def test_unreachable_tracking_server_exits_2_before_any_work(tmp_path, tiny_llama):
    recipe = write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path))
    started = time.monotonic()
    result = quantlab("sweep", str(recipe), "--tracking-uri", f"http://127.0.0.1:{free_port()}",
                      "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "is unreachable" in result.stderr and "Traceback" not in result.stderr
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
    store = MlflowClient(f"sqlite:///{tmp_path / 'store.db'}")
    assert not (tmp_path / "store.db").exists() or not store.search_runs([e.experiment_id for e in store.search_experiments()])


def test_pick_on_an_empty_store_is_bad_input(tmp_path):
    result = quantlab("pick", "--experiment", "nothing", "--tracking-uri", f"sqlite:///{tmp_path / 'store.db'}", cwd=tmp_path)
    assert result.returncode == 2
    assert "no experiment named 'nothing'" in result.stderr


def test_help_explains_every_command(tmp_path):
    result = quantlab("--help", cwd=tmp_path)
    for command in ("sweep", "validate", "frontier", "pick", "report", "ui"):
        assert command in result.stdout
    assert "METRIC=POINTS" in quantlab("pick", "--help", cwd=tmp_path).stdout
