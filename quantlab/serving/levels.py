"""guidellm's JSON report (format version 2, guidellm 0.8) as one `LoadLevel` per benchmark: pure parsing.

Figures are over the level's successful requests. TTFT, ITL and TPOT are per request (ITL: the request's mean
gap between tokens; TPOT: its time per output token including the first); tokens/s and requests/s are rates over
the level's measured window.

guidellm's percentiles are nearest-rank (`Percentiles.from_pdf`: the first value whose cumulative share reaches q;
ITL and TPOT are weighted by each request's tokens, equal weights at a fixed output length): its p99 of 8 requests
is their maximum. Its cumulative shares are floating sums, so where q n / 100 is whole it may take the next rank
(its p50 of 20 is the 11th, its p90 of 10 the maximum); the p50 and p99 kept here are exact at their thresholds
(2 and 100 requests). TTFT is windowed by first tokens, so its requests can be fewer than the level's. A percentile
is kept only where the level's requests support it (`supports`: p50 from 2, p99 from 100); the maximum is always
kept, under its own name (`*_max`), and `left_out` says which were not.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from quantlab.metrics import min_requests, supports

REPORT_VERSION = 2
LATENCIES = ("ttft_ms", "itl_ms", "tpot_ms")
PERCENTILES = {"p50": 50, "p99": 99}  # kept where the level's requests support them; guidellm reports more
_LATENCY_FIGURES = tuple(f"{latency}_{name}" for latency in LATENCIES for name in (*PERCENTILES, "max"))


@dataclass(frozen=True)
class LoadLevel:
    label: str  # c4 (4 concurrent streams), sync, max (every request at once), r2.5 (2.5 requests/s)
    strategy: str  # guidellm's strategy type
    concurrency: float  # mean requests in flight while measured
    output_tokens_per_s: float
    requests_per_s: float
    # Percentiles: NaN where the level's successful requests do not support them (`supports`); maxima always.
    ttft_ms_p50: float
    ttft_ms_p99: float
    ttft_ms_max: float
    itl_ms_p50: float
    itl_ms_p99: float
    itl_ms_max: float
    tpot_ms_p50: float
    tpot_ms_p99: float
    tpot_ms_max: float
    succeeded: int  # successful requests in the measured window (guidellm's warm-up left out)
    errors: int
    incomplete: int  # cut off by the level's time limit (seconds_per_level): in no figure, as in guidellm's
    output_tokens_min: float  # per successful request: the stage checks it against the asked length
    # Share of the requests meeting every per-request SLO (guidellm's count: errored ones miss, cut-off ones are left
    # out); None when guidellm had no SLO or could judge no request.
    slo_attainment: float | None
    first_error: str | None = None
    sampled: int | None = None  # requests the latency percentiles are over, if fewer than `succeeded`
    # guidellm's measured window, in seconds since the epoch (None: a report or a logged run that does not say)
    started_at: float | None = None
    ended_at: float | None = None
    runs: int = 1  # runs of the level pooled into these figures (quantlab.serving.intervals); percentiles are per run
    # The median ITL of the run's warm-up requests in guidellm's request sample (those that ended before the measured
    # window opened): the run's own pace before it was timed. None where the sample holds none.
    warm_up_itl_ms: float | None = None

    LATENCIES = LATENCIES
    PERCENTILES = PERCENTILES
    FIGURES = (
        "output_tokens_per_s",
        "requests_per_s",
        *_LATENCY_FIGURES,
        "succeeded",
        "errors",
        "incomplete",
        "slo_attainment",
        "concurrency",
    )
    COUNTS = ("succeeded", "errors", "incomplete")

    def figures(self) -> dict[str, float]:
        """The level's loggable figures: finite numbers only (a level of only errors has no latency, a level of 8
        requests no p99)."""
        values = {name: getattr(self, name) for name in self.FIGURES}
        return {name: float(value) for name, value in values.items() if value is not None and math.isfinite(value)}

    def tail(self, latency: str) -> float:
        """The highest percentile kept of `latency` (one of LATENCIES): its p99, else its maximum."""
        p99 = getattr(self, f"{latency}_p99")
        return p99 if math.isfinite(p99) else getattr(self, f"{latency}_max")

    def left_out(self) -> dict[str, str]:
        """Each percentile the level's requests do not support, and why (logged as a tag beside the figures)."""
        n = self.succeeded if self.sampled is None else self.sampled
        timed = f"{n} requests timed at {self.label}" + (" in its smallest run" if self.runs > 1 else "")
        return {
            name: f"{timed}: a {name} needs at least {min_requests(q)} (nearest rank, the "
            f"{name} of {n} is their maximum); cost/serving/{self.label}/*_max is logged"
            for name, q in self.PERCENTILES.items()
            if not supports(q, n)
        }


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

    succeeded = int(totals["successful"])  # ITL's and TPOT's counts are of tokens: a request's count is this
    # TTFT's count is of requests, windowed by first tokens: at most the level's, sometimes fewer.
    sampled = min(succeeded, int(successful("time_to_first_token_ms").get("count") or 0))

    def percentile(name: str, q: str) -> float:
        found = successful(name)
        supported = q == "max" or supports(LoadLevel.PERCENTILES[q], sampled)
        if not found.get("count") or not supported:
            return math.nan
        return _number(found["max"] if q == "max" else found["percentiles"][q])

    errored = (benchmark.get("requests") or {}).get("errored") or []
    first_error = next((str(item["info"]["error"]) for item in errored if (item.get("info") or {}).get("error")), None)
    return LoadLevel(
        label=level_label(strategy),
        strategy=strategy.get("type_", "?"),
        concurrency=_number(successful("request_concurrency")["mean"]),
        output_tokens_per_s=_number(successful("output_tokens_per_second")["mean"]),
        requests_per_s=_number(successful("requests_per_second")["mean"]),
        **{
            f"{latency}_{q}": percentile(name, q)
            for latency, name in _DISTRIBUTIONS.items()
            for q in (*LoadLevel.PERCENTILES, "max")
        },
        succeeded=succeeded,
        errors=int(totals["errored"]),
        incomplete=int(totals["incomplete"]),
        output_tokens_min=_number(successful("output_token_count")["min"]),
        slo_attainment=_number(metrics["slo_attainment"]) if metrics.get("slo_attainment") is not None else None,
        first_error=first_error,
        sampled=sampled if sampled < succeeded else None,
        started_at=_optional(benchmark.get("start_time")),
        ended_at=_optional(benchmark.get("end_time")),
        warm_up_itl_ms=_warm_up_itl_ms(benchmark),
    )


