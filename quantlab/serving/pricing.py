"""What the serving hardware costs per hour, and the modeled throughput ceiling on it: the two figures measured serving
throughput is set against. Pure functions."""

from __future__ import annotations

import re
from collections.abc import Mapping

from quantlab.measure.modeled import (
    ModelShape,
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


def modeled_served_tokens_per_s(
    shape: ModelShape,
    weight_bytes: float,
    element_bytes: float,
    bandwidth_bytes_per_s: float,
    prefill_tokens_per_s: float | None,
    prompt_tokens: float,
    output_tokens: float,
    concurrency: float,
) -> float:
    """The ceiling of output tokens/s that `concurrency` streams of `prompt_tokens` + `output_tokens` requests can
    reach, prefill included, as served throughput counts it (a request's time runs from its prefill).

    A wave of b = round(concurrency) requests yields b * D output tokens (P = prompt, D = output tokens) in
    - its prefill: one pass over the b prompts together (the most favourable schedule), which yields each first
      token. Memory-bound it streams the weights S once and writes the prompts' KV caches, b * P * kv bytes; but
      prefill is mostly compute, which a bandwidth model cannot see, so where the measure stage timed prefill on this
      machine (`prefill_tokens_per_s`, the weights as loaded there) it takes at least b * P / that rate;
    - D - 1 memory-bound decode steps, each streaming S and every stream's KV cache at a mean context of P + D / 2:
        b * D / (max((S + b*P*kv) / bandwidth, b*P / prefill_rate) + (D - 1) * (S + b*kv*(P + D/2)) / bandwidth)
    The weights are those the server holds (`weight_bytes`; an untied input embedding at `element_bytes` is
    gathered, not streamed). Memory-bound, a prefill pass costs about one decode step and yields a token, so
    without a prefill rate this is the decode roofline again; the measured rate is what makes prefill count.
    Hand calculation (the test's): S = 1e9 B, kv = 1e5 B/token, P = 100, D = 10, b = 4, 1e11 B/s, 4,000 prefill
    tokens/s: prefill max(1.04e9 B / 1e11, 400 / 4000) = 0.1 s, decode 9 * (1e9 + 4e5 * 105) / 1e11 = 0.09378 s:
    40 / 0.19378 = 206.42 tokens/s (383.95 without the prefill rate)."""
    embedding = shape.vocab_size * shape.hidden_size * element_bytes
    streamed = streamed_weight_bytes(int(weight_bytes), int(embedding), shape.tie_word_embeddings)
    kv_per_token = kv_cache_bytes_per_token(shape, element_bytes)
    batch = max(1, round(concurrency))
    prefill_s = (streamed + batch * prompt_tokens * kv_per_token) / bandwidth_bytes_per_s
    if prefill_tokens_per_s:
        prefill_s = max(prefill_s, batch * prompt_tokens / prefill_tokens_per_s)
    step_bytes = streamed + batch * kv_per_token * (prompt_tokens + output_tokens / 2)
    decode_s = (output_tokens - 1) * step_bytes / bandwidth_bytes_per_s
    return batch * output_tokens / (prefill_s + decode_s)


def fastest_prefill(cost_metrics: Mapping[str, float]) -> float | None:
    """The fastest prefill the measure stage timed on this machine (tokens/s, over its batch sizes: `cost/
    prefill_tokens_per_s` and `..._bs<N>`); None when it timed none."""
    rates = [value for key, value in cost_metrics.items() if re.fullmatch(r"cost/prefill_tokens_per_s(_bs\d+)?", key)]
    return max(rates, default=None)
