"""W4A8-FP8 (compressed-tensors' W4AFP8): symmetric INT4 weights in groups with a BF16 scale each, dynamic per-token
FP8 activations; data-free. Stored pack-quantized (eight INT4 weights per int32), the layout vLLM's W4A8 kernels
read; llm-compressor alone would store each INT4 weight in a byte (int-quantized)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from quantlab.quantize.base import GroupwiseInt4, PresetMethod, divides_widths, preset_scheme


class W4A8Fp8(PresetMethod):
    class Params(PresetMethod.Params):
        group_size: int = Field(
            128, gt=0, description="Input channels sharing one scale; must divide every layer's input width."
        )

    preset: ClassVar[str] = "W4AFP8"
    rounding_is_the_method: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "W4AFP8"

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
