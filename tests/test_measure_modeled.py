"""Modeled cost against hand arithmetic for Llama-3.1-8B, Llama-3.1-70B and SmolLM2-135M."""

from __future__ import annotations

import pytest
from tiny import tiny_llama_config

from quantlab.measure.checkpoint import CheckpointFacts, TensorFact
from quantlab.measure.modeled import (
    ModelShape,
    declared_kv_cache_dtype,
    decode_roofline_tokens_per_s,
    kv_cache_bytes_per_token,
    kv_cache_element_bytes,
    linear_weight_count,
    max_concurrent_sequences,
    modeled_cost,
    parameter_count,
    streamed_weight_bytes,
)
from quantlab.measure.settings import MeasureSettings

LLAMA_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
LLAMA_70B = {
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
}
SMOLLM2_135M = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "dtype": "bfloat16",
}
GIB = 1024**3


# Per layer: q + o = 2 x hidden x heads x head_dim, k + v = 2 x hidden x kv_heads x head_dim,
# gate + up + down = 3 x hidden x intermediate.
#   8B:  q,o 2 x 4096 x 4096 = 33,554,432; k,v 2 x 4096 x 1024 = 8,388,608; mlp 3 x 4096 x 14336 =
#        176,160,768 -> 218,103,808 x 32 layers = 6,979,321,856
#   70B: 2 x 8192 x 8192 = 134,217,728; 2 x 8192 x 1024 = 16,777,216; 3 x 8192 x 28672 = 704,643,072
#        -> 855,638,016 x 80 = 68,451,041,280
#   135M: 2 x 576 x 576 = 663,552; 2 x 576 x 192 = 221,184; 3 x 576 x 1536 = 2,654,208
#        -> 3,538,944 x 30 = 106,168,320
# All parameters add embeddings (twice when untied), 2 RMSNorms per layer and a final one:
#   8B:  6,979,321,856 + 2 x 128256 x 4096 (1,050,673,152) + 32 x 8192 + 4096 = 8,030,261,248
#   70B: 68,451,041,280 + 2 x 128256 x 8192 (2,101,346,304) + 80 x 16384 + 8192 = 70,553,706,496
#   135M: 106,168,320 + 49152 x 576 (28,311,552, tied) + 30 x 1152 + 576 = 134,515,008
@pytest.mark.parametrize(
    ("config", "linear_weights", "parameters"),
    [
        (LLAMA_8B, 6_979_321_856, 8_030_261_248),
        (LLAMA_70B, 68_451_041_280, 70_553_706_496),
        (SMOLLM2_135M, 106_168_320, 134_515_008),
    ],
    ids=["llama-3.1-8b", "llama-3.1-70b", "smollm2-135m"],
)
def test_parameter_counts(config, linear_weights, parameters):
    shape = ModelShape.from_config(config)
    assert linear_weight_count(shape) == linear_weights
    assert parameter_count(shape) == parameters


# layers x KV heads x head dim x 2 (K and V) x bytes
#   8B:  32 x 8 x 128 x 2 x 2 = 131,072      70B: 80 x 8 x 128 x 2 x 2 = 327,680
#   135M: 30 x 3 x 64 x 2 x 2 = 23,040
@pytest.mark.parametrize(
    ("config", "kv_cache_dtype", "expected"),
    [
        (LLAMA_8B, "auto", 131_072),
        (LLAMA_70B, "auto", 327_680),
        (SMOLLM2_135M, "auto", 23_040),
        (LLAMA_70B, "fp8", 163_840),
        (SMOLLM2_135M, "float32", 46_080),
        ({**LLAMA_8B, "quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float"}}}, "auto", 65_536),
        ({**SMOLLM2_135M, "dtype": "float32"}, "auto", 46_080),
    ],
    ids=["8b-bf16", "70b-bf16", "135m-bf16", "70b-fp8-asked", "135m-fp32-asked", "8b-fp8-scheme", "135m-fp32-dtype"],
)
def test_kv_cache_bytes_per_token(config, kv_cache_dtype, expected):
    shape = ModelShape.from_config(config)
    assert kv_cache_bytes_per_token(shape, kv_cache_element_bytes(config, kv_cache_dtype)) == expected


