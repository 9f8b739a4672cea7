"""measure_cost: time an already loaded variant in its own process, and model its serving cost.

Order matters for clean numbers: the generations run inside the memory window first; the
bandwidth probe (which allocates two large buffers) runs after it; the kernel path is read
last, once compressed-tensors has decompressed what it decompresses on the first forward.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from quantlab.measure.modeled import (
    ModelShape,
    config_dict,
    decode_roofline_tokens_per_s,
    kv_cache_bytes_per_token,
    modeled_cost,
    streamed_weight_bytes,
)
from quantlab.measure.provenance import Provenance, provenance, visible_cores
from quantlab.measure.report import BATCH_FIGURES, WINDOW_FIGURES, BatchFigures, CostReport, MeasuredCost
from quantlab.measure.settings import MeasureSettings
from quantlab.measure.timing import (
    GenerationTiming,
    clock_for,
    measure_copy_bandwidth,
    random_prompt_ids,
    time_generation,
)
from quantlab.measure.trackers import EnergyReading, EnergyTracker, MemoryTracker


def measure_cost(
    model: Any,
    tokenizer: Any,
    settings: MeasureSettings,
    checkpoint_dir: Path | None,
    load_seconds: float | None = None,
) -> CostReport:
    """Measured figures of `model` (loaded by the caller, in this process) and modeled figures
    of the checkpoint it was loaded from. `tokenizer` only names the special tokens that random
    prompts avoid; `load_seconds` is the caller's timing of the load."""
    checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
    saved_config = checkpoint_dir / "config.json" if checkpoint_dir is not None else None
    # The checkpoint's own config: its dtype and KV scheme are what a server would run.
    config = saved_config if saved_config is not None and saved_config.exists() else model.config
    modeled = modeled_cost(config, checkpoint_dir, settings)
    notes = {} if load_seconds is not None else {"load_seconds": "the caller did not time the model load"}
    if not settings.enabled:
        disabled = dict.fromkeys((*BATCH_FIGURES, *WINDOW_FIGURES), "measure.enabled is false")
        return CostReport(modeled, None, None, load_seconds, {**notes, **disabled})

    with _torch_threads(settings.cpu_threads):
        measured, described = measure_loaded_model(model, tokenizer, settings)
    return CostReport(modeled, measured, described, load_seconds, notes)


def measure_loaded_model(model: Any, tokenizer: Any, settings: MeasureSettings) -> tuple[MeasuredCost, Provenance]:
    """The measured figures alone, and what produced them."""
    devices = sorted({parameter.device for parameter in model.parameters()}, key=str)
    input_weight = model.get_input_embeddings().weight
    output_weight = _output_embedding_weight(model)
    _check_positions(model.config, settings)
    clock = clock_for(input_weight.device if output_weight is None else output_weight.device, devices)
    special_ids = getattr(tokenizer, "all_special_ids", None) or []
    vocab_size = config_dict(model.config)["vocab_size"]

    def time_batch(batch_size: int) -> tuple[int, list[GenerationTiming], EnergyReading]:
        prompt = random_prompt_ids(
            batch_size, settings.prompt_tokens, vocab_size, settings.seed, input_weight.device, special_ids
        )
        for _ in range(settings.warmup):
            time_generation(model, prompt, settings.output_tokens, clock)
        with EnergyTracker(devices) as energy:
            timings = [time_generation(model, prompt, settings.output_tokens, clock) for _ in range(settings.repeats)]
        return batch_size, timings, energy.reading

    load_before = _load_average()
    with MemoryTracker(devices) as memory:
        timed = [time_batch(batch_size) for batch_size in settings.batch_sizes]
    host_load = f"1-minute load average {load_before} before, {_load_average()} after, on {visible_cores()} cores"
    bandwidth = measure_copy_bandwidth(
        input_weight.device, settings.bandwidth_probe_bytes, settings.bandwidth_probe_repeats
    )

    loaded_bytes = loaded_weight_bytes(model)
    tied = output_weight is not None and output_weight.data_ptr() == input_weight.data_ptr()
    batches = tuple(
        BatchFigures.summarize(
            timings, energy, _local_roofline(model, loaded_bytes, tied, bandwidth.bytes_per_s, settings, batch_size)
        )
        for batch_size, timings, energy in timed
    )
    measured = MeasuredCost(batches, memory.reading, bandwidth, loaded_bytes, _workload(settings), host_load)
    return measured, provenance(model, devices, clock.description)


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    if threads is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _output_embedding_weight(model: Any) -> torch.Tensor | None:
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return None if output is None else output.weight


def _check_positions(config: Any, settings: MeasureSettings) -> None:
    limit = config_dict(config).get("max_position_embeddings")
    needed = settings.prompt_tokens + settings.output_tokens
    if limit and needed > limit:
        raise ValueError(
            f"measure.prompt_tokens + measure.output_tokens = {needed} exceeds the model's "
            f"max_position_embeddings ({limit})"
        )


def loaded_weight_bytes(model: Any) -> int:
    """Bytes of the parameters as loaded (a tied embedding once): on CPU, compressed
    checkpoints show up here decompressed."""
    return sum(parameter.numel() * parameter.element_size() for parameter in model.parameters())


def _local_roofline(
    model: Any, loaded_bytes: int, tied: bool, bandwidth: float, settings: MeasureSettings, batch_size: int
) -> float | str:
    """The memory-bound decode ceiling on this machine for the workload just timed: weights as
    loaded, the KV cache in the model's dtype at the mean decode context (prompt + output/2)."""
    try:
        shape = ModelShape.from_config(model.config)
    except ValueError as error:
        return str(error)
    streamed = streamed_weight_bytes(loaded_bytes, model.get_input_embeddings().weight.nbytes, tied)
    kv_per_token = kv_cache_bytes_per_token(shape, torch.empty((), dtype=model.dtype).element_size())
    context = settings.prompt_tokens + settings.output_tokens / 2
    return decode_roofline_tokens_per_s(bandwidth, streamed, kv_per_token, context, batch_size)


def _load_average() -> str:
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:  # not available on this platform
        return "unknown"


def _workload(settings: MeasureSettings) -> str:
    sizes = settings.batch_sizes
    others = f"; figures of batch sizes {sizes[1:]} carry a _bs<N> suffix" if len(sizes) > 1 else ""
    return (
        f"batch size {sizes[0]}{others}; {settings.prompt_tokens} random prompt tokens, {settings.output_tokens} "
        f"output tokens (greedy, no early stop); {settings.warmup} warm-up and {settings.repeats} timed "
        "generations per batch size; throughputs are medians over the timed generations"
    )
