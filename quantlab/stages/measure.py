"""The runner's measure stage: the cost of one loaded variant as metrics and tags to log."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from quantlab.measure.contention import CONTENDED_TAG, CONTENTION_TAG
from quantlab.measure.cost import SingleStream, measure_cost
from quantlab.measure.settings import MeasureSettings


def measure(
    model: Any,
    tokenizer: Any,
    settings: MeasureSettings,
    checkpoint_dir: Path | None,
    load_seconds: float | None,
    sweep_dir: Path | None = None,
    single_stream: SingleStream | None = None,
) -> tuple[dict[str, float], dict[str, str]]:
    """The variant's `cost/*` and `measure/*` metrics (what competed with its timing), `quantlab.cost.*` tags,
    and `quantlab.cost_contended`: whether other work competed for its cores while it was timed. `sweep_dir`, a
    folder the sweep's variants share (the job's log folder), keeps its one bandwidth probe per host.
    `single_stream`: batch size 1 is the serve stage's to time."""
    report = measure_cost(model, tokenizer, settings, checkpoint_dir, load_seconds, sweep_dir, single_stream)
    contention = report.contention()
    flag = {CONTENDED_TAG: str(contention.contended).lower()} if contention is not None else {}
    return report.to_metrics(), report.to_tags() | flag


def contention_over(*stages: Mapping[str, str]) -> dict[str, str]:
    """The verdict over every stage that timed something (each stage's tags, with or without one): contended if
    any was, with the reasons of those that were (else of all)."""
    judged = [tags for tags in stages if CONTENDED_TAG in tags]
    if not judged:
        return {}
    contended = [tags for tags in judged if tags[CONTENDED_TAG] == "true"]
    reasons = [tags[CONTENTION_TAG] for tags in contended or judged if CONTENTION_TAG in tags]
    return {CONTENDED_TAG: str(bool(contended)).lower(), CONTENTION_TAG: "; ".join(reasons)}
