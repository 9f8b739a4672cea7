"""compressed-tensors' fake quantization on a CPU, faster, with the same values bit for bit.

A quantized checkpoint scored on a CPU runs as compressed-tensors runs it: every forward rounds each quantized
linear layer's input to the format (FP8 per token for FP8_DYNAMIC) and back. On the embedded FP8 variant that
rounding made lm-eval's forwards 1.65x and a served token 2.3x as slow as BF16's. `install` changes three things:

- **FP8 rounding.** `tensor.to(float8_e4m3fn).to(tensor.dtype)`: torch's CPU cast *from* FP8 is a scalar loop
  (2 of the round trip's 2.3 ns per element). `round_to_fp8_e4m3` does it in five vectorized ops (0.5 ns).
- **Per-token FP8 in a third of the ops.** compressed-tensors computes a dynamic per-token FP8 input's scales and
  zero points through about 30 small torch ops; a served token's call spent 0.3 ms in their dispatch alone.
  `fp8_per_token` does the same arithmetic in ten.
- **A dynamic input rounded once.** q/k/v (and gate/up) take the same tensor, and each rounded it again. The
  rounding of a dynamic (per-token, per-group) input depends only on the tensor and the quantization args, so the
  last one is reused while the tensor is the same object, unchanged (torch's version counter) and rounded with
  equal args and no global scale. Tensors of inference mode have no version counter: never reused.

Why the FP8 arithmetic is exact: E4M3 keeps 3 mantissa bits and its subnormals step by 2^-9, so a value of binade
2^e rounds to a multiple of q = 2^(max(e, -6) - 3). Adding c = 1.5 * q * 2^M (M: the compute dtype's mantissa bits)
lands every |x| < 2^(e+1) in c's binade, where the dtype's own step is q: the addition rounds x to nearest-even on
q's grid (c is an even multiple of q, so "even" is the FP8 mantissa's), and subtracting c again is exact. The sign
is copied back for zeros (-tiny -> -0). Inputs are clamped to +-448 first (compressed-tensors does; nothing rounds
past FP8's largest), and NaN stays NaN. tests/test_fake_quant.py checks all 65,536 BF16 values, and FP8's grid
points, midpoints and their neighbours in float32, against torch's cast, and `fp8_per_token` against
compressed-tensors' own function; tests/test_formats.py whole models' logits against compressed-tensors' own path.
`benchmarks/fp8_activation_cost.py` times both ways side by side.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL_EXPONENT = -6
E4M3_MAX = 448.0
# For whoever opens a server's log: what was changed in its process.
INSTALLED_NOTICE = "quantlab: compressed-tensors' fake quantization on CPU goes through quantlab.fake_quant"


def _layouts() -> dict:
    """The compute dtypes this rounds, as (the same-width integer dtype, mantissa bits, exponent bits)."""
    import torch

    return {torch.bfloat16: (torch.int16, 7, 8), torch.float32: (torch.int32, 23, 8)}


def rounds_on_cpu(tensor: torch.Tensor) -> bool:
    """Whether `round_to_fp8_e4m3` takes this tensor (a CPU tensor in BF16 or float32)."""
    return tensor.device.type == "cpu" and tensor.dtype in _layouts()


def round_to_fp8_e4m3(values: torch.Tensor) -> torch.Tensor:
    """`values.to(torch.float8_e4m3fn).to(values.dtype)` for |values| <= 448, in BF16 or float32 on a CPU."""

    integers, mantissa_bits, exponent_bits = _layouts()[values.dtype]
    bias = (1 << (exponent_bits - 1)) - 1
    exponent_field = ((1 << exponent_bits) - 1) << mantissa_bits
    lowest_binade = (bias + E4M3_MIN_NORMAL_EXPONENT) << mantissa_bits
    # c = 1.5 * 2^(e + M - 3): the exponent moved up by M - 3 binades, the mantissa's top bit set
    shift = ((mantissa_bits - E4M3_MANTISSA_BITS) << mantissa_bits) | (1 << (mantissa_bits - 1))
    binade = (values.view(integers) & exponent_field).clamp_min_(lowest_binade)
    offset = binade.add_(shift).view(values.dtype)
    return (values + offset).sub_(offset).copysign_(values)


def install() -> bool:
    """The three changes, once per process; True if this call made them. The replaced functions stay reachable as
    `.original` on their replacements.

    compressed-tensors 0.19 has no backend hook for fake quantization (its `ImplBackend` covers `_quantize` only),
    so this replaces the two module-level functions its forward calls: the rounding its quantize-dequantize helpers
    call, and the forward's `forward_quantize`. Everything not described above goes to the originals."""
    from compressed_tensors.quantization.lifecycle import forward, forward_helpers

    if hasattr(forward_helpers.round_to_quantized_type_args, "original"):
        return False
    forward_helpers.round_to_quantized_type_args = _fast_fp8(forward_helpers.round_to_quantized_type_args)
    forward.forward_quantize = _dynamic_inputs(forward.forward_quantize)
    return True


