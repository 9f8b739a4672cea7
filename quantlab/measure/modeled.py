"""Modeled cost: exact, engine-independent arithmetic on a model config and checkpoint facts.

`bits_per_weight` is over the decoder blocks' linear weights (what recipes quantize), `bits_per_parameter` over
all parameters. Weight bytes in memory are the stored payload, as a server keeping the stored format holds it.
The decode roofline is a memory-bound ceiling: real servers reach a fraction of it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from quantlab.measure.checkpoint import CheckpointFacts
from quantlab.measure.settings import AcceleratorSpec, KvCacheDtype, MeasureSettings

_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2, "fp8": 1, "float8_e4m3fn": 1}


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


def linear_weight_count(shape: ModelShape) -> int:
    """Elements of the decoder blocks' linear weight matrices (fused qkv / gate_up count the same)."""
    attention = 2 * shape.hidden_size * (shape.num_attention_heads + shape.num_kv_heads) * shape.head_dim  # q,o + k,v
    mlp = 3 * shape.hidden_size * shape.intermediate_size
    return shape.num_layers * (attention + mlp)


def parameter_count(shape: ModelShape) -> int:
    """Every parameter: embeddings (once when tied), linear weights, biases, RMSNorm weights
    (two per block and a final one, as in Llama)."""
    embeddings = shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2)
    # A bias has one element per output: q, k, v (their heads x head dim) and o (hidden).
    attention_heads = shape.num_attention_heads + 2 * shape.num_kv_heads
    attention_biases = (attention_heads * shape.head_dim + shape.hidden_size) if shape.attention_bias else 0
    mlp_biases = (2 * shape.intermediate_size + shape.hidden_size) if shape.mlp_bias else 0
    per_layer_extras = attention_biases + mlp_biases + 2 * shape.hidden_size  # + two norms
    return embeddings + linear_weight_count(shape) + shape.num_layers * per_layer_extras + shape.hidden_size


@dataclass(frozen=True)
class WeightCounts:
    """What a checkpoint's size follows from (`quantlab.disk`), counted once from a shape."""

    parameters: int  # every parameter (`parameter_count`)
    linear_weights: int  # the decoder blocks' linear weights: what a quantization method stores otherwise
    linear_outputs: int  # their output channels (q, k, v, o, gate, up, down): a per-channel scale each
    layers: int
    # (outputs, inputs) of each linear layer of one decoder block (q, k, v, o, gate, up, down): per-block scales
    layer_shapes: tuple[tuple[int, int], ...] = ()


def weight_counts(shape: ModelShape) -> WeightCounts:
    heads = shape.num_attention_heads + 2 * shape.num_kv_heads
    outputs = shape.num_layers * (heads * shape.head_dim + 2 * shape.hidden_size + 2 * shape.intermediate_size)
    hidden, query, kv, mlp = (
        shape.hidden_size,
        shape.num_attention_heads * shape.head_dim,
        shape.num_kv_heads * shape.head_dim,
        shape.intermediate_size,
    )
    shapes = ((query, hidden), (kv, hidden), (kv, hidden), (hidden, query), (mlp, hidden), (mlp, hidden), (hidden, mlp))
    return WeightCounts(parameter_count(shape), linear_weight_count(shape), outputs, shape.num_layers, shapes)


def kv_cache_element_bytes(config: Any, kv_cache_dtype: KvCacheDtype = "auto") -> float:
    """Bytes per cached K or V element: the explicit choice, else the checkpoint's KV cache
    scheme (compressed-tensors `kv_cache_scheme`), else its dtype, else BF16."""
    if kv_cache_dtype != "auto":
        return _DTYPE_BYTES[kv_cache_dtype]
    values = config_dict(config)
    scheme = _kv_cache_scheme(values)
    if scheme.get("num_bits"):
        return scheme["num_bits"] / 8
    dtype = str(values.get("dtype") or values.get("torch_dtype") or "").removeprefix("torch.")
    return _DTYPE_BYTES.get(dtype, 2)  # servers keep the KV cache in BF16/FP16 unless told otherwise


def declared_kv_cache_dtype(config: Any) -> KvCacheDtype:
    """ "fp8" where the checkpoint declares an FP8 KV cache (compressed-tensors `kv_cache_scheme`), else "auto"."""
    scheme = _kv_cache_scheme(config_dict(config))
    return "fp8" if scheme.get("type") == "float" and scheme.get("num_bits") == 8 else "auto"


def _kv_cache_scheme(values: Mapping[str, Any]) -> Mapping[str, Any]:
    quantization = values.get("quantization_config") or {}
    scheme = quantization.get("kv_cache_scheme") if isinstance(quantization, Mapping) else None
    return scheme if isinstance(scheme, Mapping) else {}


def kv_cache_bytes_per_token(shape: ModelShape, element_bytes: float) -> float:
    """K and V of every layer for one token; grouped-query attention stores only the KV heads."""
    return shape.num_layers * shape.num_kv_heads * shape.head_dim * 2 * element_bytes


