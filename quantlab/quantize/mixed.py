"""A format per group of layers (what `quantlab sensitivity --budget-bits` writes): each part a registered method's
format, round-to-nearest, over the modules it names; everything else stays BF16. One llm-compressor modifier with a
compressed-tensors config group per part: the checkpoint's format is `mixed-precision`, each group in its own."""

from __future__ import annotations

import re
from typing import Any, ClassVar

from pydantic import Field, model_validator

from quantlab.quantize.base import Method, MethodParams, calibrated_oneshot

# The methods a part may name. The registry (quantlab.quantize) hands them over once it is built: this module must not
# import the registry that imports it (tests/test_architecture.py keeps the house free of import cycles).
PART_METHODS: dict[str, type[Method]] = {}


class MixPart(MethodParams):
    method: str = Field(description="A registered quantizing method whose format these modules take.")
    params: dict[str, Any] = Field(default_factory=dict, description="That method's params (its ignore is unused).")
    modules: list[str] = Field(min_length=1, description="Module names or re: patterns, as llm-compressor targets.")

    @model_validator(mode="after")
    def _a_quantizing_method(self) -> MixPart:
        if self.method not in PART_METHODS:
            known = sorted(PART_METHODS)
            raise ValueError(f"unknown method '{self.method}' for a part; known: {', '.join(known)}")
        if PART_METHODS[self.method].rounded(self.method_params()) is None:
            raise ValueError(f"'{self.method}' quantizes nothing: leave its modules out (they stay BF16)")
        return self

    def method_params(self) -> MethodParams:
        return PART_METHODS[self.method].Params.model_validate(self.params)


class Mixed(Method):
    class Params(MethodParams):
        formats: list[MixPart] = Field(min_length=1, description="The parts, each a method over some modules.")
        ignore: list[str] = Field(default_factory=lambda: ["lm_head"], description="Modules kept in BF16.")

    # Static activation scales (NVFP4's global input scales, FP8 static) are calibrated on the recipe's samples; a mix
    # of data-free formats spends a calibration pass for nothing.
    needs_calibration: ClassVar[bool] = True
    stored_format: ClassVar[str | None] = "mixed-precision"  # compressed-tensors' name: no one kernel serves it

    @staticmethod
    def check_model(params: Params, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        """Each part's patterns match a linear layer, and its method fits the layers it takes (e.g. group sizes)."""
        from compressed_tensors.utils.match import match_name  # what llm-compressor's targets go by

        problems = []
        for index, part in enumerate(params.formats):
            taken: dict[str, int] = {}
            for number, pattern in enumerate(part.modules):
                try:
                    matched = {name: width for name, width in linear_widths.items() if match_name(name, pattern)}
                except re.error as error:
                    problems.append(
                        (f"formats[{index}].modules[{number}]", f"'{pattern}' is not a valid regex ({error})")
                    )
                    continue
                if not matched:
                    problems.append((f"formats[{index}].modules[{number}]", f"'{pattern}' matches no linear layer"))
                taken |= matched
            for field, message in PART_METHODS[part.method].check_model(part.method_params(), taken) if taken else []:
                problems.append((f"formats[{index}].params.{field}", message))
        return problems

    @staticmethod
    def rounded(params: Params) -> list[Any]:
        from llmcompressor.modifiers.quantization import QuantizationModifier

        groups = {}
        for part in params.formats:
            for modifier in PART_METHODS[part.method].rounded(part.method_params()) or []:
                for scheme in modifier.resolved_config.config_groups.values():
                    groups[f"group_{len(groups)}"] = scheme.model_copy(update={"targets": list(part.modules)})
        return [QuantizationModifier(config_groups=groups, ignore=list(params.ignore))]

    @staticmethod
    def apply(model, params: Params, calibration) -> None:
        calibrated_oneshot(model, Mixed.rounded(params), calibration)
