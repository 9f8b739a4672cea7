"""AWQ + W4A16: activation-aware scaling, then group-wise INT4 weights (llm-compressor)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Literal
from unittest.mock import patch

from pydantic import Field

from quantlab.quantize.base import GroupwiseInt4, calibrated_oneshot


class AwqInt4(GroupwiseInt4):
    class Params(GroupwiseInt4.Params):
        duo_scaling: bool | Literal["both"] = Field(True, description="AWQ scale search uses weights and activations.")
        # At least 4: llm-compressor's grid divides by (n_grid - 2), and by (n_grid / 2 - 1) for "both".
        n_grid: int = Field(
            20, ge=4, description="Scales AWQ tries per layer mapping: fewer quantize faster and may round worse."
        )

    @staticmethod
    def apply(model, params: Params, calibration) -> None:
        import torch
        from llmcompressor.modifiers.transform.awq import AWQModifier
        from llmcompressor.pipelines.cache import IntermediatesCache

        recipe = [AWQModifier(duo_scaling=params.duo_scaling, n_grid=params.n_grid), *GroupwiseInt4.rounded(params)]
        # llm-compressor 0.14's AWQ pins cached activations to speed copies to an accelerator; with none,
        # `Tensor.pin_memory()` raises ("Cannot access accelerator device..."), so pinning is skipped.
        unpinned = patch.object(IntermediatesCache, "pin_memory", lambda self, batch_index, input_names=None: None)
        with nullcontext() if torch.accelerator.is_available() else unpinned:
            calibrated_oneshot(model, recipe, calibration)
