"""The cost of a variant: measured in its own process, and modeled for a target accelerator.

- `measure_cost(model, tokenizer, settings, checkpoint_dir, load_seconds)` -> `CostReport`
  (`to_metrics()`, `to_tags()`): throughput, latency, memory, energy, roofline efficiency,
  each with the engine, kernel path and hardware that produced it, plus the modeled figures.
- `modeled_cost(config, checkpoint_dir, settings)` -> `ModeledCost`: weight bytes, bits per
  weight, KV cache per token, capacity, roofline and dollars, without loading a model.
- `MeasureSettings`: the recipe's `measure` section; `BUILTIN_ACCELERATORS`: the table.

Submodules import torch; this package's names load lazily so that importing the settings
(as the recipe does) stays cheap.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_EXPORTS = {
    "measure_cost": "quantlab.measure.cost",
    "loaded_weight_bytes": "quantlab.measure.cost",
    "CostReport": "quantlab.measure.report",
    "MeasuredCost": "quantlab.measure.report",
    "BatchFigures": "quantlab.measure.report",
    "modeled_cost": "quantlab.measure.modeled",
    "ModeledCost": "quantlab.measure.modeled",
    "ModelShape": "quantlab.measure.modeled",
    "MeasureSettings": "quantlab.measure.settings",
    "TargetSettings": "quantlab.measure.settings",
    "AcceleratorSpec": "quantlab.measure.accelerators",
    "BUILTIN_ACCELERATORS": "quantlab.measure.accelerators",
    "kernel_path": "quantlab.measure.kernels",
    "Provenance": "quantlab.measure.provenance",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'quantlab.measure' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
