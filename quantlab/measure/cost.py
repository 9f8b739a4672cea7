"""measure_cost: time an already loaded variant in its own process, and model its serving cost, as MLflow
metrics `cost/<figure>` and tags `quantlab.cost.*`.

Figures of other batch sizes than the first configured one carry a `_bs<N>` suffix. A figure that could not
be produced is never logged as zero: it is left out, and the tag `quantlab.cost.unavailable.<figure>` says why.

Each figure is measured once: where the serve stage times a single stream on the engine that ships (its c1 or
sync level), batch size 1 is left to it (`SingleStream`) and the loop here runs one untimed generation for the
memory window; memory, the bandwidth probe and the modeled figures stay here.

Order matters for clean numbers: the generations run inside the memory window first; the
bandwidth probe (which allocates two large buffers) runs after it; the kernel path is read
last, once compressed-tensors has decompressed what it decompresses on the first forward.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, fields
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
from quantlab.metrics import COST_TAG_PREFIX, min_requests, supports
from quantlab.repeats import Interval, t_interval

TAG_PREFIX = COST_TAG_PREFIX
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
    """Means and percentiles of one batch size's timed generations; a str figure says why it is absent."""

    batch_size: int
    prefill_tokens_per_s: float  # mean over repeats
    decode_tokens_per_s: float  # mean over repeats
    ttft_ms_p50: float  # percentiles over repeats, a tail only where they support it (str: why not)
    ttft_ms_p90: float | str
    ttft_ms_p99: float | str
    itl_ms_p50: float  # percentiles over every decode step of every repeat
    itl_ms_p90: float | str
    itl_ms_p99: float | str
    energy_joules_per_token: float | str
    local_roofline_decode_tokens_per_s: float | str
    roofline_efficiency: float | str
    # The throughputs' 95% t intervals over the repeats (none from a single repeat): the frontier and `pick` order
    # two variants by a throughput only where these do not overlap.
    intervals: Mapping[str, Interval] = field(default_factory=dict, compare=False)

    @classmethod
    def summarize(
        cls, timings: Sequence[GenerationTiming], joules: float | str, local_roofline: float | str
    ) -> BatchFigures:
        """`joules` drawn by the timed generations, `local_roofline` decode tokens/s here: each, or why none."""
        ttft_ms = [timing.first_token_s * 1000 for timing in timings]
        itl_ms = [step * 1000 for timing in timings for step in timing.inter_token_s]
        # Means, not medians: a mean is what a t interval bounds, and what the served figures report over their runs.
        throughputs = {
            name: [getattr(timing, name) for timing in timings]
            for name in ("prefill_tokens_per_s", "decode_tokens_per_s")
        }
        intervals = {name: found for name, values in throughputs.items() if (found := t_interval(values)) is not None}
        decode = float(np.mean(throughputs["decode_tokens_per_s"]))
        generated = sum(timing.batch_size * timing.output_tokens for timing in timings)
        return cls(
            batch_size=timings[0].batch_size,
            prefill_tokens_per_s=float(np.mean(throughputs["prefill_tokens_per_s"])),
            decode_tokens_per_s=decode,
            **{f"ttft_ms_p{q}": _percentile(ttft_ms, q, "timed runs") for q in PERCENTILES},
            **{f"itl_ms_p{q}": _percentile(itl_ms, q, "decode steps") for q in PERCENTILES},
            energy_joules_per_token=joules if isinstance(joules, str) else joules / generated,
            local_roofline_decode_tokens_per_s=local_roofline,
            roofline_efficiency=local_roofline if isinstance(local_roofline, str) else decode / local_roofline,
            intervals=intervals,
        )


def _percentile(values: Sequence[float], q: int, what: str) -> float | str:
    """The `q`th percentile where the values support it (`quantlab.metrics.supports`: a p99 from 100, a p90 from
    10), else why not: the p99 of 3 runs is their maximum, not a tail. A median is always kept."""
    if q == 50 or supports(q, len(values)):
        return float(np.percentile(values, q))
    return f"{len(values)} {what}: a p{q} needs at least {min_requests(q)} (the p{q} of {len(values)} is their maximum)"


