"""The accelerators a variant can be modeled on: datasheet memory and bandwidth, with sources.

Datasheet "GB" and "TB/s" are taken as 10^9 B and 10^12 B/s: conservative (an "80 GB" H100 shows 81,559 MiB).
A recipe's `measure.accelerators` extends or overrides the table; names match regardless of case, spaces,
dashes or underscores ("h100 sxm" finds "H100-SXM").
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

_GB = 10**9
_TB = 10**12


class AcceleratorSpec(BaseModel):
    """What the modeled figures need to know about one accelerator."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    memory_bytes: int = Field(gt=0, description="Device memory in bytes (datasheet capacity).")
    bandwidth_bytes_per_s: float = Field(gt=0, description="Peak device-memory bandwidth in bytes/s.")
    source: str = Field("set in the recipe", description="Where the figures come from.")


def _spec(memory_gb: float, bandwidth_tb_s: float, source: str) -> AcceleratorSpec:
    return AcceleratorSpec(memory_bytes=int(memory_gb * _GB), bandwidth_bytes_per_s=bandwidth_tb_s * _TB, source=source)


BUILTIN_ACCELERATORS: Mapping[str, AcceleratorSpec] = {
    "H100-SXM": _spec(80, 3.35, "NVIDIA H100 Tensor Core GPU datasheet (SXM5): 80 GB HBM3, 3.35 TB/s"),
    "H100-PCIe": _spec(80, 2.0, "NVIDIA H100 Tensor Core GPU datasheet (PCIe): 80 GB HBM2e, 2 TB/s"),
    "H100-NVL": _spec(94, 3.9, "NVIDIA H100 Tensor Core GPU datasheet (NVL, per GPU): 94 GB HBM3, 3.9 TB/s"),
    "H200": _spec(141, 4.8, "NVIDIA H200 Tensor Core GPU datasheet (SXM): 141 GB HBM3e, 4.8 TB/s"),
    "B200": _spec(180, 8.0, "NVIDIA HGX B200 specifications, per GPU: 180 GB HBM3e, 8 TB/s"),
    "A100-80GB": _spec(80, 2.039, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 80 GB HBM2e, 2,039 GB/s"),
    "A100-80GB-PCIe": _spec(80, 1.935, "NVIDIA A100 Tensor Core GPU datasheet (80GB PCIe): 80 GB HBM2e, 1,935 GB/s"),
    "A100-40GB": _spec(40, 1.555, "NVIDIA A100 Tensor Core GPU datasheet (40GB): 40 GB HBM2, 1,555 GB/s"),
    "L40S": _spec(48, 0.864, "NVIDIA L40S datasheet: 48 GB GDDR6, 864 GB/s"),
    "L4": _spec(24, 0.300, "NVIDIA L4 Tensor Core GPU datasheet: 24 GB GDDR6, 300 GB/s"),
    "A10G": _spec(24, 0.600, "AWS EC2 G5 (NVIDIA A10G): 24 GB GDDR6, 600 GB/s, as the NVIDIA A10 datasheet"),
    "A10": _spec(24, 0.600, "NVIDIA A10 Tensor Core GPU datasheet: 24 GB GDDR6, 600 GB/s"),
    "T4": _spec(16, 0.320, "NVIDIA T4 Tensor Core GPU datasheet: 16 GB GDDR6, 320 GB/s"),
    "RTX-4090": _spec(24, 1.008, "NVIDIA GeForce RTX 4090 specifications: 24 GB GDDR6X, 1,008 GB/s"),
    "MI300X": _spec(192, 5.3, "AMD Instinct MI300X datasheet: 192 GB HBM3, 5.3 TB/s"),
    "MI325X": _spec(256, 6.0, "AMD Instinct MI325X datasheet: 256 GB HBM3E, 6 TB/s"),
}


def _normalized(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name).lower()


def accelerator_table(overrides: Mapping[str, AcceleratorSpec] | None = None) -> dict[str, AcceleratorSpec]:
    """The built-in table with a recipe's entries added; an entry with a built-in's name replaces it."""
    replaced = {_normalized(name) for name in overrides or {}}
    kept = {name: spec for name, spec in BUILTIN_ACCELERATORS.items() if _normalized(name) not in replaced}
    return {**kept, **(overrides or {})}


def find_accelerator(name: str, overrides: Mapping[str, AcceleratorSpec] | None = None) -> tuple[str, AcceleratorSpec]:
    """The table's own spelling of `name` and its spec; ValueError, with a suggestion, when absent."""
    table = accelerator_table(overrides)
    for known, spec in table.items():
        if _normalized(known) == _normalized(name):
            return known, spec
    close = difflib.get_close_matches(name, list(table), n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ValueError(f"unknown accelerator {name!r}; {hint}known: {', '.join(sorted(table))}")
