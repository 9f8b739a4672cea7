"""The `serving` section of a recipe: the server each variant is measured behind, the load guidellm puts on
it, and the service levels a load level must meet. Defaults fit the embedded 135M model on 2 CPU cores in
well under 90 s per variant; GPU users raise the token counts, the levels and the requests per level.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from quantlab.measure.settings import distinct
from quantlab.serving.engines import ENGINES

Concurrency = Annotated[int, Field(gt=0, le=100_000)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ServiceLevels(_Strict):
    """Service levels as DistServe and vLLM state them: a limit on each request's latencies, and the share of a load
    level's requests that must meet every limit (its SLO attainment, which guidellm counts request by request) for
    the level to count toward goodput."""

    ttft_ms: float = Field(2000, gt=0, description="A request's time to first token, at most, in ms.")
    itl_ms: float = Field(
        200, gt=0, description="A request's inter-token latency (its mean gap between tokens), at most, in ms."
    )
    attainment: float = Field(
        0.9,
        gt=0,
        lt=1,
        description="Share of a level's requests that must meet every limit (errored ones count as missing; those "
        "cut off by seconds_per_level do not count). Below 1: a finite sample cannot show that no request misses.",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: object) -> object:
        old = [key for key in ("ttft_p99_ms", "itl_p99_ms") if isinstance(data, dict) and key in data]
        if old:  # the old keys held a level's p99 to the limit; the limit is now each request's
            new = old[0].replace("_p99", "")
            raise ValueError(f"{old[0]} is now {new}: a limit on each request, met by a share of them (attainment)")
        return data


# A workload's name goes into metric keys and tags: no slash, no space.
WorkloadName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class Workload(_Strict):
    """A named request shape: every request of its load has `prompt_tokens` of seeded synthetic text (guidellm's
    `synthetic_text` data, as its own scenarios describe theirs) and generates exactly `output_tokens`."""

    name: WorkloadName
    prompt_tokens: int = Field(gt=0, le=1_000_000)
    output_tokens: int = Field(ge=2, le=1_000_000)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data: object) -> object:
        """A preset's name alone (`chat`, or `{name: chat}`) stands for its shape."""
        if isinstance(data, dict) and set(data) == {"name"} and isinstance(data["name"], str):
            data = data["name"]
        if not isinstance(data, str):
            return data
        if data not in WORKLOAD_PRESETS:
            known = ", ".join(WORKLOAD_PRESETS)
            raise ValueError(
                f"unknown workload preset {data!r}; known: {known} (or give name, prompt_tokens, output_tokens)"
            )
        return WORKLOAD_PRESETS[data]


# The shapes serving comparisons commonly report a quantized model's speed-up on, prompt / output tokens.
WORKLOAD_PRESETS: dict[str, dict[str, Any]] = {
    name: {"name": name, "prompt_tokens": prompt, "output_tokens": output}
    for name, prompt, output in (
        ("chat", 128, 128),
        ("prefill-heavy", 1024, 128),
        ("decode-heavy", 128, 1024),
        ("long-context", 8192, 512),
    )
}