BATCH_FIGURES = tuple(each.name for each in fields(BatchFigures) if each.name not in ("batch_size", "intervals"))
# What the serve stage's single-stream level gives for batch size 1 (`SingleStream.figures`): the rest of a batch's
# figures are left out there, each with its reason.
SINGLE_STREAM_FIGURES = ("prefill_tokens_per_s", "decode_tokens_per_s", "ttft_ms_p50", "itl_ms_p50")


@dataclass(frozen=True)
class SingleStream:
    """Batch size 1 as the serve stage times it: its single-stream level (`level`: c1, or sync in guidellm's sweep)
    on the variant's own server, `prompt_tokens` + `output_tokens` per request. The measure stage leaves that batch
    size untimed, so each figure is measured once; it still reads its memory and its local roofline at this
    workload, and `figures` turns the level's latencies into the batch-1 figures."""

    level: str
    prompt_tokens: int
    output_tokens: int

    def figures(self, ttft_ms_p50: float, itl_ms_p50: float, local_roofline: float | None) -> dict[str, float]:
        """The batch-1 figures from the level's medians (ms): a request's decode rate is the inverse of its mean
        gap between tokens, its prefill rate its prompt over its time to first token."""
        decode = 1000.0 / itl_ms_p50 if itl_ms_p50 > 0 else math.nan
        found = {
            "prefill_tokens_per_s": self.prompt_tokens * 1000.0 / ttft_ms_p50 if ttft_ms_p50 > 0 else math.nan,
            "decode_tokens_per_s": decode,
            "ttft_ms_p50": ttft_ms_p50,
            "itl_ms_p50": itl_ms_p50,
        }
        if local_roofline:
            found["roofline_efficiency"] = decode / local_roofline  # NaN with decode
        return found

    def intervals(self, ttft_ms_p50: Interval | None, itl_ms_p50: Interval | None) -> dict[str, Interval]:
        """The batch-1 throughputs' intervals from the level's latency intervals over its runs (serving.repeats):
        each throughput is a constant over a latency, so its interval is the latency's, inverted."""
        found = {"decode_tokens_per_s": itl_ms_p50.inverted(1000.0) if itl_ms_p50 is not None else None}
        prefill = ttft_ms_p50.inverted(self.prompt_tokens * 1000.0) if ttft_ms_p50 is not None else None
        found["prefill_tokens_per_s"] = prefill
        return {name: interval for name, interval in found.items() if interval is not None}

    def describe(self) -> str:
        return (
            f"batch size 1 is timed once, by the serve stage's {self.level} level on the variant's server "
            f"({self.prompt_tokens} prompt + {self.output_tokens} output tokens per request): decode_tokens_per_s "
            "= 1000 / its ITL p50, prefill_tokens_per_s = prompt tokens / its TTFT p50, ttft_ms_p50 and itl_ms_p50 "
            "its medians; the measure stage runs one untimed generation for the memory window"
        )

    def unavailable(self) -> dict[str, str]:
        where = f"cost/serving/{self.level}/*, p50 and max, p99 where its requests support it"
        return {
            name: f"batch size 1 is timed by the serve stage's {self.level} level: {where}"
            for name in BATCH_FIGURES
            if name not in (*SINGLE_STREAM_FIGURES, "roofline_efficiency", "local_roofline_decode_tokens_per_s")
        }


def batch_figure_name(name: str, batch_size: int, default_batch_size: int) -> str:
    """The default (first configured) batch size's figures have plain names, the others' a `_bs<N>` suffix."""
    return name if batch_size == default_batch_size else f"{name}_bs{batch_size}"


