"""measure_cost: time an already loaded variant in its own process, and model its serving cost.

Order matters for clean numbers: the generations run inside the memory window first; the
bandwidth probe (which allocates two large buffers) runs after it; the kernel path is read
last, once compressed-tensors has decompressed what it decompresses on the first forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil
import torch

from quantlab.measure.kernels import kernel_path
from quantlab.measure.modeled import (
    ModelShape,
    config_dict,
    decode_roofline_tokens_per_s,
    kv_cache_bytes_per_token,
    modeled_cost,
    streamed_weight_bytes,
)
from quantlab.measure.provenance import describe_engine, describe_hardware, visible_cores
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
    # The checkpoint's own config (None: its config.json): its dtype and KV scheme are what a server would run.
    saved_config = checkpoint_dir is not None and (Path(checkpoint_dir) / "config.json").exists()
    modeled = modeled_cost(None if saved_config else model.config, checkpoint_dir, settings)
    notes = {} if load_seconds is not None else {"load_seconds": "the caller did not time the model load"}
    if not settings.enabled:
        disabled = dict.fromkeys((*BATCH_FIGURES, *WINDOW_FIGURES), "measure.enabled is false")
        return CostReport(modeled, None, load_seconds, {**notes, **disabled})

    with _torch_threads(settings.cpu_threads):
        measured = measure_loaded_model(model, tokenizer, settings)
    return CostReport(modeled, measured, load_seconds, notes)


def measure_loaded_model(model: Any, tokenizer: Any, settings: MeasureSettings) -> MeasuredCost:
    """The measured figures alone, and what produced them."""
    devices = sorted({parameter.device for parameter in model.parameters()}, key=str)
    input_weight = model.get_input_embeddings().weight
    _check_positions(model.config, settings)
    # The clock records where the logits come out: on the output embedding's device.
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    clock = clock_for(input_weight.device if output is None else output.weight.device, devices)
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

    load_before = psutil.getloadavg()[0]
    with MemoryTracker(devices) as memory:
        timed = [time_batch(batch_size) for batch_size in settings.batch_sizes]
    load_after = psutil.getloadavg()[0]
    bandwidth = measure_copy_bandwidth(
        input_weight.device, settings.bandwidth_probe_bytes, settings.bandwidth_probe_repeats
    )

    loaded_bytes = loaded_weight_bytes(model)
    batches = tuple(
        BatchFigures.summarize(
            timings, energy, _local_roofline(model, loaded_bytes, bandwidth.bytes_per_s, settings, batch_size)
        )
        for batch_size, timings, energy in timed
    )
    described = {
        "engine": describe_engine(model),
        "kernel_path": kernel_path(model),  # read last: compressed-tensors decompresses on the first forward
        "hardware": describe_hardware(devices),
        "clock": clock.description,
        "workload": _workload(settings),
        "peak_memory": memory.reading.peak_kind,
        "bandwidth_probe": bandwidth.method,
        "host_load": f"1-minute load average {load_before:.2f} before, {load_after:.2f} after, on {visible_cores()} cores",
    }
    if memory.reading.device_memory_scope:
        described["device_memory_scope"] = memory.reading.device_memory_scope
    return MeasuredCost(batches, memory.reading, bandwidth, loaded_bytes, described)


@contextmanager
def _torch_threads(threads: int | None) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        yield
    finally:
        torch.set_num_threads(before)


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
