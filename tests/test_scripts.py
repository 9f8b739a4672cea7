"""scripts/gpu_check.py end to end on CPU (tiny shape), and its refusal of the 8B shape without CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from mlflow.tracking import MlflowClient

REPO = Path(__file__).resolve().parents[1]
GPU_CHECK = REPO / "scripts" / "gpu_check.py"
VARIANTS = ("bf16", "fp8", "awq-int4-g128")


def gpu_check(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(GPU_CHECK), *args],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def table_rows(stdout: str) -> dict[str, dict[str, str]]:
    """The Markdown table's rows by variant, each cell by its header."""
    lines = [line for line in stdout.splitlines() if line.startswith("| ")]
    headers = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = [dict(zip(headers, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]
    return {row["variant"]: row for row in rows}


def test_tiny_cpu_run_prints_one_row_per_variant_with_its_kernel_path(tmp_path):
    result = gpu_check("--shape", "tiny", "--device", "cpu", "--out", "tmp", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-4000:]
    rows = table_rows(result.stdout)
    assert set(rows) == set(VARIANTS)
    for name, row in rows.items():
        assert "kernel path" in row and row["kernel path"].endswith("on CPU"), (name, row)
        assert float(row["decode tok/s"].replace(",", "")) > 0, (name, row)
    assert "INT4 group-128" in rows["awq-int4-g128"]["kernel path"]
    assert "FP8" in rows["fp8"]["kernel path"]
    bits = {name: float(row["bits/weight"]) for name, row in rows.items()}
    assert bits["awq-int4-g128"] < bits["fp8"] < bits["bf16"] == 16.0
    assert (tmp_path / "tmp" / "table.md").is_file()

    # The figures are the real sweep's: its parent run and variant runs in the store it kept.
    results = json.loads((tmp_path / "tmp" / "results.json").read_text())
    client = MlflowClient(results["tracking_uri"])
    parent = client.get_run(results["parent_run_id"])
    assert parent.data.tags["quantlab.role"] == "sweep" and parent.info.status == "FINISHED"
    assert {"recipe.yaml", "frontier.json", "report.md"} <= {
        item.path for item in client.list_artifacts(parent.info.run_id)
    }
    runs = client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    assert {run.data.tags["quantlab.variant"] for run in runs} == set(VARIANTS)
    for run in runs:
        row = rows[run.data.tags["quantlab.variant"]]
        assert row["kernel path"] == run.data.tags["quantlab.cost.kernel_path"]
        assert row["decode tok/s"] == f"{run.data.metrics['cost/decode_tokens_per_s']:,.1f}"
        assert row["bits/weight"] == f"{run.data.metrics['cost/bits_per_weight']:.2f}"


def test_8b_shape_without_cuda_exits_2_with_one_clear_line(tmp_path):
    # An empty CUDA_VISIBLE_DEVICES hides any GPU, so this holds on a GPU box too.
    result = gpu_check("--shape", "llama-3.1-8b", cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.strip() == "no CUDA device; run with --shape tiny for a CPU smoke run"
    assert result.stdout == ""