@dataclass(frozen=True)
class MeasuredCost:
    batches: tuple[BatchFigures, ...]  # the timed batch sizes, in configured order
    memory: MemoryReading
    bandwidth: BandwidthReading
    loaded_weight_bytes: int
    # Tags of how the figures were produced: engine, kernel path, hardware, clock, workload, host load, ...
    described: Mapping[str, str]
    load: LoadReading | None = None  # what competed with the timed generations (None: not read, or nothing timed)
    default_batch_size: int = 1  # the first configured: its figures have plain names
    single_stream: SingleStream | None = None  # batch size 1, left to the serve stage
    single_stream_roofline: float | str = "batch size 1 was timed here"  # its local roofline at the served workload

    def _values(self) -> dict[str, float | str]:
        """Every figure, or why it is absent; the default (first) batch size's under plain names, others' `_bs<N>`."""
        per_batch = {
            batch_figure_name(name, batch.batch_size, self.default_batch_size): getattr(batch, name)
            for batch in self.batches
            for name in BATCH_FIGURES
        }
        if self.single_stream is not None:
            left = {
                **self.single_stream.unavailable(),
                "local_roofline_decode_tokens_per_s": self.single_stream_roofline,
            }
            per_batch |= {batch_figure_name(name, 1, self.default_batch_size): value for name, value in left.items()}
        return {**per_batch, **{name: read(self) for name, read in WINDOW_FIGURES.items()}}

    def figures(self) -> dict[str, float]:
        return {name: float(value) for name, value in self._values().items() if not isinstance(value, str)}

    def interval_figures(self) -> dict[str, float]:
        """Each timed throughput's interval ends over the repeats, `<figure>/ci95_low` and `/ci95_high`."""
        return {
            key: end
            for batch in self.batches
            for name, found in batch.intervals.items()
            for key, end in found.ends(batch_figure_name(name, batch.batch_size, self.default_batch_size)).items()
        }

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
            figures = self.measured.figures() | self.measured.interval_figures()
            metrics.update({f"cost/{name}": value for name, value in figures.items()})
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
    single_stream: SingleStream | None = None,
) -> CostReport:
    """Measured figures of `model` (loaded by the caller, in this process) and modeled figures
    of the checkpoint it was loaded from. `tokenizer` only names the special tokens that random
    prompts avoid; `load_seconds` is the caller's timing of the load; `probe_dir` keeps the sweep's bandwidth
    probe (`measure.bandwidth`); `single_stream`: batch size 1 is the serve stage's to time."""
    # The checkpoint's own config (None: its config.json): its dtype and KV scheme are what a server would run.
    saved_config = checkpoint_dir is not None and (Path(checkpoint_dir) / "config.json").exists()
    modeled = modeled_cost(None if saved_config else model.config, checkpoint_dir, settings)
    if not settings.enabled:
        return CostReport(modeled, None, load_seconds)
    with pinned_threads(settings.cpu_threads):
        measured = measure_loaded_model(model, tokenizer, settings, probe_dir, single_stream)
        return CostReport(modeled, measured, load_seconds)


