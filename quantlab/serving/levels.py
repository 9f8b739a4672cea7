"""guidellm's JSON report (format version 2, guidellm 0.8) as one `LoadLevel` per benchmark: pure parsing.

Figures are over the level's successful requests. TTFT, ITL and TPOT are per request (ITL: the request's mean
gap between tokens; TPOT: its time per output token including the first); tokens/s and requests/s are rates over
the level's measured window.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

REPORT_VERSION = 2


@dataclass(frozen=True)
class LoadLevel:
    label: str  # c4 (4 concurrent streams), sync, max (every request at once), r2.5 (2.5 requests/s)
    strategy: str  # guidellm's strategy type
    concurrency: float  # mean requests in flight while measured
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    itl_ms_p50: float
    itl_ms_p99: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    succeeded: int
    errors: int
    incomplete: int
    output_tokens_min: float  # per successful request: the stage checks it against the asked length
    slo_attainment: float | None  # share of requests meeting guidellm's per-request SLO, when it had one
    first_error: str | None = None

    FIGURES = (
        "output_tokens_per_s",
        "requests_per_s",
        "ttft_ms_p50",
        "ttft_ms_p99",
        "itl_ms_p50",
        "itl_ms_p99",
        "tpot_ms_p50",
        "tpot_ms_p99",
        "errors",
        "slo_attainment",
        "concurrency",
    )

    def figures(self) -> dict[str, float]:
        """The level's loggable figures: finite numbers only (a level of only errors has no latency)."""
        values = {name: getattr(self, name) for name in self.FIGURES}
        return {name: float(value) for name, value in values.items() if value is not None and math.isfinite(value)}


class ReportError(ValueError):
    """A report this version cannot read."""


def load_levels(report: Mapping[str, Any]) -> list[LoadLevel]:
    version = (report.get("metadata") or {}).get("version")
    if version != REPORT_VERSION:
        raise ReportError(f"guidellm report of format {version!r}; quantlab reads format {REPORT_VERSION}")
    benchmarks = report.get("benchmarks") or []
    if not benchmarks:
        raise ReportError("guidellm's report holds no benchmark (no load level completed)")
    return [_level(benchmark) for benchmark in benchmarks]


def level_label(strategy: Mapping[str, Any]) -> str:
    kind = strategy.get("type_", "?")
    if kind == "concurrent":
        return f"c{strategy['streams']}"
    if kind == "synchronous":
        return "sync"
    if kind == "throughput":
        return "max"
    if "rate" in strategy:
        return f"r{float(strategy['rate']):.3g}"
    return str(kind)


def _level(benchmark: Mapping[str, Any]) -> LoadLevel:
    strategy = benchmark["config"]["strategy"]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]

    def successful(name: str) -> Mapping[str, Any]:
        return metrics[name]["successful"]

    def percentile(name: str, q: str) -> float:
        found = successful(name)
        return _number(found["percentiles"][q]) if found.get("count") else math.nan

    errored = (benchmark.get("requests") or {}).get("errored") or []
    first_error = next((str(item["info"]["error"]) for item in errored if (item.get("info") or {}).get("error")), None)
    return LoadLevel(
        label=level_label(strategy),
        strategy=strategy.get("type_", "?"),
        concurrency=_number(successful("request_concurrency")["mean"]),
        output_tokens_per_s=_number(successful("output_tokens_per_second")["mean"]),
        requests_per_s=_number(successful("requests_per_second")["mean"]),
        ttft_ms_p50=percentile("time_to_first_token_ms", "p50"),
        ttft_ms_p99=percentile("time_to_first_token_ms", "p99"),
        itl_ms_p50=percentile("inter_token_latency_ms", "p50"),
        itl_ms_p99=percentile("inter_token_latency_ms", "p99"),
        tpot_ms_p50=percentile("time_per_output_token_ms", "p50"),
        tpot_ms_p99=percentile("time_per_output_token_ms", "p99"),
        succeeded=int(totals["successful"]),
        errors=int(totals["errored"]),
        incomplete=int(totals["incomplete"]),
        output_tokens_min=_number(successful("output_token_count")["min"]),
        slo_attainment=_number(metrics["slo_attainment"]) if metrics.get("slo_attainment") is not None else None,
        first_error=first_error,
    )


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def levels_from_metrics(metrics: Mapping[str, float]) -> list[LoadLevel]:
    """The load levels a run logged as `cost/serving/<level>/<figure>` (LoadLevel.figures), in order of throughput;
    figures not logged read as NaN."""
    found: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        parts = key.split("/")
        if len(parts) == 4 and parts[:2] == ["cost", "serving"] and parts[3] in LoadLevel.FIGURES:
            found.setdefault(parts[2], {})[parts[3]] = value
    measured = [name for name in LoadLevel.FIGURES if name not in ("errors", "slo_attainment")]
    levels = [
        LoadLevel(
            label=label,
            strategy="logged",
            **{name: figures.get(name, math.nan) for name in measured},
            succeeded=0,
            errors=int(figures.get("errors", 0)),
            incomplete=0,
            output_tokens_min=math.nan,
            slo_attainment=figures.get("slo_attainment"),
        )
        for label, figures in found.items()
    ]
    return sorted(levels, key=lambda level: level.output_tokens_per_s)
