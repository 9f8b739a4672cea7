"""The `serving` section of a recipe: the server each variant is measured behind, the load guidellm puts on
it, and the service levels a load level must meet. Defaults fit the embedded 135M model on 2 CPU cores in
well under 90 s per variant; GPU users raise the token counts, the levels and the requests per level.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantlab.measure.settings import distinct

Concurrency = Annotated[int, Field(gt=0, le=100_000)]
ENGINES = ("transformers", "vllm")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServiceLevels(_Strict):
    """What a load level must meet to count for goodput: p99s over its successful requests, no error."""

    ttft_p99_ms: float = Field(2000, gt=0, description="Time to first token, 99th percentile, in ms.")
    itl_p99_ms: float = Field(200, gt=0, description="Inter-token latency (per-request mean), 99th percentile, ms.")


class ServingSettings(_Strict):
    enabled: bool = Field(True, description="Serve each variant's checkpoint and drive it with guidellm.")
    engine: Literal["auto", "transformers", "vllm"] = Field(
        "auto",
        description="auto: vLLM where it is installed and a CUDA GPU is visible, else `transformers serve` "
        "(continuous batching; on CPU it dequantizes the weights, so variants differ little there).",
    )
    server_args: list[str] = Field(
        default_factory=list, description="Extra arguments for the server's command line (e.g. vLLM's --max-model-len)."
    )
    prompt_tokens: int = Field(32, gt=0, le=1_000_000, description="Prompt length of the synthetic requests.")
    output_tokens: int = Field(
        16, ge=2, le=1_000_000, description="Tokens generated per request, exactly: the server ignores end-of-text."
    )
    prompts: str | None = Field(
        None,
        description="A file of prompts instead of seeded synthetic text (relative to the recipe): .txt, one per "
        "line, or .csv / .json / .jsonl with a `prompt` or `text` column.",
    )
    seed: int = Field(0, description="Seeds the synthetic prompts.")
    profile: Literal["concurrent", "sweep", "goodput"] = Field(
        "concurrent",
        description="concurrent: one level per `concurrency` entry; sweep: guidellm's synchronous, throughput and "
        "constant-rate levels (`levels` of them); goodput: guidellm's search for the most streams meeting `slo`.",
    )
    concurrency: list[Concurrency] = Field(
        default_factory=lambda: [1, 4], min_length=1, description="Concurrent streams of each load level."
    )
    levels: int = Field(5, ge=2, le=100, description="Load levels of the sweep profile.")
    requests_per_level: int = Field(8, gt=0, le=10_000_000, description="Requests measured at each load level.")
    seconds_per_level: float | None = Field(None, gt=0, description="Also end a level after this many seconds.")
    slo: ServiceLevels = Field(default_factory=ServiceLevels)
    price_per_hour: float | None = Field(
        None,
        gt=0,
        description="USD per hour of the machine serving; unset: measure.target.price_per_hour when serving on that "
        "accelerator, else the accelerator table's price of the GPU found, else the CPU price per core-hour.",
    )
    port: int | None = Field(
        None, ge=1024, le=65535, description="The server's loopback port; unset: a free one for each variant."
    )
    startup_timeout_s: float = Field(300, gt=0, description="How long the server may take to answer /health.")
    request_timeout_s: float = Field(120, gt=0, description="How long one request may take before it is an error.")

    @field_validator("concurrency")
    @classmethod
    def _distinct(cls, levels: list[int]) -> list[int]:
        return sorted(distinct(levels, "concurrency levels"))