def test_head_dim_from_config_wins_over_hidden_over_heads():
    shape = ModelShape.from_config({**LLAMA_8B, "head_dim": 64})
    assert shape.head_dim == 64
    assert kv_cache_bytes_per_token(shape, 2) == 32 * 8 * 64 * 2 * 2


# free for KV = memory x 0.9 - 1 GiB - weights; sequences = floor(free / (kv per token x context))
#   8B BF16 on H100 (80e9):   (72e9 - 1,073,741,824 - 16,060,522,496) / 536,870,912 = 102.2 -> 102
#   70B BF16 on H100:         72e9 - 1 GiB < 141,107,412,992 -> 0
#   70B BF16 on MI300X:       (172.8e9 - 1 GiB - 141,107,412,992) / 1,342,177,280 = 22.8 -> 22
#   70B FP8 on H100:          (72e9 - 1 GiB - 70,553,706,496) / 1,342,177,280 = 0.28 -> 0
#   70B FP8 on H200:          (126.9e9 - 1 GiB - 70,553,706,496) / 1,342,177,280 = 41.2 -> 41
#   135M BF16 on L4, 2048 tokens: (21.6e9 - 1 GiB - 269,030,016) / 47,185,920 = 429.3 -> 429
@pytest.mark.parametrize(
    ("memory", "weights", "kv_per_token", "context", "expected"),
    [
        (80_000_000_000, 16_060_522_496, 131_072, 4096, 102),
        (80_000_000_000, 141_107_412_992, 327_680, 4096, 0),
        (192_000_000_000, 141_107_412_992, 327_680, 4096, 22),
        (80_000_000_000, 70_553_706_496, 327_680, 4096, 0),
        (141_000_000_000, 70_553_706_496, 327_680, 4096, 41),
        (24_000_000_000, 269_030_016, 23_040, 2048, 429),
    ],
    ids=["8b-bf16-h100", "70b-bf16-h100", "70b-bf16-mi300x", "70b-fp8-h100", "70b-fp8-h200", "135m-bf16-l4"],
)
def test_max_concurrent_sequences(memory, weights, kv_per_token, context, expected):
    assert max_concurrent_sequences(memory, weights, kv_per_token, context, 0.9, GIB) == expected


# tokens/s = batch x bandwidth / (streamed weights + batch x KV per token x context)
#   8B BF16 on H100, batch 1, 4096: untied, so the input embedding (1,050,673,152 B) is gathered:
#       3.35e12 / (16,060,522,496 - 1,050,673,152 + 536,870,912) = 215.4795
#   70B BF16 on MI300X, batch 1:   5.3e12 / (141,107,412,992 - 2,101,346,304 + 1,342,177,280) = 37.7632
#   70B BF16 on MI300X, batch 22:  22 x 5.3e12 / (139,006,066,688 + 22 x 1,342,177,280) = 691.8487
#   135M BF16 on L4, 2048, tied (lm_head streams the table): 300e9 / (269,030,016 + 47,185,920) = 948.7188
@pytest.mark.parametrize(
    ("bandwidth", "weights", "embedding", "tied", "kv_per_token", "context", "batch", "expected"),
    [
        (3.35e12, 16_060_522_496, 1_050_673_152, False, 131_072, 4096, 1, 215.47953168),
        (5.3e12, 141_107_412_992, 2_101_346_304, False, 327_680, 4096, 1, 37.76320850),
        (5.3e12, 141_107_412_992, 2_101_346_304, False, 327_680, 4096, 22, 691.84866517),
        (300e9, 269_030_016, 56_623_104, True, 23_040, 2048, 1, 948.71878943),
    ],
    ids=["8b-h100-b1", "70b-mi300x-b1", "70b-mi300x-b22", "135m-l4-b1"],
)
def test_decode_roofline(bandwidth, weights, embedding, tied, kv_per_token, context, batch, expected):
    streamed = streamed_weight_bytes(weights, embedding, tied)
    assert decode_roofline_tokens_per_s(bandwidth, streamed, kv_per_token, context, batch) == pytest.approx(expected)