def max_concurrent_sequences(
    memory_bytes: int,
    weight_bytes: int,
    kv_bytes_per_token: float,
    context_length: int,
    memory_utilization: float,
    runtime_overhead_bytes: int,
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
    batch_size: int,
) -> float:
    """Memory-bound decode throughput: each step streams the weights once and every
    sequence's KV cache at `context_length`, and yields `batch_size` tokens."""
    bytes_per_step = streamed_bytes + batch_size * kv_bytes_per_token * context_length
    return batch_size * bandwidth_bytes_per_s / bytes_per_step


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

    def to_metrics(self) -> dict[str, float]:
        return {
            f"cost/{field.name}": float(value)
            for field in fields(self)
            if field.name not in self._NOT_FIGURES and (value := getattr(self, field.name)) is not None
        }


def modeled_cost(
    config: Any, checkpoint: Path | CheckpointFacts | None, settings: MeasureSettings | None = None
) -> ModeledCost:
    """Every modeled figure from a config (object, mapping, or None to read the checkpoint's config.json) and
    a checkpoint directory's safetensors headers, or their facts already at hand; loads no model."""
    settings = settings or MeasureSettings()
    target = settings.target
    target_name, spec = settings.target_accelerator()
    values = config_dict(Path(checkpoint) / "config.json" if config is None else config)
    if checkpoint is None:
        facts, no_weights = CheckpointFacts((), ()), "no checkpoint directory given"
    else:
        facts = checkpoint if isinstance(checkpoint, CheckpointFacts) else CheckpointFacts.from_dir(checkpoint)
        no_weights = "" if facts.file_sizes else f"no *.safetensors files in {checkpoint}"
    try:
        shape, no_shape = ModelShape.from_config(values), ""
    except ValueError as error:
        shape, no_shape = None, str(error)

    figures: dict[str, float] = {}
    if not no_weights:
        figures.update(weight_bytes=facts.file_bytes, weight_bytes_in_memory=facts.payload_bytes)
    does_not_fit = ""
    if shape is not None:
        kv_per_token = kv_cache_bytes_per_token(shape, kv_cache_element_bytes(values, target.kv_cache_dtype))
        figures.update(parameter_count=parameter_count(shape), kv_bytes_per_token=kv_per_token)
    if shape is not None and not no_weights:
        figures["bits_per_parameter"] = 8 * facts.payload_bytes / figures["parameter_count"]
        if linear_bytes := facts.linear_weight_bytes():
            figures["bits_per_weight"] = 8 * linear_bytes / linear_weight_count(shape)
        weights = facts.payload_bytes
        sequences = max_concurrent_sequences(
            spec.memory_bytes,
            weights,
            kv_per_token,
            target.context_length,
            target.memory_utilization,
            target.runtime_overhead_bytes,
        )
        figures["max_concurrent_sequences"] = sequences
        if sequences == 0:
            does_not_fit = (
                f"the weights ({weights} B) and one {target.context_length}-token KV cache do not fit in "
                f"{target.memory_utilization:.0%} of {spec.memory_bytes} B minus {target.runtime_overhead_bytes} B "
                "overhead"
            )
        else:
            streamed = streamed_weight_bytes(weights, facts.input_embedding_bytes(), shape.tie_word_embeddings)
            for name, batch_size in (("roofline_decode_tokens_per_s", 1), ("serving_decode_tokens_per_s", sequences)):
                figures[name] = decode_roofline_tokens_per_s(
                    spec.bandwidth_bytes_per_s, streamed, kv_per_token, target.context_length, batch_size
                )
            if target.price_per_hour is not None:
                tokens_per_hour = figures["serving_decode_tokens_per_s"] * 3600
                figures["usd_per_million_output_tokens"] = target.price_per_hour / tokens_per_hour * 1_000_000

    # Why each figure would be absent, the first reason that applies.
    both = no_shape or no_weights
    serving = both or does_not_fit
    reasons = {
        "weight_bytes": no_weights,
        "weight_bytes_in_memory": no_weights,
        "bits_per_weight": both or "no decoder-layer linear weights recognised in the checkpoint",
        "bits_per_parameter": both,
        "parameter_count": no_shape,
        "kv_bytes_per_token": no_shape,
        "max_concurrent_sequences": both,
        "roofline_decode_tokens_per_s": serving,
        "serving_decode_tokens_per_s": serving,
        "usd_per_million_output_tokens": serving or "measure.target.price_per_hour is not set",
    }
    return ModeledCost(
        **{name: figures.get(name) for name in reasons},
        target=target_name,
        target_spec=spec,
        assumptions=(
            f"capacity: {target.memory_utilization:.0%} of memory minus {target.runtime_overhead_bytes} B overhead "
            f"minus weights holds KV caches of {target.context_length} tokens; roofline: memory-bound, weights "
            f"streamed once per step plus KV at {target.context_length} tokens; roofline_decode_tokens_per_s at "
            "batch 1, serving_decode_tokens_per_s and the dollar figure at max_concurrent_sequences"
        ),
        unavailable={name: reason for name, reason in reasons.items() if name not in figures},
    )
