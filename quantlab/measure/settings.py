"""The `measure` section of a recipe: what to time, and the accelerator to model serving on. Defaults suit
the embedded 135M model on 2 CPU cores; GPU users raise `batch_sizes`, `prompt_tokens` and `output_tokens`.

The accelerator table: datasheet "GB" and "TB/s" are taken as 10^9 B and 10^12 B/s, conservative (an "80 GB" H100
shows 81,559 MiB). A recipe's `measure.accelerators` extends or overrides it; names match regardless of case,
spaces, dashes or underscores ("h100 sxm" finds "H100-SXM").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from quantlab.errors import did_you_mean

_GIB = 1024**3
_MIB = 1024**2

BatchSize = Annotated[int, Field(gt=0, le=65_536)]
KvCacheDtype = Literal["auto", "bfloat16", "float16", "float32", "fp8"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AcceleratorSpec(_Strict):
    """What the modeled figures need to know about one accelerator."""

    memory_bytes: int = Field(gt=0, description="Device memory in bytes (datasheet capacity).")
    bandwidth_bytes_per_s: float = Field(gt=0, description="Peak device-memory bandwidth in bytes/s.")
    source: str = Field("set in the recipe", description="Where the figures come from.")


def _spec(memory_gb: float, tb_per_s: float, source: str) -> AcceleratorSpec:
    return AcceleratorSpec(memory_bytes=int(memory_gb * 1e9), bandwidth_bytes_per_s=tb_per_s * 1e12, source=source)


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


Distinct = TypeVar("Distinct", int, str)


def distinct(values: list[Distinct], what: str) -> list[Distinct]:
    """`values` unchanged; ValueError naming the repeated ones (a pydantic field validator's message)."""
    repeated = sorted({value for value in values if values.count(value) > 1})
    if repeated:
        raise ValueError(f"{what} must be distinct; repeated: {repeated}")
    return values


def normalized_name(name: str) -> str:
    return re.sub(r"[\s_\-]", "", name).lower()


def accelerator_table(overrides: Mapping[str, AcceleratorSpec] | None = None) -> dict[str, AcceleratorSpec]:
    """The built-in table with a recipe's entries added; an entry with a built-in's name replaces it."""
    replaced = {normalized_name(name) for name in overrides or {}}
    kept = {name: spec for name, spec in BUILTIN_ACCELERATORS.items() if normalized_name(name) not in replaced}
    return {**kept, **(overrides or {})}


def find_accelerator(name: str, overrides: Mapping[str, AcceleratorSpec] | None = None) -> tuple[str, AcceleratorSpec]:
    """The table's own spelling of `name` and its spec; ValueError, with a suggestion, when absent."""
    table = accelerator_table(overrides)
    for known, spec in table.items():
        if normalized_name(known) == normalized_name(name):
            return known, spec
    hint = did_you_mean(name, table, cutoff=0.5)
    raise ValueError(f"unknown accelerator {name!r}{hint}; known: {', '.join(sorted(table))}")


class TargetSettings(_Strict):
    """The accelerator the modeled figures (capacity, roofline, dollars) are computed for."""

    accelerator: str = Field("H100-SXM", description="A name from the accelerator table (built-in or `accelerators`).")
    price_per_hour: float | None = Field(None, gt=0, description="USD per accelerator-hour; else no dollar figure.")
    context_length: int = Field(
        4096, gt=0, le=10_000_000, description="Tokens (prompt + output) each served sequence holds in KV cache."
    )
    memory_bytes: int | None = Field(None, gt=0, description="Overrides the table's memory capacity.")
    bandwidth_bytes_per_s: float | None = Field(None, gt=0, description="Overrides the table's bandwidth.")
    memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of device memory a server may use (vLLM's gpu_memory_utilization)."
    )
    runtime_overhead_bytes: int = Field(_GIB, ge=0, description="CUDA context, activations and allocator slack.")
    kv_cache_dtype: KvCacheDtype = Field("auto", description="auto: the checkpoint's KV cache scheme, else its dtype.")


class MeasureSettings(_Strict):
    enabled: bool = True
    batch_sizes: list[BatchSize] = Field(
        default_factory=lambda: [1],
        min_length=1,
        description="The first is the default: its figures get the plain metric keys, the others a _bs<N> suffix.",
    )
    prompt_tokens: int = Field(128, gt=0, le=1_000_000)
    output_tokens: int = Field(32, ge=2, le=1_000_000, description="At least 2: one prefill token, one decode step.")
    warmup: int = Field(1, ge=0, le=1_000, description="Untimed generations per batch size before the repeats.")
    repeats: int = Field(
        3,
        gt=0,
        le=10_000,
        description="Timed generations per batch size: throughputs are their means, with 95% t intervals from 2 on.",
    )
    seed: int = Field(0, description="Seeds the random prompt token ids.")
    cpu_threads: int | None = Field(
        None,
        gt=0,
        le=4096,
        description="torch intra-op threads while measuring; None keeps the process's setting. On a shared "
        "machine fewer threads than cores can be faster and steadier: a busy core stalls every worker thread.",
    )
    bandwidth_probe_bytes: int = Field(
        256 * _MIB, gt=0, le=64 * _GIB, description="Size of the tensor copied to measure memory bandwidth."
    )
    bandwidth_probe_repeats: int = Field(5, gt=0, le=1_000)
    # Declared before `target` so that validating `target` can see the recipe's own entries.
    accelerators: dict[str, AcceleratorSpec] = Field(
        default_factory=dict, description="Adds to or overrides the built-in accelerator table."
    )
    target: TargetSettings = Field(default_factory=TargetSettings)

    @field_validator("batch_sizes")
    @classmethod
    def _distinct(cls, batch_sizes: list[int]) -> list[int]:
        return distinct(batch_sizes, "batch sizes")

    @field_validator("target")
    @classmethod
    def _known_accelerator(cls, target: TargetSettings, info: ValidationInfo) -> TargetSettings:
        try:
            find_accelerator(target.accelerator, info.data.get("accelerators"))
        except ValueError as error:
            raise ValueError(f"accelerator: {error}") from None
        return target

    def target_accelerator(self) -> tuple[str, AcceleratorSpec]:
        """The target's table entry with the target's own memory/bandwidth overrides applied."""
        name, spec = find_accelerator(self.target.accelerator, self.accelerators)
        changes = self.target.model_dump(include={"memory_bytes", "bandwidth_bytes_per_s"}, exclude_none=True)
        if changes:
            spec = spec.model_copy(
                update={**changes, "source": f"{spec.source}; overridden in the recipe: {sorted(changes)}"}
            )
        return name, spec
