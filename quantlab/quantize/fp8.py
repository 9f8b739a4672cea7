"""FP8_DYNAMIC: per-channel FP8 (E4M3) weights, dynamic per-token FP8 activations; data-free."""

from __future__ import annotations

from typing import ClassVar

from quantlab.quantize.base import PresetMethod, per_channel_bytes


class Fp8(PresetMethod):
    preset: ClassVar[str] = "FP8_DYNAMIC"
    rounding_is_the_method: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "FP8_DYNAMIC"

    @staticmethod
    def linear_bytes(weights, params) -> int:
        """One FP8 byte per weight and a BF16 scale per output channel."""
        return per_channel_bytes(weights, 1)