class ServingSettings(_Strict):
    enabled: bool = Field(True, description="Serve each variant's checkpoint and drive it with guidellm.")
    engine: str = Field(
        "auto",
        description="auto: vLLM where its environment is found and a CUDA GPU is visible, else `transformers serve` "
        f"(continuous batching; on CPU it dequantizes the weights, so variants differ little there). One of: auto, "
        f"{', '.join(ENGINES)}. vLLM runs on CPU too (its CPU build: `quantlab engine install vllm --cpu`).",
    )
    python: str | None = Field(
        None,
        description="The engine's Python interpreter (vLLM lives in an environment of its own). Unset: "
        "QUANTLAB_<ENGINE>_PYTHON, else the one `quantlab engine install` made under the cache, else quantlab's own.",
    )
    max_model_len: int | None = Field(
        None,
        gt=1,
        description="The longest sequence the server accepts (vLLM's --max-model-len). Unset: the model's own, at "
        "most 4096: a served evaluation's longest request must fit.",
    )
    top_logprobs: int = Field(
        100,
        ge=1,
        le=1000,
        description="Log-probabilities per token the served token damage asks the engine for: its KL is a lower "
        "bound that tightens with them (quality/served/kld_topk_tail_mass: the baseline's probability outside them).",
    )
    plugins: list[str] = Field(
        default_factory=list,
        description="quantlab's plugins for the engine, loaded through its own extension point (vLLM's "
        "vllm.general_plugins). Each changes what the engine runs: its served figures are labelled not stock, and no "
        "cost decision rests on them. Known: "
        + "; ".join(
            f"{name} ({engine.label} on {', '.join(plugin.devices)}: {plugin.changes})"
            for engine in ENGINES.values()
            for name, plugin in engine.plugins.items()
        )
        + ".",
    )
    server_args: list[str] = Field(
        default_factory=list, description="Extra arguments for the server's command line (e.g. vLLM's --max-model-len)."
    )
    prompt_tokens: int = Field(32, gt=0, le=1_000_000, description="Prompt length of the synthetic requests.")
    output_tokens: int = Field(
        16, ge=2, le=1_000_000, description="Tokens generated per request, exactly: the server ignores end-of-text."
    )
    workloads: list[Workload] | None = Field(
        None,
        min_length=1,
        description="Named request shapes, each served at every load level with its own figures "
        "(`cost/serving/workload/<name>/...`): a preset's name ("
        + ", ".join(
            f"{name} {shape['prompt_tokens']}/{shape['output_tokens']}" for name, shape in WORKLOAD_PRESETS.items()
        )
        + " prompt/output tokens) or {name, prompt_tokens, output_tokens}. The first is the primary one: its "
        "figures are also the plain `cost/serving/...` keys that the frontier, `pick` and the decision use, and it "
        "sets prompt_tokens and output_tokens. A shape longer than the server's max_model_len is skipped, with a "
        "tag saying so. Unset: one workload of prompt_tokens and output_tokens.",
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
    requests_per_level: int = Field(
        8,
        gt=0,
        le=10_000_000,
        description="Requests measured at each load level, at least: each also sends guidellm's warm-up (its first "
        "two waves of streams, at least a quarter of what it sends), left out of every figure. A p99 needs 100.",
    )
    repeats: int = Field(
        3,
        ge=1,
        le=100,
        description="Runs of each load level, each with its own warm-up (the concurrent profile; "
        "guidellm's sweep and goodput profiles choose their levels as they go and run once). A level's throughputs, "
        "latency medians and goodput are the mean over its runs, logged with a 95% t-interval over them "
        "(`<key>/ci95_low`, `<key>/ci95_high`); its SLO attainment is counted over every request of its runs, with "
        "exact (Clopper-Pearson) bounds. requests_per_level applies to each run.",
    )
    interleave: bool = Field(
        True,
        description="Run the variants' repeats round by round: on CPU, with the local executor, each variant's server "
        "waits, up and idle, until every variant of the sweep has scored, then each round runs every level once for "
        "each variant in turn, so that a machine whose speed drifts over a sweep moves every variant alike. The "
        "decision's figures (goodput, $/Mtok, batch-1 throughputs) are then also logged round by round "
        "(`<key>/round_<n>`), and the frontier compares two variants' costs round by round. Each "
        "waiting variant keeps its process and server in memory. Otherwise (false, a GPU, which the next variant "
        "needs, Ray, the in-process executor) a variant's runs go back to back in its serve stage.",
    )
    contention_retries: int = Field(
        1,
        ge=0,
        le=10,
        description="Times a contended run of a load level is re-run (timed while other work kept the server's cores "
        "busy, or slowed while timed: its measured requests' median inter-token latency at least 1.5x its own "
        "warm-up's), each after waiting up to contention_wait_s for the cores to be quiet. A level still contended "
        "after them is logged as such (tag quantlab.serving.contended_levels) and no frontier or `pick` decides on "
        "its figures.",
    )
    contention_wait_s: float = Field(
        20,
        ge=0,
        le=3600,
        description="How long to wait for other work to leave the server's cores before re-running a contended run.",
    )
    seconds_per_level: float | None = Field(
        None,
        gt=0,
        description="Also end a level after this many seconds; requests cut off then are left out of its figures, "
        "as guidellm leaves them out.",
    )
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
    startup_timeout_s: float = Field(
        300,
        gt=0,
        description="How long the server may take to answer /health, from its start (on CPU, beside the reference stages).",
    )
    request_timeout_s: float = Field(120, gt=0, description="How long one request may take before it is an error.")

    def workload_shapes(self) -> tuple[Workload, ...]:
        """The workloads in order, the primary first; unset: the one of prompt_tokens and output_tokens."""
        if self.workloads:
            return tuple(self.workloads)
        return (Workload(name="default", prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens),)

    def skipped_workloads(self, max_model_len: int) -> dict[str, str]:
        """The named workloads longer than the server's longest sequence, each with the line that says so (the one
        shape of an unset `workloads` is served as given)."""
        return {
            w.name: f"workload {w.name} skipped: {w.prompt_tokens} + {w.output_tokens} tokens exceed the server's "
            f"longest sequence, {max_model_len} (serving.max_model_len, or the model's own)"
            for w in self.workloads or ()
            if w.tokens > max_model_len
        }

    def for_workload(self, workload: Workload) -> ServingSettings:
        """These settings with `workload`'s shape as the requests' own."""
        return self.model_copy(
            update={"prompt_tokens": workload.prompt_tokens, "output_tokens": workload.output_tokens}
        )

    @model_validator(mode="before")
    @classmethod
    def _primary_shape(cls, data: object) -> object:
        """The first workload's shape is prompt_tokens and output_tokens, which every stage that reads the primary
        shape (the batch-1 timing, the modeled ceiling) uses; a different one set beside it is refused."""
        if not isinstance(data, dict) or not isinstance(data.get("workloads"), list) or not data["workloads"]:
            return data
        try:
            first = Workload.model_validate(data["workloads"][0])
        except ValueError:
            return data  # the field's own validation names the problem
        for key in ("prompt_tokens", "output_tokens"):
            if key in data and data[key] != getattr(first, key):
                raise ValueError(
                    f"{key} ({data[key]}) differs from the first workload's ({first.name}: {getattr(first, key)}), "
                    "which sets it: leave it out"
                )
        return {**data, "prompt_tokens": first.prompt_tokens, "output_tokens": first.output_tokens}

    def runs_per_level(self) -> int:
        """Runs of each level: `repeats` where the levels are named ahead (the concurrent profile), else one."""
        return self.repeats if self.profile == "concurrent" else 1

    def single_stream_level(self) -> str | None:
        """The label of the load level that times one stream alone (levels.level_label): c1 among the concurrent
        levels, sync in guidellm's sweep; None where the load has none (the goodput search)."""
        if self.profile == "concurrent":
            return "c1" if 1 in self.concurrency else None
        return "sync" if self.profile == "sweep" else None

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, engine: str) -> str:
        if engine != "auto" and engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; known: auto, {', '.join(ENGINES)}")
        return engine

    @field_validator("concurrency")
    @classmethod
    def _distinct(cls, levels: list[int]) -> list[int]:
        return sorted(distinct(levels, "concurrency levels"))

    @field_validator("workloads")
    @classmethod
    def _distinct_workloads(cls, workloads: list[Workload] | None) -> list[Workload] | None:
        if workloads is not None:
            distinct([workload.name for workload in workloads], "workload names")
        return workloads

    @field_validator("plugins")
    @classmethod
    def _known_plugins(cls, plugins: list[str], info: ValidationInfo) -> list[str]:
        named = info.data.get("engine", "auto")  # absent when the engine itself was refused
        engines = list(ENGINES.values()) if named not in ENGINES else [ENGINES[named]]
        known = {name for engine in engines for name in engine.plugins}
        for name in distinct(plugins, "plugins"):
            if name not in known:
                which = ENGINES[named].label if named in ENGINES else "any engine"
                raise ValueError(f"{name!r} is no plugin of {which}; known: {', '.join(sorted(known)) or 'none'}")
        return plugins
