"""What a quantization method provides. One file per method; the registry is in __init__."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    from datasets import Dataset
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class CalibrationSet:
    """What a calibrating method runs through the model, and how many samples per forward pass."""

    samples: Dataset
    batch_size: int


class MethodParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Method:
    """The base of every method; its defaults suit a data-free method without parameters that fits any model."""

    Params: ClassVar[type[MethodParams]] = MethodParams
    needs_calibration: ClassVar[bool] = False

    @staticmethod
    def check_model(params: MethodParams, linear_widths: dict[str, int]) -> list[tuple[str, str]]:
        """(param field, message) for each way these params cannot apply to this model's layers."""
        return []

    @staticmethod
    def apply(model: PreTrainedModel, params: MethodParams, calibration: CalibrationSet | None) -> None:
        """Quantize `model` in place, ready for `save_pretrained(..., save_compressed=True)`."""
        raise NotImplementedError
