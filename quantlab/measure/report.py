"""The cost of one variant, measured and modeled, as MLflow metrics `cost/<figure>` and tags.

Figures of other batch sizes than the first configured one carry a `_bs<N>` suffix. A figure that could not
be produced is never logged as zero: it is left out, and the tag `quantlab.cost.unavailable.<figure>` says why.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from operator import attrgetter
from typing import Any

import numpy as np

from quantlab.measure.modeled import ModeledCost
from quantlab.measure.timing import BandwidthReading, GenerationTiming
from quantlab.measure.trackers import EnergyReading, MemoryReading

TAG_PREFIX = "quantlab.cost."
PERCENTILES = (50, 90, 99)

# Figures of the whole measurement window, read off a MeasuredCost (those of one batch size are BatchFigures' fields).
WINDOW_FIGURES = {
    "peak_memory_bytes": attrgetter("memory.peak_bytes"),
    "peak_device_memory_bytes": attrgetter("memory.peak_device_memory_bytes"),
    "process_peak_rss_bytes": attrgetter("memory.process_peak_rss_bytes"),
    "measured_bandwidth_bytes_per_s": attrgetter("bandwidth.bytes_per_s"),
    "loaded_weight_bytes": attrgetter("loaded_weight_bytes"),
}
DEFINITIONS = (
    "weight_bytes: *.safetensors files on disk; weight_bytes_in_memory: their tensor payload (the stored format); "
    "loaded_weight_bytes: parameters as loaded here; bits_per_weight: over decoder-block linear weights; "
    "bits_per_parameter: over all parameters; ttft: prefill of the whole batch + first token; "
    "itl: one decode step; energy_joules_per_token: GPU energy of the timed generations / tokens generated; "
    "roofline_efficiency: decode_tokens_per_s / local_roofline_decode_tokens_per_s (measured copy bandwidth, "
    "weights as loaded, KV at prompt + output/2 tokens)"
)


@dataclass(frozen=True)
class BatchFigures:
    """Medians and percentiles of one batch size's timed generations."""

    batch_size: int
    prefill_tokens_per_s: float  # median over repeats
    decode_tokens_per_s: float  # median over repeats
    ttft_ms_p50: float  # percentiles over repeats
    ttft_ms_p90: float
    ttft_ms_p99: float
    itl_ms_p50: float  # percentiles over every decode step of every repeat
    itl_ms_p90: float
    itl_ms_p99: float
    energy_joules_per_token: float | None
    local_roofline_decode_tokens_per_s: float | None
    roofline_efficiency: float | None
    unavailable: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def summarize(
        cls, timings: Sequence[GenerationTiming], energy: EnergyReading, local_roofline: float | str
    ) -> BatchFigures:
        """`local_roofline`: decode tokens/s ceiling on this hardware, or why there is none."""
        ttft_ms = [timing.first_token_s * 1000 for timing in timings]
        itl_ms = [step * 1000 for timing in timings for step in timing.inter_token_s]
        decode = float(np.median([timing.decode_tokens_per_s for timing in timings]))
        generated = sum(timing.batch_size * timing.output_tokens for timing in timings)
        unavailable = {}
        if energy.joules is None:
            unavailable["energy_joules_per_token"] = energy.unavailable_reason or "not measured"
        if isinstance(local_roofline, str):
            unavailable["local_roofline_decode_tokens_per_s"] = local_roofline
            unavailable["roofline_efficiency"] = local_roofline
        roofline = None if isinstance(local_roofline, str) else local_roofline
        return cls(
            batch_size=timings[0].batch_size,
            prefill_tokens_per_s=float(np.median([timing.prefill_tokens_per_s for timing in timings])),
            decode_tokens_per_s=decode,
            **{f"ttft_ms_p{q}": float(np.percentile(ttft_ms, q)) for q in PERCENTILES},
            **{f"itl_ms_p{q}": float(np.percentile(itl_ms, q)) for q in PERCENTILES},
            energy_joules_per_token=None if energy.joules is None else energy.joules / generated,
            local_roofline_decode_tokens_per_s=roofline,
            roofline_efficiency=None if roofline is None else decode / roofline,
            unavailable=unavailable,
        )

    def figures(self) -> dict[str, float]:
        return {name: float(value) for name in BATCH_FIGURES if (value := getattr(self, name)) is not None}


BATCH_FIGURES = tuple(field.name for field in fields(BatchFigures) if field.name not in ("batch_size", "unavailable"))


@dataclass(frozen=True)
class MeasuredCost:
    batches: tuple[BatchFigures, ...]  # in configured order: the first is the default batch size
    memory: MemoryReading
    bandwidth: BandwidthReading
    loaded_weight_bytes: int
    # Tags of how the figures were produced: engine, kernel path, hardware, clock, workload, host load, ...
    described: Mapping[str, str]

    def _per_batch(self, by_name: Callable[[BatchFigures], Mapping[str, Any]]) -> dict[str, Any]:
        """Figures of the default (first) batch size under their plain names, the others' with `_bs<N>`."""
        default = self.batches[0].batch_size
        return {
            name if batch.batch_size == default else f"{name}_bs{batch.batch_size}": value
            for batch in self.batches
            for name, value in by_name(batch).items()
        }

    def figures(self) -> dict[str, float]:
        window = {name: float(value) for name, read in WINDOW_FIGURES.items() if (value := read(self)) is not None}
        return {**self._per_batch(BatchFigures.figures), **window}

    def unavailable(self) -> dict[str, str]:
        return {**self._per_batch(lambda batch: batch.unavailable), **self.memory.unavailable}


@dataclass(frozen=True)
class CostReport:
    modeled: ModeledCost
    measured: MeasuredCost | None  # None when measurement is disabled
    load_seconds: float | None
    notes: Mapping[str, str] = field(default_factory=dict)  # other figures absent, and why

    def unavailable(self) -> dict[str, str]:
        """Why each absent figure is absent, by figure name."""
        reasons = {**self.modeled.unavailable, **self.notes}
        if self.measured is not None:
            reasons.update(self.measured.unavailable())
        return reasons

    def to_metrics(self) -> dict[str, float]:
        metrics = self.modeled.to_metrics()
        if self.load_seconds is not None:
            metrics["cost/load_seconds"] = float(self.load_seconds)
        if self.measured is not None:
            metrics.update({f"cost/{name}": value for name, value in self.measured.figures().items()})
        return metrics

    def to_tags(self) -> dict[str, str]:
        spec = self.modeled.target_spec
        tags = {
            "target": (
                f"{self.modeled.target}: {spec.memory_bytes} B, {spec.bandwidth_bytes_per_s:.4g} B/s ({spec.source})"
            ),
            "assumptions": self.modeled.assumptions,
            "definitions": DEFINITIONS,
            **(self.measured.described if self.measured is not None else {}),
            **{f"unavailable.{name}": reason for name, reason in self.unavailable().items()},
        }
        return {f"{TAG_PREFIX}{name}": value for name, value in tags.items()}
