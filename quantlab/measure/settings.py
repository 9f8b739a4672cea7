"""The `measure` section of a recipe: what to time, and the accelerator to model serving on. Defaults suit
the embedded 135M model on 2 CPU cores; GPU users raise `batch_sizes`, `prompt_tokens` and `output_tokens`."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from quantlab.measure.accelerators import AcceleratorSpec, find_accelerator

_GIB = 1024**3
_MIB = 1024**2

BatchSize = Annotated[int, Field(gt=0, le=65_536)]
KvCacheDtype = Literal["auto", "bfloat16", "float16", "float32", "fp8"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TargetSettings(_Strict):
    """The accelerator the modeled figures (capacity, roofline, dollars) are computed for."""

    accelerator: str = Field("H100-SXM", description="A name from the accelerator table (built-in or `accelerators`).")
    price_per_hour: float | None = Field(
        None, gt=0, description="USD per accelerator-hour; without it the dollar figure is left out."
    )
    context_length: int = Field(
        4096, gt=0, le=10_000_000, description="Tokens (prompt + output) each served sequence holds in KV cache."
    )
    memory_bytes: int | None = Field(None, gt=0, description="Overrides the table's memory capacity.")
    bandwidth_bytes_per_s: float | None = Field(None, gt=0, description="Overrides the table's bandwidth.")
    memory_utilization: float = Field(
        0.9, gt=0, le=1, description="Share of device memory a server may use (vLLM's gpu_memory_utilization)."
    )
    runtime_overhead_bytes: int = Field(
        1 * _GIB, ge=0, description="Held back for CUDA context, activations and allocator slack."
    )
    kv_cache_dtype: KvCacheDtype = Field(
        "auto", description="auto = the checkpoint's KV cache scheme if it declares one, else its dtype."
    )


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
    repeats: int = Field(3, gt=0, le=10_000, description="Timed generations per batch size; medians are reported.")
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
        repeated = sorted({size for size in batch_sizes if batch_sizes.count(size) > 1})
        if repeated:
            raise ValueError(f"batch sizes must be distinct; repeated: {repeated}")
        return batch_sizes

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
