"""Runs at start-up in every Python process of a vLLM server quantlab launches on a CPU (PYTHONPATH names this
folder; it imports nothing of quantlab: it runs in the engine's own environment).

Without AMX-FP8 (every CPU before Diamond Rapids), vLLM's CPU build runs FP8 W8A8 layers through its generic
`ChannelWiseTorchFP8ScaledMMLinearKernel`, which calls `torch._scaled_mm`; on CPU that op is a reference loop,
400-900x slower than a bf16 GEMM of the same shape (measured here at 64 tokens: 920 ms against 2 ms), so an FP8
checkpoint serves at ~1 token/s and its served evaluation takes an hour. This swaps the op, for FP8 inputs on CPU
only, for the same product computed as a bf16 GEMM: FP8 e4m3 and e5m2 values are exact in bf16, the GEMM accumulates
in fp32, and its output is rounded to bf16 once before the scales are applied (vLLM's path keeps that output in
fp32 and rounds to bf16 after the scales): at most 2^-8 relative, bf16's unit roundoff, against the FP8 e4m3
rounding of the inputs (2^-4).
vLLM's kernel, its dynamic per-token activation quantization and its scales are untouched.
"""

from __future__ import annotations

import sys

try:
    import torch
except ImportError:  # a helper process of the engine started without its site-packages: nothing to patch there
    torch = None

_FP8 = {torch.float8_e4m3fn, torch.float8_e5m2} if torch else set()
_reference_scaled_mm = torch._scaled_mm if torch else None
# quantlab reads this line in the server's log to label the kernel (SCALED_MM_LINE in serving/engines/vllm.py)
SCALED_MM_NOTICE = "quantlab: torch._scaled_mm on CPU runs FP8 inputs as a bf16 GEMM of their exact values"
_weights_in_bf16: dict[tuple, tuple] = {}  # (address, shape, strides) -> (storage kept alive, bf16 copy)


def _as_bf16_weight(weight: torch.Tensor) -> torch.Tensor:
    # The weight operand is the same stored tensor on every call: convert it once. Holding its storage keeps the
    # address from being reused by another tensor while the copy is cached.
    key = (weight.data_ptr(), tuple(weight.shape), weight.stride())
    cached = _weights_in_bf16.get(key)
    if cached is None:
        cached = (weight.untyped_storage(), weight.to(torch.bfloat16))
        _weights_in_bf16[key] = cached
    return cached[1]


def _scaled_mm(a, b, scale_a=None, scale_b=None, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    if a.device.type != "cpu" or a.dtype not in _FP8 or b.dtype not in _FP8 or scale_result is not None:
        return _reference_scaled_mm(
            a, b, scale_a, scale_b, bias=bias, scale_result=scale_result, out_dtype=out_dtype,
            use_fast_accum=use_fast_accum,
        )  # fmt: skip
    product = torch.mm(a.to(torch.bfloat16), _as_bf16_weight(b)).float()
    if scale_a is not None:
        product = product * scale_a.float()
    if scale_b is not None:
        product = product * scale_b.float()
    if bias is not None:
        product = product + bias.float()
    return product.to(out_dtype or a.dtype)


if torch is not None:
    torch._scaled_mm = _scaled_mm
    print(SCALED_MM_NOTICE, file=sys.stderr, flush=True)