def llama_checkpoint_facts(config: dict, linear_tensors) -> CheckpointFacts:
    """Safetensors header facts of a Llama-layout checkpoint: BF16 embeddings, norms and
    lm_head; each linear layer's tensors from `linear_tensors(out_features, in_features)`."""
    shape = ModelShape.from_config(config)
    hidden, kv = shape.hidden_size, shape.num_kv_heads * shape.head_dim
    tensors = [
        TensorFact("model.embed_tokens.weight", "BF16", (shape.vocab_size, hidden), shape.vocab_size * hidden * 2)
    ]
    projections = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (kv, hidden),
        "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (shape.intermediate_size, hidden),
        "mlp.up_proj": (shape.intermediate_size, hidden),
        "mlp.down_proj": (hidden, shape.intermediate_size),
    }
    for layer in range(shape.num_layers):
        prefix = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors.append(TensorFact(f"{prefix}.{norm}.weight", "BF16", (hidden,), hidden * 2))
        for name, (out_features, in_features) in projections.items():
            for attribute, dtype, dims, nbytes in linear_tensors(out_features, in_features):
                tensors.append(TensorFact(f"{prefix}.{name}.{attribute}", dtype, dims, nbytes))
    tensors.append(TensorFact("model.norm.weight", "BF16", (hidden,), hidden * 2))
    if not shape.tie_word_embeddings:
        tensors.append(TensorFact("lm_head.weight", "BF16", (shape.vocab_size, hidden), shape.vocab_size * hidden * 2))
    payload = sum(tensor.nbytes for tensor in tensors)
    return CheckpointFacts((("model.safetensors", payload + 4096),), tuple(tensors))


def bf16_linear(out_features, in_features):
    return [("weight", "BF16", (out_features, in_features), out_features * in_features * 2)]


def fp8_channel_linear(out_features, in_features):
    return [
        ("weight", "F8_E4M3", (out_features, in_features), out_features * in_features),
        ("weight_scale", "BF16", (out_features, 1), out_features * 2),
    ]


