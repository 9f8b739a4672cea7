"""measure_cost: time an already loaded variant in its own process, and model its serving cost, as MLflow
metrics `cost/<figure>` and tags `quantlab.cost.*`.

Figures of other batch sizes than the first configured one carry a `_bs<N>` suffix. A figure that could not
be produced is never logged as zero: it is left out, and the tag `quantlab.cost.unavailable.<figure>` says why.

Order matters for clean numbers: the generations run inside the memory window first; the
bandwidth probe (which allocates two large buffers) runs after it; the kernel path is read
last, once compressed-tensors has decompressed what it decompresses on the first forward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from operator import attrgetter
from pathlib import Path
from typing import Any

import numpy as np
import torch

from quantlab.measure.bandwidth import sweep_bandwidth
from quantlab.measure.contention import Contention, LoadMonitor, LoadReading, judge_contention
from quantlab.measure.modeled import (
    ModeledCost,
    ModelShape,
    config_dict,
    decode_roofline_tokens_per_s,
    kv_cache_bytes_per_token,
    modeled_cost,
    streamed_weight_bytes,
)
from quantlab.measure.provenance import describe_engine, describe_hardware, kernel_path
from quantlab.measure.settings import MeasureSettings
from quantlab.measure.timing import (
    BandwidthReading,
    GenerationTiming,
    clock_for,
    pinned_threads,
    random_prompt_ids,
    time_generation,
)
from quantlab.measure.trackers import EnergyTracker, MemoryReading, MemoryTracker

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
    """Medians and percentiles of one batch size's timed generations; a str figure says why it is absent."""

    batch_size: int
    prefill_tokens_per_s: float  # median over repeats
    decode_tokens_per_s: float  # median over repeats
    ttft_ms_p50: float  # percentiles over repeats
    ttft_ms_p90: float
    ttft_ms_p99: float
    itl_ms_p50: float  # percentiles over every decode step of every repeat
    itl_ms_p90: float
    itl_ms_p99: float
    energy_joules_per_token: float | str
    local_roofline_decode_tokens_per_s: float | str
    roofline_efficiency: float | str

    @classmethod
    def summarize(
        cls, timings: Sequence[GenerationTiming], joules: float | str, local_roofline: float | str
    ) -> BatchFigures:
        """`joules` drawn by the timed generations, `local_roofline` decode tokens/s here: each, or why none."""
        ttft_ms = [timing.first_token_s * 1000 for timing in timings]
        itl_ms = [step * 1000 for timing in timings for step in timing.inter_token_s]
        decode = float(np.median([timing.decode_tokens_per_s for timing in timings]))
        generated = sum(timing.batch_size * timing.output_tokens for timing in timings)
        return cls(
            batch_size=timings[0].batch_size,
            prefill_tokens_per_s=float(np.median([timing.prefill_tokens_per_s for timing in timings])),
            decode_tokens_per_s=decode,
            **{f"ttft_ms_p{q}": float(np.percentile(ttft_ms, q)) for q in PERCENTILES},
            **{f"itl_ms_p{q}": float(np.percentile(itl_ms, q)) for q in PERCENTILES},
            energy_joules_per_token=joules if isinstance(joules, str) else joules / generated,
            local_roofline_decode_tokens_per_s=local_roofline,
            roofline_efficiency=local_roofline if isinstance(local_roofline, str) else decode / local_roofline,
        )


BATCH_FIGURES = tuple(field.name for field in fields(BatchFigures) if field.name != "batch_size")


