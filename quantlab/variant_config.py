"""A variant's full resolved configuration as flat MLflow params: what exactly produced these numbers."""

from __future__ import annotations

import os
import platform
from typing import TYPE_CHECKING

from quantlab.cache import library_versions
from quantlab.quantize import METHODS

if TYPE_CHECKING:
    import torch

    from quantlab.models import ModelSource
    from quantlab.recipe import LoadedRecipe, VariantSpec


def hardware() -> dict[str, str]:
    import torch

    found = {"cpu": platform.processor() or platform.machine(), "cpu_count": str(os.cpu_count())}
    if torch.cuda.is_available():
        found["gpu"] = torch.cuda.get_device_name(0)
        found["gpu_count"] = str(torch.cuda.device_count())
    else:
        found["gpu"] = "none"
    return found


def variant_params(
    loaded: LoadedRecipe, variant: VariantSpec, source: ModelSource, device: str, dtype: torch.dtype
) -> dict[str, str]:
    recipe = loaded.recipe
    method = METHODS[variant.method]
    resolved = {
        "variant": {"name": variant.name, "method": variant.method, "params": variant.params.model_dump()},
        "model": {**recipe.model.model_dump(), "identity": source.identity},
        "calibration": recipe.calibration.model_dump() if method.needs_calibration else "not used",
        "evals": recipe.evals.model_dump(),
        "quality": recipe.quality.model_dump(),
        "measure": recipe.measure.model_dump(),
        "runtime": {"device": device, "compute_dtype": str(dtype).removeprefix("torch.")},
        "versions": library_versions() | {"lm-eval": _version("lm_eval"), "mlflow": _version("mlflow")},
        "hardware": hardware(),
    }
    return flatten("", resolved)


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def flatten(prefix: str, value: object) -> dict[str, str]:
    """Nested config -> dotted MLflow params ({"a": {"b": 1}} -> {"a.b": "1"})."""
    if isinstance(value, dict):
        flat: dict[str, str] = {}
        for key, item in value.items():
            flat.update(flatten(f"{prefix}.{key}" if prefix else str(key), item))
        return flat
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, dict) for item in value):
        flat = {}
        for index, item in enumerate(value):
            flat.update(flatten(f"{prefix}.{index}", item))
        return flat
    return {prefix: str(value)}
