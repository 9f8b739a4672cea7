"""GPTQ + W4A16: group-wise INT4 weights, each column's rounding error pushed onto the columns not yet
quantized through the calibration inputs' Hessian (llm-compressor's GPTQModifier)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BeforeValidator, Field

from quantlab.quantize.base import GroupwiseInt4, calibrated_oneshot


def _weight_for_static(value: object) -> object:
    # compressed-tensors takes "static" as another name of "weight": one spelling keeps one cache key per checkpoint.
    return "weight" if value == "static" else value


class GptqInt4(GroupwiseInt4):
    class Params(GroupwiseInt4.Params):
        actorder: Annotated[Literal["weight"] | None, BeforeValidator(_weight_for_static)] = Field(
            "weight",
            description=(
                "Activation ordering: 'weight' (llm-compressor's 'static' is the same) quantizes the columns with "
                "the largest calibration activations first, during calibration only: the checkpoint's layout and "
                "serving speed are those of no ordering (null). The default is what llm-compressor's W4A16 "
                "examples get by leaving it unset (GPTQModifier's default, the most accurate at no runtime cost). "
                "'group' (a g_idx per layer, slower to serve) was removed in compressed-tensors 0.19."
            ),
        )
        dampening_frac: float = Field(
            0.01, gt=0, le=1, description="Added to the Hessian's diagonal, as a fraction of its mean, to invert it."
        )

    @staticmethod
    def apply(model, params: Params, calibration) -> None:
        from llmcompressor.modifiers.gptq import GPTQModifier

        recipe = GPTQModifier(
            config_groups=GroupwiseInt4.int4_groups(params),
            ignore=list(params.ignore),
            actorder=params.actorder,
            dampening_frac=params.dampening_frac,
        )
        calibrated_oneshot(model, recipe, calibration)
