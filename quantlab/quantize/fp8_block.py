"""FP8 block-scaled (W8A8): FP8 (E4M3) weights with one scale per square block, activations per token in groups of
the block's width, scaled dynamically; data-free. DeepSeek-V3's layout (blocks of 128); `block_size` narrows it for
models whose widths 128 does not divide (SmolLM2-135M's 576)."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field

from quantlab.quantize.base import PresetMethod, divides_widths, preset_scheme


class Fp8Block(PresetMethod):
    class Params(PresetMethod.Params):
        block_size: int = Field(
            128, gt=0, description="Weight block side and activation group width; must divide every input width."
        )

    preset: ClassVar[str] = "FP8_BLOCK"
    rounding_is_the_method: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "FP8_BLOCK"

    @classmethod
    def scheme(cls, params: Params) -> Any:
        if params.block_size == 128:
            return cls.preset
        scheme = preset_scheme(cls.preset)
        scheme.weights.block_structure = [params.block_size, params.block_size]
        scheme.input_activations.group_size = params.block_size
        return scheme

    @staticmethod
    def linear_bytes(weights, params) -> int:
        """One FP8 byte per weight and a BF16 scale per block, a partial block at a layer's edge counting whole."""
        block = params.get("block_size", 128)
        blocks = sum(-(-outputs // block) * -(-inputs // block) for outputs, inputs in weights.layer_shapes)
        return weights.linear_weights + 2 * weights.layers * blocks

    @staticmethod
    def check_model(params: Params, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        return divides_widths("block_size", params.block_size, linear_widths)
