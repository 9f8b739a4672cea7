"""A variant's full resolved configuration as flat MLflow params: what exactly produced these numbers."""

from __future__ import annotations

from importlib.metadata import version
from typing import TYPE_CHECKING

from quantlab.cache import library_versions
from quantlab.measure.provenance import hardware
from quantlab.quantize import METHODS

if TYPE_CHECKING:
    import torch

    from quantlab.models import ModelSource
    from quantlab.recipe import LoadedRecipe, VariantSpec


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
        "versions": library_versions() | {"lm-eval": version("lm_eval"), "mlflow": version("mlflow")},
        "hardware": hardware(),
    }
    return flatten("", resolved)


def flatten(prefix: str, value: object) -> dict[str, str]:
    """Nested config -> dotted MLflow params ({"a": {"b": 1}} -> {"a.b": "1"}); a list of mappings by index."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(item, dict) for item in value):
        value = dict(enumerate(value))
    if not isinstance(value, dict):
        return {prefix: str(value)}
    flat: dict[str, str] = {}
    for key, item in value.items():
        flat.update(flatten(f"{prefix}.{key}" if prefix else str(key), item))
    return flat
