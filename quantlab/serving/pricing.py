"""What the serving hardware costs per hour, and the modeled decode ceiling on it: the two figures measured serving
throughput is set against. Pure functions."""

from __future__ import annotations

import re

from quantlab.measure.modeled import (
    ModelShape,
    decode_roofline_tokens_per_s,
    kv_cache_bytes_per_token,
    streamed_weight_bytes,
)
from quantlab.measure.settings import MeasureSettings, accelerator_table, normalized_name
from quantlab.serving.goodput import Price
from quantlab.serving.settings import ServingSettings

# AWS EC2 c7i on-demand, us-east-1: c7i.large (2 vCPUs) at $0.08925 per hour. A default for CPU serving only;
# what a team pays is its own (serving.price_per_hour).
CPU_USD_PER_CORE_HOUR = 0.08925 / 2
CPU_PRICE_SOURCE = "AWS EC2 c7i on-demand, us-east-1 ($0.08925/h for 2 vCPUs)"


def table_entry_for(gpu_name: str, measure: MeasureSettings) -> str | None:
    """The accelerator table's entry that a device name is ("NVIDIA H100 NVL" is H100-NVL): an entry spelled by
    consecutive words of the name, the longest such; None rather than a guess ("A100-SXM4-80GB" is not A10)."""
    words = [word for word in re.split(r"[\s_\-]+", gpu_name.lower()) if word]
    runs = {"".join(words[start:end]) for start in range(len(words)) for end in range(start + 1, len(words) + 1)}
    found = [name for name in accelerator_table(measure.accelerators) if normalized_name(name) in runs]
    return max(found, key=len, default=None)


def serving_price(
    settings: ServingSettings, measure: MeasureSettings, gpu_name: str | None, cpu_cores: int
) -> Price | None:
    """serving.price_per_hour; else, on a GPU that is the recipe's target accelerator, its price per hour
    (measure.target.price_per_hour); on CPU, `cpu_cores` at the default core-hour price. None: unknown."""
    if settings.price_per_hour is not None:
        return Price(settings.price_per_hour, "serving.price_per_hour")
    if gpu_name is None:
        usd = cpu_cores * CPU_USD_PER_CORE_HOUR
        return Price(usd, f"{cpu_cores} CPU cores at ${CPU_USD_PER_CORE_HOUR:.4f} per core-hour: {CPU_PRICE_SOURCE}")
    target, _ = measure.target_accelerator()
    if table_entry_for(gpu_name, measure) == target and measure.target.price_per_hour is not None:
        return Price(measure.target.price_per_hour, f"measure.target.price_per_hour ({target} is the GPU serving)")
    return None


def modeled_decode_tokens_per_s(
    shape: ModelShape,
    weight_bytes: float,
    element_bytes: float,
    bandwidth_bytes_per_s: float,
    context_tokens: float,
    concurrency: float,
) -> float:
    """The memory-bound decode ceiling of `concurrency` streams: the weights the server holds (`weight_bytes`, its
    untied input embedding at `element_bytes` gathered, not streamed) and KV caches at `context_tokens`."""
    embedding = shape.vocab_size * shape.hidden_size * element_bytes
    streamed = streamed_weight_bytes(int(weight_bytes), int(embedding), shape.tie_word_embeddings)
    kv_per_token = kv_cache_bytes_per_token(shape, element_bytes)
    batch = max(1, round(concurrency))
    return decode_roofline_tokens_per_s(bandwidth_bytes_per_s, streamed, kv_per_token, context_tokens, batch)
