"""The runner's measure stage: the cost of one loaded variant as metrics and tags to log."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantlab.measure.cost import measure_cost
from quantlab.measure.settings import MeasureSettings


@dataclass(frozen=True)
class MeasureOutput:
    metrics: dict[str, float]
    tags: dict[str, str]


def measure(
    model: Any, tokenizer: Any, settings: MeasureSettings, checkpoint_dir: Path | None, load_seconds: float | None
) -> MeasureOutput:
    report = measure_cost(model, tokenizer, settings, checkpoint_dir, load_seconds)
    return MeasureOutput(report.to_metrics(), report.to_tags())