def _is_fp8(args) -> bool:
    from compressed_tensors.quantization import QuantizationType

    return args.type == QuantizationType.FLOAT and args.num_bits == 8


def _fast_fp8(original):
    def round_to_quantized_type_args(tensor, args, min, max, cast_to_original_dtype=True):
        if _is_fp8(args) and cast_to_original_dtype and rounds_on_cpu(tensor):
            import torch

            return round_to_fp8_e4m3(torch.clamp(tensor, min, max).to(tensor.dtype))
        return original(tensor, args, min, max, cast_to_original_dtype)

    round_to_quantized_type_args.original = original
    return round_to_quantized_type_args


def _dynamic_inputs(original):
    # (input, its version, args, rounded, its version): the last dynamic input rounded. Holding the input keeps its
    # id from being reused by another tensor; a thread with another tensor simply misses.
    last: list[tuple] = []

    def forward_quantize(module, value, base_name, args):
        dynamic = base_name == "input" and args.dynamic is True
        if not dynamic or getattr(module, "input_global_scale", None) is not None:
            return original(module, value, base_name, args)
        reusable = not value.is_inference()
        if reusable and last:
            source, version, source_args, rounded, rounded_version = last[0]
            unchanged = version == value._version and rounded_version == rounded._version
            if source is value and unchanged and source_args == args:  # args last: the costliest comparison
                return rounded
        if fp8_per_token_applies(args, value):
            rounded = fp8_per_token(value)
        else:
            rounded = original(module, value, base_name, args)
        if reusable:
            last[:] = [(value, value._version, args, rounded, rounded._version)]
        return rounded

    forward_quantize.original = original
    return forward_quantize


def fp8_per_token_applies(args, value: torch.Tensor) -> bool:
    """Whether `fp8_per_token` computes what compressed-tensors would for these (dynamic, global-scale-free) args:
    FP8, symmetric, one scale per token of a (batch, tokens, width) input, no rounding of the scale itself."""
    from compressed_tensors.quantization import QuantizationStrategy

    fp8 = _is_fp8(args) and args.symmetric
    # a 2-D input's "per token" scale is one per tensor in compressed-tensors (it reduces all but dims 0 and 1)
    per_token = args.strategy == QuantizationStrategy.TOKEN and value.ndim == 3
    return fp8 and per_token and args.scale_dtype is None and rounds_on_cpu(value)


def fp8_per_token(values: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' dynamic per-token FP8 quantize-dequantize of `values`, bit for bit, in a third of its ops.

    Its way (0.19, `forward_quantize` -> `compute_dynamic_scales_and_zp` -> `calculate_qparams` -> `fake_quantize`)
    takes each token's min and max, each clamped through 0, the larger magnitude over the FP8 range's half (in the
    input's dtype), replaces a zero scale with the dtype's eps, divides, adds the zero point (0: turns -0 into +0),
    clamps, rounds, subtracts the zero point (x - 0 = x) and multiplies back: about 30 torch ops, most on a
    token-sized tensor, where a served token's (1 x 1 x 576) call spends 0.3 ms in dispatch. The same arithmetic:"""
    import torch

    half_range, eps = _scale_constants(values.dtype)
    scale = values.abs().amax(dim=-1, keepdim=True) / half_range  # = max(|min(min, 0)|, |max(max, 0)|)
    scale = torch.where(scale == 0, eps, scale)
    scaled = (values / scale).add_(0.0).clamp_(-E4M3_MAX, E4M3_MAX)
    return round_to_fp8_e4m3(scaled).mul_(scale)


@functools.cache
def _scale_constants(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The divisor of a per-token FP8 scale and its floor, as compressed-tensors makes them: the range
    (448 - -448, float32) cast to the dtype and halved; the dtype's eps."""
    import torch

    full_range = torch.tensor(2 * E4M3_MAX).to(dtype)
    return full_range / 2, torch.tensor(torch.finfo(dtype).eps, dtype=dtype)