@dataclass(frozen=True)
class MeasuredCost:
    batches: tuple[BatchFigures, ...]  # in configured order: the first is the default batch size
    memory: MemoryReading
    bandwidth: BandwidthReading
    loaded_weight_bytes: int
    # Tags of how the figures were produced: engine, kernel path, hardware, clock, workload, host load, ...
    described: Mapping[str, str]
    load: LoadReading | None = None  # what competed with the timed generations (None: not read)

    def _values(self) -> dict[str, float | str]:
        """Every figure, or why it is absent; the default (first) batch size's under plain names, others' `_bs<N>`."""
        default = self.batches[0].batch_size
        per_batch = {
            name if batch.batch_size == default else f"{name}_bs{batch.batch_size}": getattr(batch, name)
            for batch in self.batches
            for name in BATCH_FIGURES
        }
        return {**per_batch, **{name: read(self) for name, read in WINDOW_FIGURES.items()}}

    def figures(self) -> dict[str, float]:
        return {name: float(value) for name, value in self._values().items() if not isinstance(value, str)}

    def unavailable(self) -> dict[str, str]:
        return {name: value for name, value in self._values().items() if isinstance(value, str)}


@dataclass(frozen=True)
class CostReport:
    modeled: ModeledCost
    measured: MeasuredCost | None  # None when measurement is disabled
    load_seconds: float | None  # None when the caller did not time the load

    def unavailable(self) -> dict[str, str]:
        """Why each absent figure is absent, by figure name."""
        reasons = dict(self.modeled.unavailable)
        if self.load_seconds is None:
            reasons["load_seconds"] = "the caller did not time the model load"
        if self.measured is None:
            reasons.update(dict.fromkeys((*BATCH_FIGURES, *WINDOW_FIGURES), "measure.enabled is false"))
        else:
            reasons.update(self.measured.unavailable())
        return reasons

    def to_metrics(self) -> dict[str, float]:
        metrics = self.modeled.to_metrics()
        if self.load_seconds is not None:
            metrics["cost/load_seconds"] = float(self.load_seconds)
        if self.measured is not None:
            metrics.update({f"cost/{name}": value for name, value in self.measured.figures().items()})
            if self.measured.load is not None:
                metrics.update(self.measured.load.to_metrics())
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
        if (contention := self.contention()) is not None:
            tags["contention"] = contention.reason
        return {f"{TAG_PREFIX}{name}": value for name, value in tags.items()}

    def contention(self) -> Contention | None:
        """Whether other work competed for the cores while the generations were timed; None if none were."""
        load = self.measured.load if self.measured is not None else None
        return judge_contention(load) if load is not None else None


def measure_cost(
    model: Any,
    tokenizer: Any,
    settings: MeasureSettings,
    checkpoint_dir: Path | None,
    load_seconds: float | None = None,
    probe_dir: Path | None = None,
) -> CostReport:
    """Measured figures of `model` (loaded by the caller, in this process) and modeled figures
    of the checkpoint it was loaded from. `tokenizer` only names the special tokens that random
    prompts avoid; `load_seconds` is the caller's timing of the load; `probe_dir` keeps the sweep's bandwidth
    probe (`measure.bandwidth`)."""
    # The checkpoint's own config (None: its config.json): its dtype and KV scheme are what a server would run.
    saved_config = checkpoint_dir is not None and (Path(checkpoint_dir) / "config.json").exists()
    modeled = modeled_cost(None if saved_config else model.config, checkpoint_dir, settings)
    if not settings.enabled:
        return CostReport(modeled, None, load_seconds)
    with pinned_threads(settings.cpu_threads):
        return CostReport(modeled, measure_loaded_model(model, tokenizer, settings, probe_dir), load_seconds)


