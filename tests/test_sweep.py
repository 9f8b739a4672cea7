"""A real sweep of the tiny Llama into a temporary MLflow store: run layout, failure containment, exit codes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from quantlab.plan import results_version
from recipes import ON_POLICY, SWEEP_ARTIFACTS, tiny_recipe, write


def quantlab(*args: str, cwd: Path, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "quantlab", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def swept(tmp_path_factory, tiny_llama):
    """bf16, fp8 and awq; the calibration text is too short for AWQ, a real failure found only at run time.

    Only AWQ calibrates, so it must fail alone while bf16 and fp8 finish.
    """
    work = tmp_path_factory.mktemp("sweep")
    (work / "short.txt").write_text("Far too short to calibrate on.\n")
    calibration = {"source": "short.txt", "num_samples": 4, "seq_len": 32}
    recipe = tiny_recipe(tiny_llama.path, calibration=calibration, quality=ON_POLICY)
    path = write(work / "recipe.yaml", recipe)
    uri = f"sqlite:///{work / 'store.db'}"
    result = quantlab("sweep", str(path), "--tracking-uri", uri, "--cache-dir", str(work / "cache"), cwd=work)
    fork_servers = [  # the sweep's own, by its working folder on the server's path: looked for as the sweep exits
        p.pid
        for p in psutil.process_iter(["cmdline"])
        if "multiprocessing.forkserver" in " ".join(p.info["cmdline"] or [])
        and str(work) in " ".join(p.info["cmdline"])
    ]
    return work, uri, result, fork_servers


def test_the_fork_server_ends_with_the_sweep(swept):
    """Stopped by the command before it exits, not left to notice its parent's exit: an interrupt benchmark's sweep
    signalled as it exited left it running."""
    *_, fork_servers = swept
    assert fork_servers == []


def test_failed_variant_gives_exit_1_and_others_still_finish(swept):
    _, uri, result, _ = swept
    assert result.returncode == 1, result.stdout + result.stderr
    runs = _variant_runs(uri)
    assert {name: run.info.status for name, run in runs.items()} == {
        "bf16": "FINISHED",
        "fp8": "FINISHED",
        "awq": "FAILED",
    }


def test_failed_run_keeps_reason_and_traceback(swept):
    _, uri, _, _ = swept
    failed = _variant_runs(uri)["awq"]
    assert "calibration.num_samples" in failed.data.tags["quantlab.failure"]
    client = MlflowClient(uri)
    artifacts = {item.path for item in client.list_artifacts(failed.info.run_id, "failure")}
    assert artifacts == {"failure/traceback.txt"}
    text = Path(client.download_artifacts(failed.info.run_id, "failure/traceback.txt")).read_text()
    assert "Traceback" in text and "calibration" in text


def test_run_layout_follows_the_contract(swept):
    _, uri, _, _ = swept
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("tiny")
    parent = client.search_runs(
        [experiment.experiment_id], "tags.`quantlab.role` = 'sweep'", order_by=["attributes.start_time ASC"]
    )[0]
    runs = _variant_runs(uri)
    for name, run in runs.items():
        tags = run.data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id
        assert tags["quantlab.role"] == "variant" and tags["quantlab.variant"] == name
        assert tags["quantlab.method"] in {"bf16", "fp8", "awq_int4"}
        assert tags["quantlab.on_frontier"] in {"true", "false"}
        # what a later sweep finds it by: its settings, and how this quantlab computed its numbers
        assert tags["quantlab.results_version"] == results_version() and len(tags["quantlab.settings_key"]) > 8
    for name in ("bf16", "fp8"):
        run = runs[name]
        assert Path(run.data.tags["quantlab.checkpoint"], "config.json").is_file()
        metrics, tags = run.data.metrics, run.data.tags
        for task in ("mmlu_dev", "pydoc_cloze"):
            assert 0.0 <= metrics[f"eval/{task}/acc"] <= 1.0
            assert metrics[f"eval/{task}/acc_stderr"] >= 0.0  # 0 when a tiny random model scores all alike
            assert metrics[f"quality/paired/eval/{task}/acc/n"] == {"mmlu_dev": 4, "pydoc_cloze": 6}[task]
            assert tags[f"quantlab.metric/eval/{task}/acc"] == "higher fraction"
        assert {i.dataset.name for i in run.inputs.dataset_inputs} == {"mmlu_dev", "pydoc_cloze"}
        assert run.data.params["variant.method"] == name
        assert "versions.transformers" in run.data.params and "hardware.cpu_count" in run.data.params
    assert runs["fp8"].data.metrics["cost/weight_bytes"] < runs["bf16"].data.metrics["cost/weight_bytes"]
    parent_artifacts = {item.path for item in client.list_artifacts(parent.info.run_id)}
    # damage.png: this recipe measures on-policy damage by generated position
    assert SWEEP_ARTIFACTS | {"damage.png"} <= parent_artifacts


def test_on_policy_damage_is_logged_for_each_variant(swept):
    """quality.generate: each finished variant logs its damage over the baseline's continuations, prompt and
    generated positions apart, with paired intervals; the baseline against itself loses nothing."""
    runs = _variant_runs(swept[1])
    for name in ("bf16", "fp8"):
        metrics = runs[name].data.metrics
        for part in ("prompt", "generated", "gen1-32"):
            for figure in ("kld_mean", "top1_agreement", "ear", "delta_nll"):
                key = f"quality/on_policy/{part}/{figure}"
                assert key in metrics and f"quality/paired/{key}/ci95_high" in metrics, key
    baseline = runs["bf16"].data.metrics
    assert baseline["quality/on_policy/generated/kld_mean"] == 0.0
    assert baseline["quality/on_policy/generated/ear"] == 1.0
    assert baseline["quality/on_policy/generated/top1_agreement"] == 1.0
    assert runs["fp8"].data.metrics["quality/on_policy/generated/kld_mean"] > 0.0


def _sweep_fp8_again(work: Path, uri: str, *flags: str) -> subprocess.CompletedProcess:
    """The swept recipe once more, into the same store and cache, asking for fp8 only."""
    recipe, cache = str(work / "recipe.yaml"), str(work / "cache")
    return quantlab("sweep", recipe, "--tracking-uri", uri, "--cache-dir", cache, "--only", "fp8", *flags, cwd=work)


def test_unchanged_variants_are_copied_not_recomputed(swept):
    work, uri, _, _ = swept
    result = _sweep_fp8_again(work, uri)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Reused (unchanged, not recomputed): bf16, fp8" in result.stdout
    runs = _variant_runs(uri, newest=True)
    first = _variant_runs(uri)
    assert set(runs) == {"bf16", "fp8"}
    assert runs["fp8"].data.tags["quantlab.reused_from"] == first["fp8"].info.run_id
    assert runs["fp8"].data.metrics == first["fp8"].data.metrics
    assert {(i.dataset.name, i.dataset.digest) for i in runs["fp8"].inputs.dataset_inputs} == {
        (i.dataset.name, i.dataset.digest) for i in first["fp8"].inputs.dataset_inputs
    }


def test_force_recomputes_every_variant_and_the_reference(swept):
    work, uri, _, _ = swept
    before = _variant_runs(uri, newest=True)
    reference = Path(before["bf16"].data.tags["quantlab.reference_dir"]) / "reference.json"
    written = reference.stat().st_mtime_ns
    result = _sweep_fp8_again(work, uri, "--force")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Reused" not in result.stdout
    runs = _variant_runs(uri, newest=True)
    assert set(runs) == {"bf16", "fp8"}
    for run in runs.values():
        assert "quantlab.reused_from" not in run.data.tags
        assert run.data.tags["quantlab.checkpoint_reused"] == "false"
    assert reference.stat().st_mtime_ns > written


def _variant_runs(uri: str, newest: bool = False) -> dict:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("tiny")
    parent = client.search_runs(
        [experiment.experiment_id],
        "tags.`quantlab.role` = 'sweep'",
        order_by=[f"attributes.start_time {'DESC' if newest else 'ASC'}"],
    )[0]
    runs = client.search_runs([experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    return {run.data.tags["quantlab.variant"]: run for run in runs}