def _warm_up_itl_ms(benchmark: Mapping[str, Any]) -> float | None:
    opened = (benchmark.get("scheduler_metrics") or {}).get("measure_start_time")  # the measured window's start
    requests = (benchmark.get("requests") or {}).get("successful") or []
    if opened is None:
        return None
    found = [
        float(request["inter_token_latency_ms"])
        for request in requests
        if request.get("inter_token_latency_ms") and (request.get("request_end_time") or math.inf) < opened
    ]
    return statistics.median(found) if found else None


def _optional(value: Any) -> float | None:
    return None if value is None else float(value)


_DISTRIBUTIONS = {
    "ttft_ms": "time_to_first_token_ms",
    "itl_ms": "inter_token_latency_ms",
    "tpot_ms": "time_per_output_token_ms",
}


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
    measured = [name for name in LoadLevel.FIGURES if name not in (*LoadLevel.COUNTS, "slo_attainment")]
    levels = [
        LoadLevel(
            label=label,
            strategy="logged",
            **{name: figures.get(name, math.nan) for name in measured},
            **{name: int(figures.get(name, 0)) for name in LoadLevel.COUNTS},
            output_tokens_min=math.nan,
            slo_attainment=figures.get("slo_attainment"),
        )
        for label, figures in found.items()
    ]
    return sorted(levels, key=lambda level: level.output_tokens_per_s)