def int4_group64_linear(out_features, in_features):
    return [
        ("weight_packed", "I32", (out_features, in_features // 8), out_features * in_features // 2),
        ("weight_scale", "BF16", (out_features, in_features // 64), out_features * in_features // 64 * 2),
        ("weight_shape", "I64", (2,), 16),
        ("input_scale", "BF16", (1,), 2),
    ]  # an activation scale: not a weight


# bits per linear weight = 8 x bytes of the linear layers' weight tensors / linear weights
#   BF16: 16.  FP8 per-channel: 8 + 16 bits of scale per row of `in` weights:
#     8B: 8 + 16 x (rows summed) / weights; INT4 group 64: 4 + 16/64 + 16 B weight_shape per layer.
#   135M INT4 g64: 4.25 + 210 x 16 x 8 / 106,168,320 = 4.25025318
#   8B FP8: rows per layer = 4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096 = 43,008;
#     8 + 32 x 43,008 x 16 / 6,979,321,856 = 8.00315493
@pytest.mark.parametrize(
    ("config", "linear", "bits_per_weight"),
    [
        (LLAMA_8B, bf16_linear, 16.0),
        (LLAMA_8B, fp8_channel_linear, 8.00315493),
        (SMOLLM2_135M, int4_group64_linear, 4.25025318),
        (LLAMA_70B, bf16_linear, 16.0),
    ],
    ids=["8b-bf16", "8b-fp8", "135m-int4-g64", "70b-bf16"],
)
def test_bits_per_weight_over_linear_weights(config, linear, bits_per_weight):
    cost = modeled_cost(config, llama_checkpoint_facts(config, linear))
    assert cost.bits_per_weight == pytest.approx(bits_per_weight)


def test_bf16_checkpoint_figures_of_llama_8b_on_h100():
    facts = llama_checkpoint_facts(LLAMA_8B, bf16_linear)
    settings = MeasureSettings(target={"accelerator": "h100 sxm", "price_per_hour": 2.0, "context_length": 4096})
    cost = modeled_cost(LLAMA_8B, facts, settings)
    assert cost.target == "H100-SXM"
    assert cost.weight_bytes_in_memory == 16_060_522_496  # 2 bytes x 8,030,261,248
    assert cost.weight_bytes == 16_060_522_496 + 4096  # the file: payload + header
    assert cost.bits_per_parameter == pytest.approx(16.0)
    assert cost.kv_bytes_per_token == 131_072
    assert cost.max_concurrent_sequences == 102
    assert cost.roofline_decode_tokens_per_s == pytest.approx(215.47953168)
    # At 102 sequences: 102 x 3.35e12 / (15,009,849,344 + 102 x 536,870,912) = 4,914.71 tokens/s
    assert cost.serving_decode_tokens_per_s == pytest.approx(102 * 3.35e12 / (15_009_849_344 + 102 * 536_870_912))
    assert cost.usd_per_million_output_tokens == pytest.approx(2.0 / (cost.serving_decode_tokens_per_s * 3600) * 1e6)
    assert set(cost.unavailable) == set()


def test_what_does_not_fit_is_absent_with_a_reason_never_zero():
    facts = llama_checkpoint_facts(LLAMA_70B, bf16_linear)
    cost = modeled_cost(LLAMA_70B, facts, MeasureSettings(target={"accelerator": "H100-SXM", "price_per_hour": 3}))
    assert cost.max_concurrent_sequences == 0
    metrics = cost.to_metrics()
    for figure in ("roofline_decode_tokens_per_s", "serving_decode_tokens_per_s", "usd_per_million_output_tokens"):
        assert f"cost/{figure}" not in metrics
        assert "do not fit" in cost.unavailable[figure]


def test_without_a_price_the_dollar_figure_is_absent_with_a_reason():
    cost = modeled_cost(SMOLLM2_135M, llama_checkpoint_facts(SMOLLM2_135M, bf16_linear))
    assert cost.usd_per_million_output_tokens is None
    assert "price_per_hour" in cost.unavailable["usd_per_million_output_tokens"]
    assert cost.roofline_decode_tokens_per_s is not None


def test_without_a_checkpoint_only_config_figures_remain():
    cost = modeled_cost(LLAMA_8B, None)
    assert cost.to_metrics() == {"cost/parameter_count": 8_030_261_248.0, "cost/kv_bytes_per_token": 131_072.0}
    assert cost.unavailable["weight_bytes"] == "no checkpoint directory given"


def test_a_config_that_is_not_a_llama_family_decoder_leaves_shape_figures_absent():
    cost = modeled_cost({"d_model": 512}, llama_checkpoint_facts(SMOLLM2_135M, bf16_linear))
    assert cost.weight_bytes is not None
    assert cost.kv_bytes_per_token is None
    assert "hidden_size" in cost.unavailable["kv_bytes_per_token"]


def test_modeled_cost_reads_a_saved_checkpoint(tmp_path):
    import torch
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(tmp_path)

    cost = modeled_cost(None, tmp_path)  # reads tmp_path/config.json
    files = sum(file.stat().st_size for file in tmp_path.glob("*.safetensors"))
    parameters = sum(parameter.numel() for parameter in model.parameters())
    assert cost.weight_bytes == files
    assert cost.weight_bytes_in_memory == 2 * parameters
    assert cost.parameter_count == parameters
    assert cost.bits_per_weight == pytest.approx(16.0)
    assert cost.kv_bytes_per_token == 2 * 2 * 16 * 2 * 2  # layers x kv heads x head dim x K,V x BF16


@pytest.mark.parametrize(
    ("scheme", "declared"),
    [
        ({"type": "float", "num_bits": 8, "strategy": "tensor"}, "fp8"),  # llm-compressor's FP8 KV cache
        ({"type": "int", "num_bits": 8}, "auto"),  # no engine quantlab drives stores an INT8 cache as declared
        (None, "auto"),
    ],
)
def test_the_kv_cache_a_checkpoint_declares(scheme, declared):
    quantization = {"quant_method": "compressed-tensors"} | ({"kv_cache_scheme": scheme} if scheme else {})
    assert declared_kv_cache_dtype({"quantization_config": quantization}) == declared
