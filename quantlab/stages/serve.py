"""The runner's serving stages: the variant's checkpoint behind its engine's real server (`VariantServer`), which
the served evaluation, the served token damage and the load stage (`serve_load`) all use, one server per variant.

`serve_load` puts guidellm's load on it and returns `cost/serving/*` metrics, `served.*` params (what served it:
engine, version, interpreter, command line, the kernels it chose, hardware, price; the recipe's section is
`serving.*`), tags for what is absent, and artifacts (guidellm's report, the throughput-latency chart).
The measure stage's copy bandwidth and weight sizes give the modeled ceiling the measured peak is set against.
Where the load has a single-stream level, it is the variant's batch-1 timing (`single_stream`): the measure stage
leaves that batch size to it, and this stage logs its `cost/decode_tokens_per_s` and TTFT and ITL medians. Whatever
the profile, it says whether other work competed for the cores while guidellm ran (quantlab.cost.contended): each run
of a level is judged over its own window, a contended one is re-run once the cores are quiet (serving.contention_*),
and a level still contended is named (quantlab.serving.contended_levels) so that no decision rests on it.
The server's and guidellm's logs go beside the variant's own log, kept as artifacts whether the stage succeeds or
fails.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib.metadata import PackageNotFoundError, version
from operator import attrgetter
from pathlib import Path
from typing import TYPE_CHECKING

from quantlab.errors import first_line
from quantlab.host_share import visible_cores
from quantlab.jobs import side_log
from quantlab.measure.contention import (
    CONTENDED_TAG,
    CONTENTION_TAG,
    Contention,
    LoadMonitor,
    LoadSampler,
    combined,
    judge_contention,
    judge_slowdown,
    wait_until_quiet,
)
from quantlab.measure.cost import TAG_PREFIX as COST_TAG_PREFIX
from quantlab.measure.cost import SingleStream, batch_figure_name
from quantlab.measure.modeled import (
    ModelShape,
    config_dict,
    declared_kv_cache_dtype,
    kv_cache_bytes_per_token,
    kv_cache_element_bytes,
)
from quantlab.measure.provenance import cpu_model_name
from quantlab.metrics import SINGLE_STREAM_FIGURES_TAG
from quantlab.serving.chart import throughput_latency_chart
from quantlab.serving.engines import Engine, Launch, Support
from quantlab.serving.engines.base import shown_command
from quantlab.serving.environments import chosen_engine, ensure_engine, installed_version, python_problem
from quantlab.serving.goodput import (
    NOT_STOCK_TAG,
    SERVING_TAG,
    UNAVAILABLE_TAG,
    WORKLOADS_TAG,
    ServingSummary,
    summarize,
)
from quantlab.serving.intervals import interval_of, pooled, runs_by_level
from quantlab.serving.launcher import RunningServer, ServerFailed, launched_server, wait_healthy
from quantlab.serving.levels import LoadLevel, load_levels
from quantlab.serving.load import LoadGenerator, scenario, warm_up
from quantlab.serving.pricing import fastest_prefill, modeled_served_tokens_per_s, serving_price
from quantlab.serving.settings import ServingSettings

if TYPE_CHECKING:
    import torch

    from quantlab.measure.contention import LoadReading
    from quantlab.measure.settings import MeasureSettings
    from quantlab.recipe import Recipe

REPORT_ARTIFACT = "serving/guidellm.json"  # every round's levels in one report, in the order they ran
CHART_ARTIFACT = "serving/throughput_latency.png"


@dataclass(frozen=True)
class Turns:
    """How the load's runs take turns with the sweep's other variants. `take()` waits for this variant's next turn
    and holds it for the block (and the host's timing lock: nothing else of the host's quantlab variants runs
    meanwhile). `interleaved`: each level's serving.repeats run as that many rounds, one turn each, so that the sweep's
    other variants' rounds run between them and a machine that changes speed over the minutes of a sweep moves every
    variant's figures alike (quantlab.executors.LocalExecutor's parked variants); otherwise a level's runs go back to
    back in one turn."""

    take: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext
    # once the last turn's load is done, before its figures: until every variant's is (their finishing would compete
    # with a timed round)
    served: Callable[[], None] = lambda: None
    interleaved: bool = False


@dataclass(frozen=True)
class ServingOutcome:
    metrics: dict[str, float] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    artifacts: dict[str, str | bytes] = field(default_factory=dict)

    def __or__(self, other: ServingOutcome) -> ServingOutcome:
        return ServingOutcome(
            self.metrics | other.metrics,
            self.params | other.params,
            self.tags | other.tags,
            self.artifacts | other.artifacts,
        )


CACHE_BLOCK_TOKENS = 32
MAX_DEFAULT_MODEL_LEN = 4096  # the longest sequence a served evaluation needs by default; the KV cache is sized for it


@dataclass(frozen=True)
class ServedVariant:
    """A variant's checkpoint behind its engine's running server, and what started it."""

    variant: str
    engine: Engine
    python: Path
    launch: Launch
    server: RunningServer
    stored_format: str | None
    support: Support
    kernels: dict[str, str]  # layer type -> the kernel the engine chose (from its log)
    command: str  # as a shell would read it, with the variables it was started with
    hardware: str
    gpu_name: str | None
    load: LoadGenerator | None  # guidellm, started (None: serving.enabled is false)
    engine_origin: str  # where its environment came from on this machine (found, configured, installed on a node)

    @property
    def checkpoint(self) -> Path:
        return self.launch.checkpoint

    def params(self) -> dict[str, str]:
        engine_version = installed_version(str(self.python), self.engine.distributions)
        found = {
            "served.engine": self.engine.name,
            "served.engine_version": engine_version,
            "served.python": str(self.python),
            "served.engine_environment": self.engine_origin,
            "served.command": self.command,
            "served.hardware": self.hardware,
            "served.expected_kernel": self.support.kernel,
            "served.kv_cache_dtype": self.engine.kv_cache_served(self.launch),
        }
        if build := self.engine.builds.get(engine_version.partition("==")[0]):
            found["served.engine_build"] = build
        found |= {f"served.kernel.{layer}": kernel for layer, kernel in sorted(self.kernels.items())}
        if self.support.note:
            found["served.kernel_note"] = self.support.note
        if self.support.served_as:
            found["served.served_as"] = self.support.served_as
        if plugins := self.plugins():
            found["served.plugins"] = plugins
        return found

    def plugins(self) -> str:
        """quantlab's plugins this server loaded, each with its digest and what it changes; "" for the stock engine."""
        chosen = [self.engine.plugins[name] for name in self.launch.plugins]
        return "; ".join(f"{plugin.identity()}, not stock {self.engine.label}: {plugin.changes}" for plugin in chosen)

    def tags(self) -> dict[str, str]:
        kernel = "; ".join(f"{kernel} for {layer}" for layer, kernel in sorted(self.kernels.items()))
        # transformers reports its kernels by declaration (it logs none); vLLM names none for unquantized layers
        if not kernel and self.stored_format is not None and self.engine.reports_kernels:
            kernel = f"not reported by the engine (declared: {self.support.kernel})"
        found = {SERVING_TAG + "engine": self.engine.name, SERVING_TAG + "kernel": kernel or self.support.kernel}
        if self.support.served_as:
            found[SERVING_TAG + "served_as"] = self.support.served_as
        if self.launch.plugins:
            found[NOT_STOCK_TAG] = ", ".join(self.launch.plugins)
        return found


