"""W4A8-FP8 (compressed-tensors' W4AFP8): symmetric INT4 weights in groups with a BF16 scale each, dynamic per-token
FP8 activations; data-free. Stored pack-quantized (eight INT4 weights per int32), the layout vLLM's W4A8 kernels
read; llm-compressor alone would store each INT4 weight in a byte (int-quantized)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from quantlab.quantize.base import GroupwiseInt4, PresetMethod, Served, Support, divides_widths, preset_scheme

VLLM_GROUP_SIZE = 128


class W4A8Fp8(PresetMethod):
    class Params(PresetMethod.Params):
        group_size: int = Field(
            128, gt=0, description="Input channels sharing one scale; must divide every layer's input width."
        )

    preset: ClassVar[str] = "W4AFP8"
    rounding_is_the_method: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "W4AFP8"
    served: ClassVar[Served] = {
        # vLLM 0.32's CPU build has no W4A8-FP8 kernel.
        "vllm": {
            "cuda": Support(
                "CutlassW4A8LinearKernel on Hopper (SM 90) with groups of 128",
                "vLLM has W4A8-FP8 kernels for Hopper only, for groups of 128 only, and it converts the "
                "checkpoint's BF16 group scales to FP8 at load: what it serves rounds the scales once more than "
                "what the reference scored",
            ),
        },
    }

    @classmethod
    def scheme(cls, params: Params) -> Any:
        scheme = preset_scheme(cls.preset)
        scheme.weights.group_size = params.group_size
        scheme.format = "pack-quantized"
        return scheme

    @staticmethod
    def linear_bytes(weights, params) -> int:
        """Group-wise INT4 pack-quantized, as W4A16's (no zero point: symmetric)."""
        return GroupwiseInt4.linear_bytes(weights, {"group_size": params.get("group_size", 128)})

    @staticmethod
    def check_model(params: Params, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        return divides_widths("group_size", params.group_size, linear_widths)

    @staticmethod
    def check_served(params: Params, engine: str) -> list[tuple[str, str]]:
        if engine == "vllm" and params.group_size != VLLM_GROUP_SIZE:
            why = f"vLLM's W4A8-FP8 kernels take groups of {VLLM_GROUP_SIZE} only, not {params.group_size}"
            return [("group_size", why)]
        return []
