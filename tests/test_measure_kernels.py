"""The kernel path says how the weights ran: plain dtype, compressed-tensors dequantized, or FP8 matmul."""

from __future__ import annotations

import torch
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, QuantizationStatus

from quantlab.measure.provenance import describe_quantization_args, kernel_path, linear_kernel_path

INT4_G64 = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=64, symmetric=True)
FP8_CHANNEL = QuantizationArgs(num_bits=8, type="float", strategy="channel", symmetric=True)
FP8_TOKEN_DYNAMIC = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)


def quantized_linear(weights, activations=None, status=QuantizationStatus.DECOMPRESSED, dtype=torch.bfloat16):
    """A Linear as compressed-tensors leaves it: a scheme and a status attached to the module."""
    module = torch.nn.Linear(64, 64, bias=False).to(dtype)
    module.quantization_scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=activations)
    module.quantization_status = status
    return module


def test_quantization_args_in_words():
    assert describe_quantization_args(INT4_G64) == "INT4 group-64 symmetric"
    assert describe_quantization_args(FP8_CHANNEL) == "FP8 per-channel"
    assert describe_quantization_args(FP8_TOKEN_DYNAMIC) == "FP8 per-token dynamic"


def test_a_plain_model_runs_in_its_weight_dtype_on_cpu():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    assert kernel_path(model) == "FP32 matmul (2 Linear) on CPU"
    assert kernel_path(model.to(torch.bfloat16)) == "BF16 matmul (2 Linear) on CPU"


def test_a_decompressed_int4_layer_is_a_bf16_matmul():
    path = linear_kernel_path(quantized_linear(INT4_G64))
    assert path == "INT4 group-64 symmetric weights dequantized to BF16 once, BF16 matmul"


def test_fp8_dynamic_on_cpu_is_bf16_matmul_with_fake_quantized_activations():
    path = linear_kernel_path(quantized_linear(FP8_CHANNEL, FP8_TOKEN_DYNAMIC))
    assert path.startswith("FP8 per-channel weights dequantized to BF16 once, BF16 matmul")
    assert path.endswith("FP8 per-token dynamic activations fake-quantized")


def test_weights_not_yet_decompressed_are_named_so():
    module = quantized_linear(FP8_CHANNEL, status=QuantizationStatus.COMPRESSED)
    module.weight = torch.nn.Parameter(module.weight.to(torch.float8_e4m3fn), requires_grad=False)
    assert "still compressed" in linear_kernel_path(module)


def test_weights_before_compression_are_fake_quantized_each_forward():
    path = linear_kernel_path(quantized_linear(INT4_G64, status=QuantizationStatus.FROZEN))
    assert path == "INT4 group-64 symmetric weights fake-quantized each forward, BF16 matmul"


def test_layers_are_grouped_by_path_most_common_first():
    model = torch.nn.Sequential(
        quantized_linear(INT4_G64), quantized_linear(INT4_G64), torch.nn.Linear(64, 64).to(torch.bfloat16)
    )
    assert kernel_path(model) == (
        "INT4 group-64 symmetric weights dequantized to BF16 once, BF16 matmul (2 Linear); "
        "BF16 matmul (1 Linear) on CPU"
    )
