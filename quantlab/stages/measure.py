"""The runner's measure stage: the cost of one loaded variant as metrics and tags to log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantlab.measure.contention import CONTENDED_TAG
from quantlab.measure.cost import measure_cost
from quantlab.measure.settings import MeasureSettings


def measure(
    model: Any,
    tokenizer: Any,
    settings: MeasureSettings,
    checkpoint_dir: Path | None,
    load_seconds: float | None,
    sweep_dir: Path | None = None,
) -> tuple[dict[str, float], dict[str, str]]:
    """The variant's `cost/*` and `measure/*` metrics (what competed with its timing), `quantlab.cost.*` tags,
    and `quantlab.cost_contended`: whether other work competed for its cores while it was timed. `sweep_dir`, a
    folder the sweep's variants share (the job's log folder), keeps its one bandwidth probe per host."""
    report = measure_cost(model, tokenizer, settings, checkpoint_dir, load_seconds, sweep_dir)
    contention = report.contention()
    flag = {CONTENDED_TAG: str(contention.contended).lower()} if contention is not None else {}
    return report.to_metrics(), report.to_tags() | flag