@dataclass(frozen=True)
class _Launched:
    """A server started for the variant, perhaps not healthy yet, and what started it."""

    engine: Engine
    python: Path
    engine_origin: str
    launch: Launch
    support: Support
    environment: dict[str, str]
    server: RunningServer


class VariantServer:
    """One variant's server across the stages that use it, stopped (with every process it started) on exit.

    `launch_early()` starts it where the host can hold its copy of the model beside the variant's own (CPU): its
    start, mostly imports and loading, then runs while the reference stages score the variant. On a GPU the variant's
    model must be dropped first (the server sizes its memory from what is free), so it starts at `ready()`.
    The load generator (guidellm, when serving is on) starts early on any device: its import needs no accelerator.
    Where the load needs a server other than the scoring one (vLLM: prefix caching on), on CPU the load's server starts
    early beside the scoring one; the scoring server is stopped before the load's levels are timed.
    `ready()` waits until it is healthy and says what it serves (None when no stage needs a server)."""

    def __init__(
        self,
        checkpoint: Path,
        variant: str,
        stored_format: str | None,
        recipe: Recipe,
        device: str,
        dtype: torch.dtype,
        cache_root: Path,
        log_dir: Path | None,
        node: str | None = None,
    ) -> None:
        """`node`: the cluster node it runs on (VariantJob.node), which installs the engine where it lacks it."""
        self.checkpoint, self.variant, self.stored_format, self.recipe = checkpoint, variant, stored_format, recipe
        self.device, self.dtype, self.cache_root, self.log_dir, self.node = device, dtype, cache_root, log_dir, node
        self._scope = contextlib.ExitStack()  # the load generator, for the variant's life
        self._server_scope = contextlib.ExitStack()  # the server now running, with its scratch folder
        self._launched: _Launched | None = None
        self._standby_scope = contextlib.ExitStack()  # the load's server, starting while the scoring one serves
        self._standby: _Launched | None = None
        self._served: ServedVariant | None = None
        self._scored_on: ServedVariant | None = None
        self._load: LoadGenerator | None = None

    def __enter__(self) -> VariantServer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        # A server that died while a stage used it shows there as a refused connection: the variant fails with the
        # server's own end (its exit and its log's tail) instead, read before stopping it rewrites the exit code.
        died = None
        if isinstance(error, Exception) and not isinstance(error, ServerFailed) and self._launched is not None:
            died = self._launched.server.died()
        with self._scope, self._standby_scope:
            self._server_scope.close()
        if died is not None:
            first, *tail = died.splitlines()
            last = next((line.strip() for line in reversed(tail) if line.strip()), "")
            seen = f"(the stage saw {type(error).__name__}: {first_line(error)})"
            raise ServerFailed("\n".join([f"{first} {last}".strip(), *tail, seen])) from error

    def launch_early(self) -> None:
        if self.device == "cpu" and self.recipe.needs_server and self._launched is None:
            self._launch(self._scores, self._server_scope)
            self._start_standby()
        if self.recipe.serving.enabled:
            self._load_generator().start()

    def wait_if_launched(self) -> None:
        """Healthy, and guidellm imported, before anything is timed: either still starting would compete with it."""
        if self._launched is not None:
            self.ready(scoring=self._launched.launch.scoring)
        if self._standby is not None:
            wait_healthy(self._standby.server, self.recipe.serving.startup_timeout_s)
        if self._load is not None:
            self._load.wait_imported(self.recipe.serving.startup_timeout_s)

    def ready(self, scoring: bool) -> ServedVariant | None:
        """The server, healthy, started to score (`scoring`: prefix caching off, batch-invariant kernels where the
        engine has them) or to serve the load with the engine's defaults. A running server started the other way is
        stopped and started again where the engine's command differs; with no load to serve, the scoring server
        stays for what the serve stage reports."""
        if not self.recipe.needs_server:
            return None
        scoring = scoring and self._scores
        if not scoring and not self.recipe.serving.enabled and self._served is not None:
            return self._served
        launched = self._launched
        if (
            launched is not None
            and launched.launch.scoring != scoring
            and _scoring_differs(launched.engine, launched.launch)
        ):
            self._stop_server()
            if self._standby is not None:  # the load's server, started while the scoring one served
                self._server_scope, self._standby_scope = self._standby_scope, contextlib.ExitStack()
                self._launched, self._standby = self._standby, None
        if self._served is None:
            launched = self._launched or self._launch(scoring, self._server_scope)
            server, engine, launch = launched.server, launched.engine, launched.launch
            wait_healthy(server, self.recipe.serving.startup_timeout_s)
            gpu_name = _gpu_name(self.device)
            self._served = ServedVariant(
                self.variant,
                engine,
                launched.python,
                _with_port(launch, server.port),
                server,
                self.stored_format,
                launched.support,
                engine.kernels(server.log_path.read_text(errors="replace"), self.stored_format, self.device),
                shown_command(server.command, launched.environment),
                gpu_name or f"CPU: {cpu_model_name()}, {launch.threads} of {visible_cores()} cores",
                gpu_name,
                self._load_generator() if self.recipe.serving.enabled else None,
                launched.engine_origin,
            )
            if launch.scoring:
                self._scored_on = self._served
        return self._served

    def _start_standby(self) -> None:
        """On CPU, where the load needs a server started otherwise than the scoring one, start it beside that one:
        `ready(scoring=False)` then only waits for it. Not on a GPU, whose memory each server sizes from what is free."""
        launched = self._launched
        if (
            self.device == "cpu"
            and self.recipe.serving.enabled
            and self.recipe.serving.port is None  # one fixed port: one server at a time
            and self._standby is None
            and launched is not None
            and _scoring_differs(launched.engine, launched.launch)
        ):
            self._standby = self._launch(False, self._standby_scope)

    def scoring_params(self) -> dict[str, str]:
        """`served.scoring.*`: the server the variant was scored through, and what kept its answers deterministic
        (nothing when no stage scored through a server)."""
        scored = self._scored_on
        if scored is None or not scored.engine.scores_prompts:  # an engine that cannot score is only served
            return {}
        found = {"command": scored.command, **scored.engine.scoring_params(scored.launch)}
        return {f"served.scoring.{name}": value for name, value in found.items()}

    @property
    def _scores(self) -> bool:
        """Whether a stage scores through the server: the served evaluation, or the served token damage."""
        return self.recipe.evals.engine != "reference" or self.recipe.quality.enabled

    def _stop_server(self) -> None:
        self._server_scope.close()
        self._server_scope = contextlib.ExitStack()
        self._launched = self._served = None

    def _load_generator(self) -> LoadGenerator:
        if self._load is None:
            scratch = Path(
                self._scope.enter_context(tempfile.TemporaryDirectory(prefix=f"quantlab-load-{self.variant}-"))
            )
            log = side_log(self.log_dir or scratch, self.variant, "guidellm")
            self._load = self._scope.enter_context(LoadGenerator(scratch, log, _workers(self.device)))
        return self._load

    def _launch(self, scoring: bool, scope: contextlib.ExitStack) -> _Launched:
        """Start a server in `scope` (it stops with it); the variant's current one unless `scope` is the standby's."""
        import torch

        settings, device = self.recipe.serving, self.device
        gc.collect()  # a caller that dropped its model: free its memory before the server loads its own copy
        if device == "cuda":
            torch.cuda.empty_cache()
        engine = chosen_engine(settings, device, self.cache_root)
        found = ensure_engine(engine, settings.python, self.cache_root, device, self.node, _say)
        python = found.python
        if (problem := python_problem(engine, python)) is not None:
            raise RuntimeError(f"serving.python: {problem}")
        support = engine.supports(self.stored_format, device)
        if support is None:
            raise RuntimeError(
                f"serving.engine: {engine.label} cannot serve {self.stored_format} checkpoints on {device}"
                + (f": {why}" if (why := engine.why_not(self.stored_format, device)) else "")
            )
        shape = ModelShape.from_config(config_dict(self.checkpoint / "config.json"))
        engine_dtype = engine.compute_dtype(str(self.dtype).removeprefix("torch."))
        threads = torch.get_num_threads()
        launch = server_launch(self.checkpoint, settings, self.recipe, shape, device, engine_dtype, threads)
        kv_cache = declared_kv_cache_dtype(self.checkpoint / "config.json")
        launch = replace(launch, scoring=scoring, kv_cache_dtype=kv_cache)
        if engine.kv_cache_served(launch) == kv_cache:  # stored as declared: its own bytes per element
            element = kv_cache_element_bytes(self.checkpoint / "config.json", kv_cache)
            launch = replace(launch, kv_bytes_per_token=int(kv_cache_bytes_per_token(shape, element)))
        environment = engine.environment(launch)
        scratch = scope.enter_context(tempfile.TemporaryDirectory(prefix=f"quantlab-serve-{self.variant}-"))
        process = "scoring-server" if scoring and _scoring_differs(engine, launch) else "server"
        server_log = side_log(self.log_dir or Path(scratch), self.variant, process)

        def command_for(port: int) -> list[str]:
            return engine.command(python, _with_port(launch, port))

        server = scope.enter_context(
            launched_server(
                command_for, engine.name, server_log, {**os.environ, **environment, **_QUIET}, settings.port
            )
        )
        launched = _Launched(engine, python, found.origin, launch, support, environment, server)
        if scope is self._server_scope:
            self._launched = launched
        return launched


