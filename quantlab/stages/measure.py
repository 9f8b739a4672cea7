"""The runner's measure stage: the cost of one loaded variant as metrics and tags to log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quantlab.measure.cost import measure_cost
from quantlab.measure.settings import MeasureSettings


def measure(
    model: Any, tokenizer: Any, settings: MeasureSettings, checkpoint_dir: Path | None, load_seconds: float | None
) -> tuple[dict[str, float], dict[str, str]]:
    """The variant's `cost/*` metrics and `quantlab.cost.*` tags."""
    report = measure_cost(model, tokenizer, settings, checkpoint_dir, load_seconds)
    return report.to_metrics(), report.to_tags()
