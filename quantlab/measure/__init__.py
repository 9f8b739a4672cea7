"""The cost of a variant: `measure_cost` (measured in its own process, plus modeled), `modeled_cost` (from a
config and checkpoint alone) and `MeasureSettings` (the recipe's `measure` section).

Submodules import torch: these names load lazily so that importing the settings (as the recipe does) stays cheap.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {"measure_cost": "cost", "modeled_cost": "modeled", "MeasureSettings": "settings"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'quantlab.measure' has no attribute {name!r}")
    return getattr(import_module(f"quantlab.measure.{_EXPORTS[name]}"), name)
