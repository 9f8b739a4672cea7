"""A reused checkpoint is hashed while its variant loads and is scored (issue 28, item 12): one whose payload changed
on disk since it was written fails its variant with one line, logs no figure, and is set aside for the next sweep to
rebuild. A real sweep of the tiny Llama into real SQLite stores."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow.tracking import MlflowClient
from test_sweep import quantlab

from quantlab import cache
from recipes import REPO, tiny_recipe, write


def _variant_runs(uri: str) -> dict:
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id], "tags.`quantlab.role` = 'variant'")
    return {run.data.tags["quantlab.variant"]: run for run in runs}


def _flip_a_payload_byte(checkpoint: Path) -> Path:
    """One bit of the last tensor's data (past the safetensors header): sizes and header stay as recorded."""
    [weights] = checkpoint.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    header_end = 8 + int.from_bytes(data[:8], "little")
    assert len(data) - 5 > header_end
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    return weights


def test_a_flipped_byte_in_a_reused_checkpoint_fails_its_variant_with_one_line_and_no_figures(tmp_path, tiny_llama):
    recipe = tiny_recipe(
        tiny_llama.path,
        variants=[{"name": "bf16", "method": "bf16"}, {"name": "fp8", "method": "fp8"}],
        evals={"include_path": str(REPO / "evals"), "tasks": [{"name": "mmlu_dev", "limit": 4}]},
    )
    path = write(tmp_path / "recipe.yaml", recipe)
    cached = tmp_path / "cache"

    def sweep(store: str):
        uri = f"sqlite:///{tmp_path / store}"
        done = quantlab("sweep", str(path), "--tracking-uri", uri, "--cache-dir", str(cached), cwd=tmp_path)
        return uri, done

    _, first = sweep("first.db")
    assert first.returncode == 0, first.stdout + first.stderr
    [checkpoint] = [c for c in cache.complete_checkpoints(cached) if c.name.startswith("fp8-")]
    weights = _flip_a_payload_byte(checkpoint)
    assert cache.check_checkpoint(checkpoint) == []  # what reuse checks before loading cannot see it

    # A new store: nothing logged to copy, so both variants run again on their cached checkpoints.
    uri, second = sweep("second.db")
    assert second.returncode == 1, second.stdout + second.stderr
    runs = _variant_runs(uri)
    assert {name: run.info.status for name, run in runs.items()} == {"bf16": "FINISHED", "fp8": "FAILED"}
    assert runs["bf16"].data.tags["quantlab.checkpoint_reused"] == "true" and runs["bf16"].data.metrics
    failed = runs["fp8"]
    reason = failed.data.tags["quantlab.failure"]
    assert "\n" not in reason and reason.startswith("CheckpointChanged: the cached checkpoint fp8-")
    assert f"{weights.name}: SHA-256 differs from the record" in reason and "the next sweep rebuilds it" in reason
    assert failed.data.metrics == {}  # nothing scored on it is logged
    assert not any(key.startswith(("eval/", "quality/", "cost/")) for key in failed.data.params)
    assert reason in second.stdout + second.stderr
    assert not checkpoint.exists()
    [aside] = checkpoint.parent.glob(f"{checkpoint.name}.corrupt-*")
    assert json.loads((aside / cache.COMPLETE_MARKER).read_text())["files"]  # kept for a look, never loaded again

    # The next sweep rebuilds it: fp8 succeeds on a fresh checkpoint, hashed as it is written.
    uri, third = sweep("third.db")
    assert third.returncode == 0, third.stdout + third.stderr
    runs = _variant_runs(uri)
    assert runs["fp8"].data.tags["quantlab.checkpoint_reused"] == "false" and runs["fp8"].data.metrics
    assert cache.check_checkpoint(checkpoint, deep=True) == []
    # Issue 28 item 10, seen in the same sweep: its variants' ceilings rest on one bandwidth probe of this host.
    bandwidths = {run.data.metrics["cost/measured_bandwidth_bytes_per_s"] for run in runs.values()}
    assert len(bandwidths) == 1
    assert all("taken once for the sweep" in run.data.tags["quantlab.cost.bandwidth_probe"] for run in runs.values())