def measure_loaded_model(
    model: Any,
    tokenizer: Any,
    settings: MeasureSettings,
    probe_dir: Path | None = None,
    single_stream: SingleStream | None = None,
) -> MeasuredCost:
    """The measured figures alone, and what produced them. `probe_dir`: where the sweep keeps its bandwidth probe
    (`measure.bandwidth`); None: probed here, for this variant alone. `single_stream`: batch size 1 is left untimed
    (the serve stage times it); one generation at it still runs in the memory window."""
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

    def prompt_of(batch_size: int) -> torch.Tensor:
        vocab, seed, device = config["vocab_size"], settings.seed, input_weight.device
        return random_prompt_ids(batch_size, settings.prompt_tokens, vocab, seed, device, special_ids)

    def time_batch(batch_size: int) -> tuple[int, list[GenerationTiming], float | str]:
        prompt = prompt_of(batch_size)
        for _ in range(settings.warmup):
            time_generation(model, prompt, settings.output_tokens, clock)
        with EnergyTracker(devices) as energy:
            timings = [time_generation(model, prompt, settings.output_tokens, clock) for _ in range(settings.repeats)]
        return batch_size, timings, energy.reading

    left = single_stream if single_stream is not None and 1 in settings.batch_sizes else None
    timed_sizes = [batch_size for batch_size in settings.batch_sizes if left is None or batch_size != 1]
    monitor = LoadMonitor(torch.get_num_threads()) if timed_sizes else nullcontext()
    with monitor as load, MemoryTracker(devices) as memory:
        if left is not None:  # untimed: its memory, and the first forward compressed-tensors decompresses on
            time_generation(model, prompt_of(1), settings.output_tokens, clock)
        timed = [time_batch(batch_size) for batch_size in timed_sizes]
    # After the memory window (two large buffers): one probe per sweep and host, which every variant's ceiling shares.
    probe = settings.bandwidth_probe_bytes, settings.bandwidth_probe_repeats
    bandwidth = sweep_bandwidth(probe_dir, input_weight.device, *probe)

    # Parameters as loaded (a tied embedding once): on CPU, compressed checkpoints show up here decompressed.
    loaded_bytes = sum(parameter.nbytes for parameter in model.parameters())

    def roofline(batch_size: int, prompt_tokens: int, output_tokens: int) -> float | str:
        return _local_roofline(model, loaded_bytes, bandwidth.bytes_per_s, prompt_tokens, output_tokens, batch_size)

    batches = tuple(
        BatchFigures.summarize(timings, joules, roofline(batch_size, settings.prompt_tokens, settings.output_tokens))
        for batch_size, timings, joules in timed
    )
    described = {
        "engine": describe_engine(model),
        "kernel_path": kernel_path(model),  # after the generations: compressed-tensors decompresses on the first one
        "hardware": describe_hardware(devices),
        "clock": clock.description,
        "workload": _workload(settings, timed_sizes),
        "peak_memory": memory.reading.peak_kind,
        "bandwidth_probe": bandwidth.method,
    }
    if load is not None:
        described["host_load"] = load.reading.describe()
    if left is not None:
        described["single_stream"] = left.describe()
    if memory.reading.device_memory_scope:
        described["device_memory_scope"] = memory.reading.device_memory_scope
    return MeasuredCost(
        batches,
        memory.reading,
        bandwidth,
        loaded_bytes,
        described,
        load.reading if load is not None else None,
        default_batch_size=settings.batch_sizes[0],
        single_stream=left,
        single_stream_roofline=roofline(1, left.prompt_tokens, left.output_tokens) if left is not None else "",
    )


def _local_roofline(
    model: Any, loaded_bytes: int, bandwidth: float, prompt_tokens: int, output_tokens: int, batch_size: int
) -> float | str:
    """The memory-bound decode ceiling on this machine for a workload: weights as loaded, the KV cache in the
    model's dtype at the mean decode context (prompt + output/2)."""
    try:
        shape = ModelShape.from_config(model.config)
    except ValueError as error:
        return str(error)
    input_embedding_bytes = model.get_input_embeddings().weight.nbytes
    streamed = streamed_weight_bytes(loaded_bytes, input_embedding_bytes, shape.tie_word_embeddings)
    kv_per_token = kv_cache_bytes_per_token(shape, torch.empty((), dtype=model.dtype).element_size())
    context = prompt_tokens + output_tokens / 2
    return decode_roofline_tokens_per_s(bandwidth, streamed, kv_per_token, context, batch_size)


def _workload(settings: MeasureSettings, timed_sizes: Sequence[int]) -> str:
    sizes = settings.batch_sizes
    others = f"; figures of batch sizes {sizes[1:]} carry a _bs<N> suffix" if len(sizes) > 1 else ""
    timed = "" if list(timed_sizes) == sizes else f" (timed here: {list(timed_sizes) or 'none'}; see single_stream)"
    return (
        f"batch size {sizes[0]}{others}{timed}; {settings.prompt_tokens} random prompt tokens, "
        f"{settings.output_tokens} output tokens (greedy, no early stop); {settings.warmup} warm-up and "
        f"{settings.repeats} timed generations per batch size; throughputs are means over the timed generations, with "
        "their 95% t intervals (<figure>/ci95_low, /ci95_high) from two repeats on"
    )
