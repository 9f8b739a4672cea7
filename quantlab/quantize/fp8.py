"""FP8_DYNAMIC: per-channel FP8 (E4M3) weights, dynamic per-token FP8 activations; data-free."""

from __future__ import annotations

from typing import ClassVar

from quantlab.quantize.base import PresetMethod, Served, Support, per_channel_bytes


class Fp8(PresetMethod):
    preset: ClassVar[str] = "FP8_DYNAMIC"
    rounding_is_the_method: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "FP8_DYNAMIC"
    served: ClassVar[Served] = {
        "vllm": {
            "cpu": Support(
                "ChannelWiseTorchFP8ScaledMMLinearKernel",
                "vLLM's native CPU FP8 kernels need AMX-FP8 (Diamond Rapids); before it stock vLLM runs its generic "
                "torch kernel, whose scaled-mm is a reference loop on CPU (hundreds of times slower than BF16); "
                "serving.plugins: [fp8-upcast-gemm] runs quantlab's kernel instead (not stock vLLM)",
            ),
            "cuda": Support("CUTLASS FP8 scaled-mm (SM >= 89); weight-only Marlin FP8 on older GPUs"),
        },
        "transformers": {
            "cuda": Support("compressed-tensors FP8 matmul where the GPU has FP8 (SM >= 89), else dequantized"),
        },
    }

    @staticmethod
    def linear_bytes(weights, params) -> int:
        """One FP8 byte per weight and a BF16 scale per output channel."""
        return per_channel_bytes(weights, 1)
