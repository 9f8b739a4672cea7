"""Modeled cost: exact, engine-independent arithmetic on a model config and checkpoint facts.

Definitions (each function says which it computes):

- *linear weights*: the weight matrices of the decoder blocks' linear layers (attention
  q/k/v/o and the MLP projections), which are what quantization recipes quantize; embeddings,
  lm_head, norms and biases are not among them. `bits_per_weight` is over these.
- *parameters*: every parameter, a tied embedding counted once. `bits_per_parameter` is over these.
- *weight bytes in memory*: the tensor payload of the checkpoint, i.e. what a server that keeps
  the stored format (vLLM on compressed-tensors) holds. transformers on CPU decompresses instead:
  the measured `loaded_weight_bytes` shows that.
- *KV cache per token*: layers x KV heads x head dim x 2 (K and V) x element bytes. Grouped-query
  attention stores only the KV heads.
- *decode roofline*: one decode step streams every weight once (the input embedding table is
  gathered, not streamed, unless lm_head shares it) plus each sequence's KV cache at the target
  context length (the worst point of a generation); tokens/s = batch x bandwidth / bytes per step.
  The memory-bound ceiling: real servers reach a fraction of it, and large batches may turn
  compute-bound first.
- *capacity*: sequences of `context_length` tokens whose KV cache fits in
  memory x memory_utilization - runtime overhead - weights (no prefix sharing).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from quantlab.measure.accelerators import AcceleratorSpec
from quantlab.measure.checkpoint import CheckpointFacts
from quantlab.measure.settings import KvCacheDtype, MeasureSettings, TargetSettings

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "float8_e4m3fn": 1}
_DEFAULT_KV_BYTES = 2  # servers keep the KV cache in BF16/FP16 unless told otherwise
_SECONDS_PER_HOUR = 3600


def config_dict(config: Any) -> dict[str, Any]:
    """A plain dict of a transformers config, a mapping, or a checkpoint's config.json path;
    the text part of a multimodal config."""
    if isinstance(config, (str, Path)):
        config = json.loads(Path(config).read_text())
    elif hasattr(config, "to_dict"):
        config = config.to_dict()
    config = dict(config)
    text_config = config.get("text_config")
    if "hidden_size" not in config and isinstance(text_config, Mapping):
        # Multimodal wrappers keep the language model's shape here, the quantization config outside.
        return {**text_config, "quantization_config": config.get("quantization_config")}
    return config


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a dense decoder-only transformer with gated MLP (Llama family)."""

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        values = config_dict(config)
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        missing = [key for key in required if not values.get(key)]
        if missing:
            raise ValueError(f"the model config lacks {', '.join(missing)}: not a Llama-family decoder")
        heads = values["num_attention_heads"]
        return cls(
            hidden_size=values["hidden_size"],
            num_layers=values["num_hidden_layers"],
            num_attention_heads=heads,
            num_kv_heads=values.get("num_key_value_heads") or heads,
            head_dim=values.get("head_dim") or values["hidden_size"] // heads,
            intermediate_size=values["intermediate_size"],
            vocab_size=values["vocab_size"],
            tie_word_embeddings=bool(values.get("tie_word_embeddings", False)),
            attention_bias=bool(values.get("attention_bias", False)),
            mlp_bias=bool(values.get("mlp_bias", False)),
        )

    @property
    def _query_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def _kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim


def linear_weight_count(shape: ModelShape) -> int:
    """Elements of the decoder blocks' linear weight matrices (fused qkv / gate_up count the same)."""
    attention = shape.hidden_size * (2 * shape._query_width + 2 * shape._kv_width)
    mlp = 3 * shape.hidden_size * shape.intermediate_size
    return shape.num_layers * (attention + mlp)


def parameter_count(shape: ModelShape) -> int:
    """Every parameter: embeddings (once when tied), linear weights, biases, RMSNorm weights
    (two per block and a final one, as in Llama)."""
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    # A bias has one element per output: q (query width), k and v (KV width), o (hidden).
    attention_biases = (shape._query_width + 2 * shape._kv_width + shape.hidden_size) if shape.attention_bias else 0
    mlp_biases = (2 * shape.intermediate_size + shape.hidden_size) if shape.mlp_bias else 0
    norms = 2 * shape.hidden_size
    per_layer_extras = attention_biases + mlp_biases + norms
    return embeddings + linear_weight_count(shape) + shape.num_layers * per_layer_extras + shape.hidden_size