def _scoring_differs(engine: Engine, launch: Launch) -> bool:
    """Whether `engine` starts a scoring server other than a serving one (vLLM: prefix caching off, kernels)."""
    scoring, serving = replace(launch, scoring=True), replace(launch, scoring=False)
    python = Path("python")  # the same in both: only the arguments are compared
    return engine.command(python, scoring) != engine.command(python, serving) or engine.environment(
        scoring
    ) != engine.environment(serving)


def _say(line: str) -> None:
    print(f"quantlab: {line}", file=sys.stderr, flush=True)  # the variant's log, beside the stages' own lines


def _gpu_name(device: str) -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if device == "cuda" else None


# The server reads the local checkpoint only, and writes its log as it goes.
_QUIET = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def served_max_model_len(checkpoint: Path, settings: ServingSettings) -> int:
    """The longest request the variant's server accepts: the recipe's, else the model's own up to
    MAX_DEFAULT_MODEL_LEN. The evaluate stage reads it before the server starts, to score in process as it will."""
    positions = int(config_dict(checkpoint / "config.json").get("max_position_embeddings") or MAX_DEFAULT_MODEL_LEN)
    return settings.max_model_len or min(positions, MAX_DEFAULT_MODEL_LEN)


def server_launch(
    checkpoint: Path,
    settings: ServingSettings,
    recipe: Recipe,
    shape: ModelShape,
    device: str,
    dtype: str,
    threads: int,
) -> Launch:
    """How the variant's server is started: sized for the load's streams and the served evaluation's requests."""
    import torch

    max_model_len = served_max_model_len(checkpoint, settings)
    streams = max(max(settings.concurrency), settings.requests_per_level if settings.profile == "sweep" else 0)
    # sized for the longest workload the server takes: every workload runs on this one server
    skipped = settings.skipped_workloads(max_model_len)
    taken = [w for w in settings.workload_shapes() if w.name not in skipped]
    longest = max((w.tokens for w in taken), default=0)
    per_stream = (-(-longest // CACHE_BLOCK_TOKENS) + 1) * CACHE_BLOCK_TOKENS
    tokens = streams * per_stream if settings.enabled else 0
    if recipe.evals.engine != "reference":
        tokens = max(tokens, recipe.evals.served_concurrency * max_model_len)
    element = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    per_token = int(kv_cache_bytes_per_token(shape, element))
    if device == "cuda":
        free = torch.cuda.mem_get_info()[0]
        tokens = kv_tokens_that_fit(tokens, per_token, free, checkpoint_bytes(checkpoint), max_model_len)
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return Launch(
        checkpoint=checkpoint,
        port=0,
        device=device,
        dtype=dtype,
        threads=threads,
        bind_cpus=tuple(cores[:threads]) if threads >= len(cores) else (),  # a whole host's share binds its cores
        gpus=max(1, round(recipe.runtime.gpus)) if device == "cuda" else 0,
        kv_cache_tokens=tokens,
        kv_bytes_per_token=per_token,
        batch_tokens=max(512, max((w.prompt_tokens for w in taken), default=0) + streams),
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization(*torch.cuda.mem_get_info()) if device == "cuda" else None,
        top_logprobs=settings.top_logprobs,
        extra=tuple(settings.server_args),
        plugins=tuple(settings.plugins),
    )


def checkpoint_bytes(checkpoint: Path) -> int:
    return sum(path.stat().st_size for path in checkpoint.glob("*.safetensors"))


def kv_tokens_that_fit(
    tokens: int, bytes_per_token: int, free_bytes: int, weight_bytes: int, longest: int, share: float = 0.8
) -> int:
    """`tokens` of KV cache, or fewer where they would not fit beside the weights in `share` of the GPU's free
    memory (the rest for activations): a long workload at many streams asks for more than a GPU holds, and the
    engine then queues requests, which the load's latencies show, instead of failing to start. Never fewer than
    one sequence of `longest` tokens, the least the engine starts with."""
    room = int((free_bytes - weight_bytes) * share) // max(bytes_per_token, 1)
    return max(min(tokens, room), longest)


def gpu_memory_utilization(free_bytes: int, total_bytes: int, margin: float = 0.05) -> float:
    """The share of the GPU vLLM may take: what is free now less a margin. vLLM's own default (most of the GPU) fails
    its start-up check when anything else is resident, e.g. the variant's own process, which holds a CUDA context."""
    return max(0.05, round(free_bytes / total_bytes - margin, 3))


def _with_port(launch: Launch, port: int) -> Launch:
    return replace(launch, port=port)


def single_stream(serving: ServingSettings, measure: MeasureSettings) -> SingleStream | None:
    """Batch size 1 as the serve stage times it, where it does (None: the measure stage times it): serving on, a
    single-stream level in the load (c1, or the sweep profile's synchronous level), batch size 1 among those the
    measure stage would time."""
    level = serving.single_stream_level()
    if not (serving.enabled and measure.enabled and level is not None and 1 in measure.batch_sizes):
        return None
    return SingleStream(level, serving.prompt_tokens, serving.output_tokens)


def serve_load(
    served: ServedVariant | None,
    settings: ServingSettings,
    measure: MeasureSettings,
    recipe_dir: Path,
    dtype: torch.dtype,
    cost_metrics: dict[str, float],
    log_dir: Path | None,
    stream: SingleStream | None = None,
    turns: Turns = Turns(),
) -> ServingOutcome:
    """guidellm's load on the running server, summarized; with what served it (the server's own facts). `stream`:
    the batch-1 figures are this stage's to log (`single_stream`), from its level. `turns`: when its runs go (each
    workload's rounds, one turn each)."""
    if served is None:
        return ServingOutcome(tags={UNAVAILABLE_TAG + "serving": "serving.enabled is false in the recipe"})
    facts = ServingOutcome(params=served.params(), tags=served.tags())
    if not settings.enabled or served.load is None:
        return facts | ServingOutcome(tags={UNAVAILABLE_TAG + "serving": "serving.enabled is false in the recipe"})
    prompts = (recipe_dir / settings.prompts).resolve() if settings.prompts else None
    skipped = settings.skipped_workloads(served.launch.max_model_len)
    named = settings.workloads is not None
    outcome, verdicts = facts, []
    if named:
        shapes = [workload.model_dump() for workload in settings.workload_shapes()]
        outcome |= ServingOutcome(tags={WORKLOADS_TAG: json.dumps(shapes)})
    last = next((w.name for w in reversed(settings.workload_shapes()) if w.name not in skipped), None)
    for index, workload in enumerate(settings.workload_shapes()):
        if workload.name in skipped:
            _say(f"{served.variant}: {skipped[workload.name]}")
            outcome |= ServingOutcome(tags=_skipped_tags(workload.name, skipped[workload.name], primary=index == 0))
            continue
        found = _serve_workload(
            served,
            served.load,  # started early; one guidellm runs every workload's rounds and re-runs
            settings.for_workload(workload),
            measure,
            prompts,
            dtype,
            cost_metrics,
            stream if index == 0 else None,
            workload.name if named else None,
            turns if workload.name == last else replace(turns, served=lambda: None),
        )
        verdicts.append((workload.name, found.verdict))
        if index == 0:
            outcome |= found.single_stream | found.figures
        if named:
            outcome |= found.scoped(workload.name, artifacts=index != 0)
    if log_dir is None:  # no sweep log directory to keep it: it travels with the result
        outcome |= ServingOutcome(artifacts={"logs/server.log": served.server.log_path.read_text(errors="replace")})
    return outcome | ServingOutcome(tags=_load_verdict(verdicts, named))


def _skipped_tags(name: str, why: str, primary: bool) -> dict[str, str]:
    found = {UNAVAILABLE_TAG + f"workload/{name}": why}
    if primary:  # the plain keys are the primary workload's: say why the decision has none
        found |= {UNAVAILABLE_TAG + figure: why for figure in ("goodput", "usd_per_mtok")}
    return found


def _load_verdict(verdicts: list[tuple[str, Contention]], named: bool) -> dict[str, str]:
    """Whether other work competed with any workload's load (each named where there are several)."""
    if not verdicts:
        return {}
    contended = any(verdict.contended for _, verdict in verdicts)
    shown = [verdict.reason if not named else f"workload {name}: {verdict.reason}" for name, verdict in verdicts]
    return {CONTENDED_TAG: str(contended).lower(), CONTENTION_TAG: "; ".join(shown)}


WORKLOAD_KEY = "workload/"  # cost/serving/workload/<name>/<figure>, and the tags alike
# What the server is, not what one workload measured: tagged once.
_SERVER_TAGS = frozenset({SERVING_TAG + "engine", SERVING_TAG + "goodput_definition"})


@dataclass(frozen=True)
class _WorkloadLoad:
    """One workload's load on the server: its `cost/serving/*` figures (plain keys), the batch-1 figures where it
    timed them, and whether other work competed with it."""

    figures: ServingOutcome
    single_stream: ServingOutcome
    verdict: Contention

    def scoped(self, name: str, artifacts: bool) -> ServingOutcome:
        """Its figures under keys that name the workload: cost/serving/workload/<name>/..., its tags alike."""
        prefix = f"cost/serving/{WORKLOAD_KEY}{name}/"
        metrics = {
            prefix + key.removeprefix("cost/serving/"): value
            for key, value in self.figures.metrics.items()
            if key.startswith("cost/serving/")
        }
        tags = {SERVING_TAG + f"{WORKLOAD_KEY}{name}/contention": self.verdict.reason}
        for tag, value in self.figures.tags.items():
            if tag.startswith(UNAVAILABLE_TAG):
                tags[UNAVAILABLE_TAG + f"{WORKLOAD_KEY}{name}/" + tag.removeprefix(UNAVAILABLE_TAG)] = value
            elif tag.startswith(SERVING_TAG) and tag not in _SERVER_TAGS:
                tags[SERVING_TAG + f"{WORKLOAD_KEY}{name}/" + tag.removeprefix(SERVING_TAG)] = value
        shown = {
            f"serving/{WORKLOAD_KEY}{name}/" + key.removeprefix("serving/"): value
            for key, value in self.figures.artifacts.items()
            if artifacts and key.startswith("serving/")
        }
        return ServingOutcome(metrics=metrics, tags=tags, artifacts=shown)


def _serve_workload(
    served: ServedVariant,
    load_generator: LoadGenerator,
    settings: ServingSettings,
    measure: MeasureSettings,
    prompts: Path | None,
    dtype: torch.dtype,
    cost_metrics: dict[str, float],
    stream: SingleStream | None,
    workload: str | None,
    turns: Turns,
) -> _WorkloadLoad:
    """guidellm's load of one request shape (`settings`' prompt and output tokens) at every level, in rounds where the
    turns are interleaved (each level once a round), its contended runs re-run in the last turn, summarized."""
    interleaved = turns.interleaved and settings.runs_per_level() > 1
    rounds = settings.runs_per_level() if interleaved else 1
    each_round = list(settings.concurrency) if interleaved else None  # None: each level's every run, back to back
    per_run = settings.requests_per_level * settings.request_timeout_s
    runs_a_round = len(settings.concurrency) * settings.runs_per_level() // rounds
    budget = max(runs_a_round, settings.levels) * per_run + 300
    sampler = LoadSampler(served.launch.threads)  # each run's own reading, from guidellm's windows
    reports, readings, runs = [], [], []
    for round_number in range(1, rounds + 1):
        with turns.take():
            if round_number == 1:  # later rounds' first requests are guidellm's own warm-up, left out of every figure
                warm_up(served.server, served.checkpoint, settings)
            spec = scenario(
                settings,
                served.engine.name,
                served.server.url,
                served.checkpoint,
                prompts,
                load_generator.report_path,
                each_round,
            )
            with LoadMonitor(served.launch.threads, tree=True) as load:  # the server and guidellm are the stage's own
                sampler.sample()
                reports.append(load_generator.run(spec, served.server, budget, on_poll=sampler.sample))
                sampler.sample()
            readings.append(load.reading)
            runs += load_levels(reports[-1])
            if round_number == rounds:
                retaken = _retake_contended(
                    runs, sampler, combined(readings), served, load_generator, settings, prompts, per_run + 300
                )
    turns.served()
    merged = {**reports[0], "benchmarks": [benchmark for report in reports for benchmark in report["benchmarks"]]}
    artifacts: dict[str, str | bytes] = {REPORT_ARTIFACT: json.dumps(merged, indent=2)}
    artifacts |= retaken.artifacts
    runs = list(retaken.runs)
    _check_output_lengths(runs, settings)
    levels = [pooled(each) for each in runs_by_level(runs).values()]
    timed = _single_stream_outcome(
        runs, stream, measure.batch_sizes[0], cost_metrics, combined(readings), in_rounds=interleaved
    )
    shape = ModelShape.from_config(config_dict(served.checkpoint / "config.json"))
    peak = max(levels, key=lambda level: level.output_tokens_per_s)
    summary = summarize(
        runs,
        settings.slo,
        serving_price(settings, measure, served.gpu_name, served.launch.threads),
        _modeled(shape, served.engine, cost_metrics | timed.metrics, dtype, settings, peak),
        retaken.contended,
        in_rounds=interleaved,
    )
    shape_words = f"{settings.prompt_tokens} prompt + {settings.output_tokens} output tokens"
    title = f"{served.variant}: {served.engine.label}, {f'{workload}, ' if workload else ''}{shape_words}"
    artifacts[CHART_ARTIFACT] = throughput_latency_chart({served.variant: levels}, title, settings.slo)
    figures = ServingOutcome(
        metrics=summary.to_metrics(),
        params=_load_params(summary),
        tags=summary.to_tags(served.engine.name),
        artifacts=artifacts,
    )
    return _WorkloadLoad(figures, timed, retaken.verdict)


@dataclass(frozen=True)
class _Retaken:
    """The load's runs once contended ones were re-run where the cores went quiet, and what still competed."""

    runs: tuple[LoadLevel, ...]
    contended: dict[str, str]  # level -> why (its first run still contended)
    verdict: Contention  # the load's, for the run's contention tag
    artifacts: dict[str, str | bytes]


def _run_verdicts(runs: list[LoadLevel], sampler: LoadSampler) -> list[Contention | None]:
    """Each run judged over its own window (CPU time alone: seconds are too short for the 1-minute load average), and
    by its own pace (measured against its warm-up's, where no other process was busy); None where guidellm's report
    gives no window or the samples do not cover it."""
    verdicts: list[Contention | None] = []
    for run in runs:
        reading = (
            None if run.started_at is None or run.ended_at is None else sampler.between(run.started_at, run.ended_at)
        )
        verdict = None if reading is None else judge_contention(reading, load_average=False)
        if verdict is not None and not verdict.contended:
            verdict = judge_slowdown(run.itl_ms_p50, run.warm_up_itl_ms) or verdict
        verdicts.append(verdict)
    return verdicts


def _retake_contended(
    runs: list[LoadLevel],
    sampler: LoadSampler,
    whole: LoadReading,
    served: ServedVariant,
    load_generator: LoadGenerator,
    settings: ServingSettings,
    prompts: Path | None,
    budget_per_run: float,
) -> _Retaken:
    """Contended runs (other work competed, or the run slowed while timed), re-run (a level's runs can be named again
    in the concurrent profile only) up to serving.contention_retries times, each once the cores have been quiet for a
    moment (waiting at most serving.contention_wait_s); what is still contended after that is named, not dropped."""
    verdicts = _run_verdicts(runs, sampler)
    if any(verdict is None for verdict in verdicts):  # no per-run windows: the whole load's verdict, for each run
        overall = judge_contention(whole)
        verdicts = [overall] * len(runs)
    artifacts: dict[str, str | bytes] = {}
    retakes = 0
    while settings.profile == "concurrent" and retakes < settings.contention_retries:
        again = [index for index, verdict in enumerate(verdicts) if verdict is not None and verdict.contended]
        if not again or wait_until_quiet(served.launch.threads, settings.contention_wait_s) is None:
            break
        retakes += 1
        causes = ", ".join(dict.fromkeys(found.cause for found in (verdicts[index] for index in again) if found))
        _say(f"{served.variant}: re-running {', '.join(runs[index].label for index in again)}: {causes}")
        new_runs, new_verdicts, report = _run_again(
            [runs[index] for index in again], served, load_generator, settings, prompts, budget_per_run, sampler
        )
        artifacts[f"serving/guidellm-retake-{retakes}.json"] = report
        for index, run, verdict in zip(again, new_runs, new_verdicts):
            runs[index], verdicts[index] = run, verdict
    contended: dict[str, str] = {}
    for run, verdict in zip(runs, verdicts):
        if verdict is not None and verdict.contended:
            contended.setdefault(run.label, verdict.reason)
    after = f" after {retakes} re-run{'s' * (retakes != 1)}" if retakes else ""
    if contended:
        words = "; ".join(f"{label}: {why.removeprefix('contended: ')}" for label, why in contended.items())
        verdict = Contention(True, f"contended: load level {words}{after}")
    elif all(verdict is not None for verdict in verdicts):
        verdict = Contention(False, f"not contended: no level's runs competed with other work{after}")
    else:
        verdict = judge_contention(whole)
    return _Retaken(tuple(runs), contended, verdict, artifacts)


def _run_again(
    runs: list[LoadLevel],
    served: ServedVariant,
    load_generator: LoadGenerator,
    settings: ServingSettings,
    prompts: Path | None,
    budget_per_run: float,
    sampler: LoadSampler,
) -> tuple[list[LoadLevel], list[Contention | None], str]:
    """The runs' levels run again, in the same order."""
    streams = [int(run.label.removeprefix("c")) for run in runs]
    url, report_path = served.server.url, load_generator.report_path
    spec = scenario(settings, served.engine.name, url, served.checkpoint, prompts, report_path, streams)
    report = load_generator.run(spec, served.server, budget_per_run * len(runs), on_poll=sampler.sample)
    sampler.sample()
    found = load_levels(report)
    text = json.dumps(report)
    if [run.label for run in found] != [run.label for run in runs]:
        raise RuntimeError(f"guidellm re-ran {[run.label for run in found]}, not {[run.label for run in runs]}")
    return found, _run_verdicts(found, sampler), text


def _single_stream_outcome(
    runs: list[LoadLevel],
    stream: SingleStream | None,
    default_batch_size: int,
    cost_metrics: dict[str, float],
    load: LoadReading,
    in_rounds: bool = False,
) -> ServingOutcome:
    """The batch-1 figures from the single-stream level, each under its `cost/` name (or why it is absent), and what
    else kept the cores busy meanwhile; nothing when the measure stage timed batch size 1 itself. `in_rounds`: the
    level's runs went in rounds across the sweep's variants, and its throughputs are also logged round by round."""
    if stream is None:
        return ServingOutcome()
    level_runs = runs_by_level(runs).get(stream.level)
    if level_runs is None:
        raise RuntimeError(f"guidellm's report has no {stream.level} level: batch size 1 was not timed")
    level = pooled(level_runs)

    def named(name: str) -> str:
        return batch_figure_name(name, 1, default_batch_size)

    roofline = cost_metrics.get(f"cost/{named('local_roofline_decode_tokens_per_s')}")
    figures = stream.figures(level.ttft_ms_p50, level.itl_ms_p50, roofline)
    found = {f"cost/{named(name)}": value for name, value in figures.items() if math.isfinite(value)}
    latencies = (interval_of(level_runs, attrgetter(name)) for name in ("ttft_ms_p50", "itl_ms_p50"))
    ends: dict[str, float] = {}
    for name, interval in stream.intervals(*latencies).items():
        if (key := f"cost/{named(name)}") in found:
            ends |= interval.ends(key) | (interval.rounds(key) if in_rounds else {})
    why = f"the {stream.level} level timed no request's latencies ({level.succeeded} succeeded, {level.errors} errors)"
    absent = {
        f"{COST_TAG_PREFIX}unavailable.{named(name)}": why
        for name, value in figures.items()
        if not math.isfinite(value)
    }
    # which figures rest on that level: none decides where it stayed contended (quantlab.metrics.rests_on_contention)
    rests_on = {SINGLE_STREAM_FIGURES_TAG: f"{stream.level}: {', '.join(sorted(found))}"} if found else {}
    return ServingOutcome(metrics=found | ends | load.to_metrics("measure/serve/"), tags=absent | rests_on)


def _workers(device: str) -> int | None:
    return 1 if device == "cpu" else None


def _check_output_lengths(levels: list[LoadLevel], settings: ServingSettings) -> None:
    """Variants are compared at the same output length: a server that stopped early would look faster."""
    short = [level for level in levels if level.succeeded and level.output_tokens_min < settings.output_tokens]
    if short:
        found = ", ".join(f"{level.label}: {level.output_tokens_min:.0f}" for level in short)
        raise RuntimeError(
            f"the server returned outputs shorter than serving.output_tokens ({settings.output_tokens}) - shortest "
            f"per level: {found}; throughputs would not compare across variants"
        )


def _modeled(
    shape: ModelShape,
    engine: Engine,
    cost_metrics: dict[str, float],
    dtype: torch.dtype,
    settings: ServingSettings,
    peak: LoadLevel,
) -> float | None:
    """The prefill + decode ceiling of the peak level on this hardware (`modeled_served_tokens_per_s`): the measure
    stage's copy bandwidth and prefill rate, and the weights
    as the engine holds them (transformers: as loaded here, dequantized on CPU; vLLM: the stored payload)."""
    import torch

    bandwidth = cost_metrics.get("cost/measured_bandwidth_bytes_per_s")
    weights = cost_metrics.get(engine.weights_metric)
    if not bandwidth or not weights:
        return None
    element = torch.empty((), dtype=dtype).element_size()
    prefill, prompt, output = fastest_prefill(cost_metrics), settings.prompt_tokens, settings.output_tokens
    return modeled_served_tokens_per_s(shape, weights, element, bandwidth, prefill, prompt, output, peak.concurrency)


def _load_params(summary: ServingSummary) -> dict[str, str]:
    found = {
        "served.guidellm_version": _version("guidellm"),
        "served.levels": json.dumps([level.label for level in summary.levels]),
    }
    if summary.price is not None:
        found |= {
            "served.price_per_hour": f"{summary.price.usd_per_hour:.6g}",
            "served.price_source": summary.price.source,
        }
    return found


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"
