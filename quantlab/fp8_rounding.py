"""FP8 (E4M3) rounding on a CPU, bit for bit torch's own cast, without its slow way back.

Every FP8 forward on a CPU rounds each linear layer's input activations to FP8 and back
(compressed-tensors' fake quantization: `tensor.to(float8_e4m3fn).to(tensor.dtype)`). torch's CPU cast
*from* FP8 is a scalar loop: with the rounding it was 12.4 of the 47.8 s the embedded FP8 variant spent
in lm-eval (py-spy, BF16). `round_to_fp8_e4m3` rounds with five vectorized elementwise ops instead
(`benchmarks/fp8_rounding.py` times both), and `install` puts it under compressed-tensors for CPU tensors.

Why the arithmetic is exact: E4M3 keeps 3 mantissa bits and its subnormals step by 2^-9, so a value
of binade 2^e rounds to a multiple of q = 2^(max(e, -6) - 3). Adding c = 1.5 * q * 2^M (M: the
compute dtype's mantissa bits) lands every |x| < 2^(e+1) in c's binade, where the dtype's own step is
q: the addition rounds x to nearest-even on q's grid (c is an even multiple of q, so "even" is the
FP8 mantissa's), and subtracting c again is exact. The sign is copied back for zeros (-tiny -> -0).
Inputs are clamped to +-448 first (compressed-tensors does; so nothing rounds past FP8's largest),
and NaN stays NaN. `tests/test_fp8_rounding.py` checks all 65,536 BF16 values and FP8's grid points,
midpoints and their neighbours in float32 against torch's cast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL_EXPONENT = -6
E4M3_MAX = 448.0
# For whoever opens a server's log: what was changed in its process.
INSTALLED_NOTICE = "quantlab: compressed-tensors' FP8 rounding on CPU goes through quantlab.fp8_rounding"


def _layouts() -> dict:
    """The compute dtypes this rounds, as (the same-width integer dtype, mantissa bits, exponent bits)."""
    import torch

    return {torch.bfloat16: (torch.int16, 7, 8), torch.float32: (torch.int32, 23, 8)}


def rounds_on_cpu(tensor: torch.Tensor) -> bool:
    """Whether `round_to_fp8_e4m3` takes this tensor (a CPU tensor in BF16 or float32)."""
    return tensor.device.type == "cpu" and tensor.dtype in _layouts()


def round_to_fp8_e4m3(values: torch.Tensor) -> torch.Tensor:
    """`values.to(torch.float8_e4m3fn).to(values.dtype)` for |values| <= 448, in BF16 or float32 on a CPU."""
    import torch

    integers, mantissa_bits, exponent_bits = _layouts()[values.dtype]
    bias = (1 << (exponent_bits - 1)) - 1
    exponent_field = ((1 << exponent_bits) - 1) << mantissa_bits
    lowest_binade = (bias + E4M3_MIN_NORMAL_EXPONENT) << mantissa_bits
    # c = 1.5 * 2^(e + M - 3): the exponent moved up by M - 3 binades, the mantissa's top bit set
    shift = ((mantissa_bits - E4M3_MANTISSA_BITS) << mantissa_bits) | (1 << (mantissa_bits - 1))
    binade = (values.view(integers) & exponent_field).clamp_min_(lowest_binade)
    offset = binade.add_(shift).view(values.dtype)
    return torch.copysign((values + offset).sub_(offset), values)


def install() -> bool:
    """Route compressed-tensors' FP8 rounding of CPU tensors through `round_to_fp8_e4m3`; True if this call did.

    compressed-tensors 0.19 has no backend hook for fake quantization (its `ImplBackend` covers `_quantize`
    only), so this replaces the rounding function its quantize-dequantize helpers call (the replaced one stays
    reachable as `.original`). Everything else (other formats, other devices, other dtypes) goes to the original."""
    from compressed_tensors.quantization import QuantizationType
    from compressed_tensors.quantization.lifecycle import forward_helpers

    original = forward_helpers.round_to_quantized_type_args
    if hasattr(original, "original"):
        return False

    def round_to_quantized_type_args(tensor, args, min, max, cast_to_original_dtype=True):
        fp8 = args.type == QuantizationType.FLOAT and args.num_bits == 8
        if fp8 and cast_to_original_dtype and rounds_on_cpu(tensor):
            import torch

            return round_to_fp8_e4m3(torch.clamp(tensor, min, max).to(tensor.dtype))
        return original(tensor, args, min, max, cast_to_original_dtype)

    round_to_quantized_type_args.original = original
    forward_helpers.round_to_quantized_type_args = round_to_quantized_type_args
    return True