def kv_cache_element_bytes(config: Any, kv_cache_dtype: KvCacheDtype = "auto") -> float:
    """Bytes per cached K or V element: the explicit choice, else the checkpoint's KV cache
    scheme (compressed-tensors `kv_cache_scheme`), else its dtype, else BF16."""
    if kv_cache_dtype != "auto":
        return _DTYPE_BYTES[kv_cache_dtype]
    values = config_dict(config)
    quantization = values.get("quantization_config") or {}
    scheme = quantization.get("kv_cache_scheme") if isinstance(quantization, Mapping) else None
    if isinstance(scheme, Mapping) and scheme.get("num_bits"):
        return scheme["num_bits"] / 8
    dtype = str(values.get("dtype") or values.get("torch_dtype") or "").removeprefix("torch.")
    return _DTYPE_BYTES.get(dtype, _DEFAULT_KV_BYTES)


def kv_cache_bytes_per_token(shape: ModelShape, element_bytes: float) -> float:
    """K and V of every layer for one token; grouped-query attention stores only the KV heads."""
    return shape.num_layers * shape.num_kv_heads * shape.head_dim * 2 * element_bytes


def bits_per_element(weight_bytes: float, element_count: int) -> float:
    return 8 * weight_bytes / element_count


def max_concurrent_sequences(
    memory_bytes: int,
    weight_bytes: int,
    kv_bytes_per_token: float,
    context_length: int,
    memory_utilization: float = 0.9,
    runtime_overhead_bytes: int = 1024**3,
) -> int:
    """Sequences of `context_length` tokens whose KV cache fits beside the weights: of
    memory x utilization, the runtime overhead and the weights are set aside first. 0 when the
    weights alone do not fit."""
    free_for_kv = memory_bytes * memory_utilization - runtime_overhead_bytes - weight_bytes
    return max(0, math.floor(free_for_kv / (kv_bytes_per_token * context_length)))


def streamed_weight_bytes(weight_bytes: int, input_embedding_bytes: int, tie_word_embeddings: bool) -> int:
    """Weight bytes one decode step reads: all but an untied input embedding table, of which
    only the batch's rows are gathered."""
    return weight_bytes if tie_word_embeddings else weight_bytes - input_embedding_bytes


def decode_roofline_tokens_per_s(
    bandwidth_bytes_per_s: float,
    streamed_bytes: float,
    kv_bytes_per_token: float,
    context_length: float,
    batch_size: int = 1,
) -> float:
    """Memory-bound decode throughput: each step streams the weights once and every
    sequence's KV cache at `context_length`, and yields `batch_size` tokens."""
    bytes_per_step = streamed_bytes + batch_size * kv_bytes_per_token * context_length
    return batch_size * bandwidth_bytes_per_s / bytes_per_step


def usd_per_million_tokens(price_per_hour: float, tokens_per_s: float) -> float:
    return price_per_hour / (tokens_per_s * _SECONDS_PER_HOUR) * 1_000_000


def _assumptions(target: TargetSettings) -> str:
    return (
        f"capacity: {target.memory_utilization:.0%} of memory minus {target.runtime_overhead_bytes} B overhead "
        f"minus weights holds KV caches of {target.context_length} tokens; roofline: memory-bound, weights streamed "
        f"once per step plus KV at {target.context_length} tokens; roofline_decode_tokens_per_s at batch 1, "
        "serving_decode_tokens_per_s and the dollar figure at max_concurrent_sequences"
    )


@dataclass(frozen=True)
class ModeledCost:
    """Modeled figures for one checkpoint on the target accelerator; None = unavailable (see why)."""

    weight_bytes: int | None
    weight_bytes_in_memory: int | None
    bits_per_weight: float | None
    bits_per_parameter: float | None
    parameter_count: int | None
    kv_bytes_per_token: float | None
    max_concurrent_sequences: int | None
    roofline_decode_tokens_per_s: float | None
    serving_decode_tokens_per_s: float | None
    usd_per_million_output_tokens: float | None
    target: str
    target_spec: AcceleratorSpec
    assumptions: str
    unavailable: Mapping[str, str]  # figure name -> why it is absent

    _NOT_FIGURES = ("target", "target_spec", "assumptions", "unavailable")

    def figures(self) -> dict[str, float]:
        """The available figures by name (the metric key without `cost/`)."""
        return {
            field.name: float(value)
            for field in fields(self)
            if field.name not in self._NOT_FIGURES and (value := getattr(self, field.name)) is not None
        }

    def to_metrics(self) -> dict[str, float]:
        return {f"cost/{name}": value for name, value in self.figures().items()}