def measure_loaded_model(
    model: Any, tokenizer: Any, settings: MeasureSettings, probe_dir: Path | None = None
) -> MeasuredCost:
    """The measured figures alone, and what produced them. `probe_dir`: where the sweep keeps its bandwidth probe
    (`measure.bandwidth`); None: probed here, for this variant alone."""
    config = config_dict(model.config)
    needed = settings.prompt_tokens + settings.output_tokens
    limit = config.get("max_position_embeddings")
    if limit and needed > limit:
        raise ValueError(
            f"measure.prompt_tokens + measure.output_tokens = {needed} exceeds the model's "
            f"max_position_embeddings ({limit})"
        )
    devices = sorted({parameter.device for parameter in model.parameters()}, key=str)
    input_weight = model.get_input_embeddings().weight
    # The clock records where the logits come out: on the output embedding's device.
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    clock = clock_for(input_weight.device if output is None else output.weight.device, devices)
    special_ids = getattr(tokenizer, "all_special_ids", None) or []

    def time_batch(batch_size: int) -> tuple[int, list[GenerationTiming], float | str]:
        prompt = random_prompt_ids(
            batch_size, settings.prompt_tokens, config["vocab_size"], settings.seed, input_weight.device, special_ids
        )
        for _ in range(settings.warmup):
            time_generation(model, prompt, settings.output_tokens, clock)
        with EnergyTracker(devices) as energy:
            timings = [time_generation(model, prompt, settings.output_tokens, clock) for _ in range(settings.repeats)]
        return batch_size, timings, energy.reading

    with LoadMonitor(torch.get_num_threads()) as load, MemoryTracker(devices) as memory:
        timed = [time_batch(batch_size) for batch_size in settings.batch_sizes]
    # After the memory window (two large buffers): one probe per sweep and host, which every variant's ceiling shares.
    probe = settings.bandwidth_probe_bytes, settings.bandwidth_probe_repeats
    bandwidth = sweep_bandwidth(probe_dir, input_weight.device, *probe)

    # Parameters as loaded (a tied embedding once): on CPU, compressed checkpoints show up here decompressed.
    loaded_bytes = sum(parameter.nbytes for parameter in model.parameters())
    batches = tuple(
        BatchFigures.summarize(
            timings, joules, _local_roofline(model, loaded_bytes, bandwidth.bytes_per_s, settings, batch_size)
        )
        for batch_size, timings, joules in timed
    )
    described = {
        "engine": describe_engine(model),
        "kernel_path": kernel_path(model),  # after the generations: compressed-tensors decompresses on the first one
        "hardware": describe_hardware(devices),
        "clock": clock.description,
        "workload": _workload(settings),
        "peak_memory": memory.reading.peak_kind,
        "bandwidth_probe": bandwidth.method,
        "host_load": load.reading.describe(),
    }
    if memory.reading.device_memory_scope:
        described["device_memory_scope"] = memory.reading.device_memory_scope
    return MeasuredCost(batches, memory.reading, bandwidth, loaded_bytes, described, load.reading)


def _local_roofline(
    model: Any, loaded_bytes: int, bandwidth: float, settings: MeasureSettings, batch_size: int
) -> float | str:
    """The memory-bound decode ceiling on this machine for the workload just timed: weights as
    loaded, the KV cache in the model's dtype at the mean decode context (prompt + output/2)."""
    try:
        shape = ModelShape.from_config(model.config)
    except ValueError as error:
        return str(error)
    input_embedding_bytes = model.get_input_embeddings().weight.nbytes
    streamed = streamed_weight_bytes(loaded_bytes, input_embedding_bytes, shape.tie_word_embeddings)
    kv_per_token = kv_cache_bytes_per_token(shape, torch.empty((), dtype=model.dtype).element_size())
    context = settings.prompt_tokens + settings.output_tokens / 2
    return decode_roofline_tokens_per_s(bandwidth, streamed, kv_per_token, context, batch_size)


def _workload(settings: MeasureSettings) -> str:
    sizes = settings.batch_sizes
    others = f"; figures of batch sizes {sizes[1:]} carry a _bs<N> suffix" if len(sizes) > 1 else ""
    return (
        f"batch size {sizes[0]}{others}; {settings.prompt_tokens} random prompt tokens, {settings.output_tokens} "
        f"output tokens (greedy, no early stop); {settings.warmup} warm-up and {settings.repeats} timed "
        "generations per batch size; throughputs are medians over the timed generations"
    )
