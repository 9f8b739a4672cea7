"""A new engine is one file beside the others (quantlab/serving/engines/) plus one line in the registry (ENGINES):
shown with a test engine, stock `transformers serve` that declares unquantized checkpoints only. Registered with that
one line, the recipe check knows it by name and refuses what it cannot serve, and a real sweep serves through it."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import pytest
from test_executors import RecordingDisplay
from tiny import save_tiny_llama

from quantlab import tracking
from quantlab.checks import validate
from quantlab.errors import BadInput
from quantlab.serving.engines import ENGINES, Launch, Support
from quantlab.serving.engines.base import HOST, Formats
from quantlab.serving.engines.transformers_serve import STOCK_ENTRY, TransformersServe
from quantlab.sweep import SweepOptions, run_sweep
from recipes import tiny_recipe, write


class StockTransformersServe(TransformersServe):
    """The test engine: what a new engine's file holds (its name, what it serves with which kernel, its command)."""

    name: ClassVar[str] = "stock-transformers"
    label: ClassVar[str] = "stock transformers serve"
    formats: ClassVar[Formats] = {None: {"cpu": Support("torch linear (unquantized)")}}

    def command(self, python: Path, launch: Launch) -> list[str]:
        command = [str(python), "-m", STOCK_ENTRY, "serve", str(launch.checkpoint), "--continuous-batching"]
        command += ["--host", HOST, "--port", str(launch.port), "--device", launch.device]
        return [*command, "--dtype", launch.dtype, *launch.extra]

    def supports(self, stored_format: str | None, device: str) -> Support | None:
        return self.formats.get(stored_format, {}).get(device)  # what it declares, nothing else


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(ENGINES, StockTransformersServe.name, StockTransformersServe())  # the one line


SERVING = {
    "engine": "stock-transformers",
    "concurrency": [1],
    "requests_per_level": 2,
    "repeats": 1,
    "prompt_tokens": 8,
    "output_tokens": 4,
    "slo": {"ttft_ms": 60_000, "itl_ms": 10_000},
}


def _recipe(tmp_path, model, variants) -> Path:
    recipe = tiny_recipe(model, variants=variants, serving=SERVING, quality={"enabled": False})
    recipe["evals"]["tasks"] = [{"name": "mmlu_dev", "limit": 2}]
    return write(tmp_path / "recipe.yaml", recipe)


def test_an_engine_is_known_by_its_registry_line_and_refuses_what_it_does_not_declare(
    tmp_path, tiny_llama, monkeypatch
):
    variants = [{"name": "bf16", "method": "bf16"}, {"name": "fp8", "method": "fp8"}]
    path = _recipe(tmp_path, tiny_llama.path, variants)
    with pytest.raises(BadInput) as unknown:
        validate(path, tmp_path / "cache")
    assert any(p.field == "serving.engine" and "stock-transformers" in p.message for p in unknown.value.problems)

    monkeypatch.setitem(ENGINES, StockTransformersServe.name, StockTransformersServe())
    with pytest.raises(BadInput) as refused:
        validate(path, tmp_path / "cache")
    [problem] = refused.value.problems
    assert (problem.field, problem.message) == (
        "serving.engine",
        "variant fp8: stock transformers serve cannot serve FP8_DYNAMIC checkpoints on cpu",
    )


def test_a_sweep_serves_through_a_registered_engine(tmp_path, registered):
    model = save_tiny_llama(tmp_path / "model")
    loaded = validate(_recipe(tmp_path, model, [{"name": "bf16", "method": "bf16"}]), tmp_path / "cache")
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    outcome = run_sweep(loaded, SweepOptions(uri, tmp_path / "cache", "inprocess"), RecordingDisplay())
    assert outcome.exit_code == 0, outcome.failures

    store = tracking.open_store(uri)
    [run] = tracking.child_runs(store, tracking.latest_sweep(store, "tiny").run_id)
    assert run.status == "FINISHED"
    assert run.params["served.engine"] == "stock-transformers"
    assert f"-m {STOCK_ENTRY} serve" in run.params["served.command"]
    assert run.metrics["cost/serving/c1/output_tokens_per_s"] > 0 and run.metrics["cost/serving/c1/errors"] == 0