class _Figures:
    """Collects figures and, for the absent ones, the reason, keyed by figure name."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.unavailable: dict[str, str] = {}

    def set(self, name: str, value: Any) -> None:
        self.values[name] = value

    def absent(self, name: str, reason: str) -> None:
        self.values[name] = None
        self.unavailable[name] = reason


def modeled_cost(config: Any, checkpoint_dir: Path | None, settings: MeasureSettings | None = None) -> ModeledCost:
    """Every modeled figure from a config (object, mapping, or None to read the checkpoint's
    config.json) and a checkpoint directory's safetensors headers; loads no model."""
    if config is None and checkpoint_dir is not None:
        config = Path(checkpoint_dir) / "config.json"
    facts = CheckpointFacts.from_dir(checkpoint_dir) if checkpoint_dir is not None else None
    return modeled_cost_from_facts(config, facts, settings, where=str(checkpoint_dir))


def modeled_cost_from_facts(
    config: Any, facts: CheckpointFacts | None, settings: MeasureSettings | None = None, where: str = "the checkpoint"
) -> ModeledCost:
    """`modeled_cost` on checkpoint facts already at hand (None: no checkpoint)."""
    settings = settings or MeasureSettings()
    target = settings.target
    target_name, spec = settings.target_accelerator()
    values = config_dict(config)
    figures = _Figures()
    if facts is None:
        facts, no_weights = CheckpointFacts((), ()), "no checkpoint directory given"
    else:
        no_weights = "" if facts.has_weights else f"no *.safetensors files in {where}"

    try:
        shape: ModelShape | None = ModelShape.from_config(values)
        no_shape = ""
    except ValueError as error:
        shape, no_shape = None, str(error)

    if no_weights:
        for name in ("weight_bytes", "weight_bytes_in_memory", "bits_per_weight", "bits_per_parameter"):
            figures.absent(name, no_weights)
    else:
        figures.set("weight_bytes", facts.file_bytes)
        figures.set("weight_bytes_in_memory", facts.payload_bytes)

    if shape is None:
        for name in ("parameter_count", "kv_bytes_per_token", "bits_per_weight", "bits_per_parameter"):
            figures.absent(name, no_shape)
    else:
        parameters = parameter_count(shape)
        figures.set("parameter_count", parameters)
        figures.set(
            "kv_bytes_per_token", kv_cache_bytes_per_token(shape, kv_cache_element_bytes(values, target.kv_cache_dtype))
        )
        if not no_weights:
            figures.set("bits_per_parameter", bits_per_element(facts.payload_bytes, parameters))
            linear_bytes = facts.linear_weight_bytes()
            if linear_bytes:
                figures.set("bits_per_weight", bits_per_element(linear_bytes, linear_weight_count(shape)))
            else:
                figures.absent("bits_per_weight", "no decoder-layer linear weights recognised in the checkpoint")

    _model_serving(figures, shape, facts, target, spec, reason=no_shape or no_weights)
    return ModeledCost(
        **figures.values,
        target=target_name,
        target_spec=spec,
        assumptions=_assumptions(target),
        unavailable=figures.unavailable,
    )


def _model_serving(
    figures: _Figures,
    shape: ModelShape | None,
    facts: CheckpointFacts,
    target: TargetSettings,
    spec: AcceleratorSpec,
    reason: str,
) -> None:
    serving = (
        "max_concurrent_sequences",
        "roofline_decode_tokens_per_s",
        "serving_decode_tokens_per_s",
        "usd_per_million_output_tokens",
    )
    if shape is None or reason:
        for name in serving:
            figures.absent(name, reason)
        return
    weights, kv_per_token = facts.payload_bytes, figures.values["kv_bytes_per_token"]
    sequences = max_concurrent_sequences(
        spec.memory_bytes,
        weights,
        kv_per_token,
        target.context_length,
        target.memory_utilization,
        target.runtime_overhead_bytes,
    )
    figures.set("max_concurrent_sequences", sequences)
    if sequences == 0:
        does_not_fit = (
            f"the weights ({weights} B) and one {target.context_length}-token KV cache do not fit in "
            f"{target.memory_utilization:.0%} of {spec.memory_bytes} B minus {target.runtime_overhead_bytes} B overhead"
        )
        for name in serving[1:]:
            figures.absent(name, does_not_fit)
        return
    streamed = streamed_weight_bytes(weights, facts.input_embedding_bytes(), shape.tie_word_embeddings)

    def roofline(batch_size: int) -> float:
        return decode_roofline_tokens_per_s(
            spec.bandwidth_bytes_per_s, streamed, kv_per_token, target.context_length, batch_size
        )

    figures.set("roofline_decode_tokens_per_s", roofline(1))
    serving_tokens_per_s = roofline(sequences)
    figures.set("serving_decode_tokens_per_s", serving_tokens_per_s)
    if target.price_per_hour is None:
        figures.absent("usd_per_million_output_tokens", "measure.target.price_per_hour is not set")
    else:
        figures.set(
            "usd_per_million_output_tokens", usd_per_million_tokens(target.price_per_hour, serving_tokens_per_s)
        )
