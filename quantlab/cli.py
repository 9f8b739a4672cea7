"""quantlab's command line: the only module that prints or exits.

Exit codes: 0 every variant succeeded; 1 at least one variant failed (the others are logged);
2 bad input (recipe, flags, unreachable tracking server), found before any work.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from quantlab.errors import BadInput

app = typer.Typer(
    help="Which precision should we ship? Quantize a model's variants, score them, measure their cost, "
    "log everything to MLflow, and pick one.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
out = Console()
err = Console(stderr=True)

TrackingUri = Annotated[
    Optional[str],
    typer.Option("--tracking-uri", help="MLflow tracking URI. Default: $MLFLOW_TRACKING_URI, else sqlite:///mlruns/mlflow.db (artifacts under mlruns/)."),
]


def _fail_on_bad_input(error: BadInput) -> None:
    for problem in error.problems:
        err.print(f"[bold red]error:[/] {problem}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


class _RichSweepDisplay:
    """Live progress: which variant, which stage, how long."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.task = None
        self.order: list[str] = []
        self.started = 0.0

    def sweep_started(self, experiment: str, run_id: str, variants: list[str]) -> None:
        self.order = variants
        out.print(f"Sweep of [bold]{experiment}[/]: {len(variants)} variants ({', '.join(variants)}); MLflow run {run_id}")
        self.task = self.progress.add_task("starting", total=len(variants))

    def stage(self, variant: str, stage: str) -> None:
        index = self.order.index(variant) + 1
        if stage == "prepare model":
            self.started = time.perf_counter()
        self.progress.update(self.task, description=f"[{index}/{len(self.order)}] [bold]{variant}[/]: {stage}")

    def variant_finished(self, variant: str, result, failure: str | None) -> None:
        self.progress.advance(self.task)
        if failure:
            self.progress.console.print(f"[red]✗[/] {variant} failed: {failure}", highlight=False)
            return
        seconds = ", ".join(f"{stage} {value:.0f}s" for stage, value in result.stage_seconds.items())
        reused = " (checkpoint reused)" if result.reused_checkpoint else ""
        self.progress.console.print(f"[green]✓[/] {variant}{reused}: {seconds}", highlight=False)


@app.command()
def sweep(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML, e.g. recipes/smollm2-135m.yaml.")],
    tracking_uri: TrackingUri = None,
    executor: Annotated[str, typer.Option(help="local: one spawned process per variant. ray: one Ray task per variant.")] = "local",
    ray_address: Annotated[Optional[str], typer.Option(help="Ray cluster address (with --executor ray); default starts a local cluster.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Recompute checkpoints even when the cache holds them.")] = False,
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Run only this variant (repeatable); the baseline always runs as the reference.")] = None,
    cache_dir: Annotated[Optional[Path], typer.Option(help="Checkpoint cache. Default: $QUANTLAB_CACHE_DIR or ~/.cache/quantlab.")] = None,
) -> None:
    """Quantize, evaluate, measure and log every variant of RECIPE; then publish the frontier."""
    from quantlab.recipe import validate
    from quantlab.sweep import SweepOptions, default_cache_root, run_sweep
    from quantlab.tracking import open_store, tracking_uri as resolve_uri

    try:
        if executor not in ("local", "ray"):
            raise BadInput([_flag_problem("--executor", f"'{executor}' is not one of: local, ray")])
        loaded = validate(recipe)
        uri = resolve_uri(tracking_uri)
        open_store(uri)
        options = SweepOptions(
            tracking_uri=uri, cache_root=(cache_dir or default_cache_root()).resolve(), executor=executor,  # type: ignore[arg-type]
            force=force, only=tuple(only or ()), ray_address=ray_address,
        )
        columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
        with Progress(*columns, console=out, transient=False) as progress:
            outcome = run_sweep(loaded, options, _RichSweepDisplay(progress))
    except BadInput as error:
        _fail_on_bad_input(error)
        return
    failed = ", ".join(outcome.failures)
    out.print(f"Logged to {uri}, experiment '{loaded.recipe.name}', parent run {outcome.parent_run_id}."
              + (f" [red]Failed: {failed}[/]" if failed else ""))
    raise typer.Exit(outcome.exit_code)


@app.command("validate")
def validate_command(recipe: Annotated[Path, typer.Argument(help="Recipe YAML to check.")]) -> None:
    """Check RECIPE the way a sweep would before any work (model config, group sizes, tasks); run nothing."""
    from quantlab.recipe import validate

    try:
        loaded = validate(recipe)
    except BadInput as error:
        _fail_on_bad_input(error)
        return
    names = ", ".join(f"{variant.name} ({variant.method})" for variant in loaded.recipe.variants)
    out.print(f"{recipe}: OK - {len(loaded.recipe.variants)} variants: {names}", highlight=False)


@app.command()
def ui(
    port: Annotated[int, typer.Option(help="Port for the MLflow UI.")] = 5000,
    host: Annotated[str, typer.Option(help="Interface to bind. Anything but 127.0.0.1 exposes your runs to the network.")] = "127.0.0.1",
    tracking_uri: TrackingUri = None,
) -> None:
    """Serve the MLflow UI on the project's store and print the address of the runs table."""
    import signal
    import subprocess

    from quantlab.tracking import open_store, tracking_uri as resolve_uri, ui_addresses

    uri = resolve_uri(tracking_uri)
    try:
        store = open_store(uri)
    except BadInput as error:
        _fail_on_bad_input(error)
        return
    command = [sys.executable, "-m", "mlflow", "ui", "--backend-store-uri", uri, "--host", host, "--port", str(port)]
    # mlflow ui starts helper processes: a session of its own lets us stop them all together.
    server = subprocess.Popen(command, start_new_session=True)
    for name, address in ui_addresses(store, host, port):
        out.print(f"{name}: {address}", highlight=False)
    out.print("Press Ctrl-C to stop.")
    try:
        raise typer.Exit(server.wait())
    except KeyboardInterrupt:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def _flag_problem(flag: str, message: str):
    from quantlab.errors import Problem

    return Problem(flag, "", message)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
