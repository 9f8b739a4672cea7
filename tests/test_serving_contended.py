"""A contended figure never decides, for real: the tiny Llama served by `transformers serve` under guidellm's load while
a CPU-bound process this test starts keeps one of the cores busy. A run found contended is re-run once the process
is gone; a load that stays contended is logged as such, and the frontier and `pick` leave it out, each in one line.
(The serve stage in this process, not a whole sweep: a sweep's thread share may leave the server a core the process
can take without competing, and its other stages would not be what is tested.)"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch

from quantlab.decision import pick
from quantlab.frontier import Axis, AxisPair, VariantSummary, pareto_front
from quantlab.measure.settings import MeasureSettings
from quantlab.metrics import rests_on_contention
from quantlab.policy import Policy
from quantlab.recipe import Recipe
from quantlab.serving.load import LoadGenerator
from quantlab.serving.settings import ServingSettings
from quantlab.stages.serve import VariantServer, serve_load
from recipes import REPO, tiny_recipe

KLD = "quality/kld_mean"

# Busy on one core until a file matching argv[1] exists (argv[1] empty: until stopped).
HOG = """
import glob, sys, time
while not (sys.argv[1] and glob.glob(sys.argv[1])):
    end = time.process_time() + 0.2
    while time.process_time() < end:
        pass
"""

LIGHT = ServingSettings(
    prompt_tokens=16,
    output_tokens=8,
    concurrency=[1],
    requests_per_level=2,
    repeats=2,
    slo={"ttft_ms": 60_000, "itl_ms": 10_000},  # the figures are what is checked, not this machine's speed
)


def _hog(until: str = "") -> psutil.Process:
    """The competing process, outside this process's tree: the serve stage counts its descendants' CPU time as its
    own work (its server, its load generator), so a child of the test would never be other work. Started by a shell
    that exits at once, it is reparented away."""
    command = '"$0" -c "$1" "$2" >/dev/null 2>&1 & echo $!'
    started = subprocess.run(
        ["sh", "-c", command, sys.executable, HOG, until], capture_output=True, text=True, check=True
    )
    return psutil.Process(int(started.stdout))


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    """The tiny Llama's server, healthy, for both loads below (each with a guidellm of its own)."""
    work = tmp_path_factory.mktemp("contended")
    recipe = Recipe.model_validate(tiny_recipe(tiny_llama.path, serving=LIGHT.model_dump()))
    variant = f"contended{os.getpid()}"  # names its loads' scratch folders, where guidellm writes its reports
    with VariantServer(tiny_llama.path, variant, None, recipe, "cpu", torch.float32, work, work) as running:
        yield running.ready(scoring=False), work


def _load_under(server, settings: ServingSettings, until: str) -> tuple:
    """serve_load with a guidellm of its own while the process competes (`until`: a report that stops it)."""
    served, work = server
    scratch = Path(tempfile.mkdtemp(prefix="load-", dir=work))
    with LoadGenerator(scratch, scratch / "guidellm.log", 1) as load:
        load.start()
        load.wait_imported(120)  # its import is not the load: the process competes with the load alone
        hog = _hog(until=str(load.report_path) if until else "")  # the first run's report
        try:
            return serve_load(replace(served, load=load), settings, MeasureSettings(), REPO, torch.float32, {}, work)
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):
                hog.kill()
                hog.wait(30)


def _decision_lines(outcome) -> tuple[list[str], list[str]]:
    """What `quantlab frontier` and `quantlab pick` say of a variant that logged the outcome, beside a baseline."""
    usd = "cost/serving/usd_per_mtok"
    served = VariantSummary("fp8", "fp8", True, outcome.metrics | {KLD: 0.01}, outcome.tags)
    baseline = VariantSummary("bf16", "bf16", True, {KLD: 0.0, usd: 1e6}, is_baseline=True)
    front = pareto_front([baseline, served], AxisPair(Axis(KLD, False), Axis(usd, False)))
    decision = pick([baseline, served], "bf16", Policy(max_drop_any_task=None), Axis(usd, False))
    excluded = [f"left out {e.name}: {e.reason}" for e in front.excluded]
    return excluded, [line for line in decision.warnings if "left out of the decision" in line]


def test_a_load_still_contended_after_the_wait_is_logged_and_decides_nothing(server):
    """The process competes throughout, the wait for quiet cores included: each run stays contended, its figures are
    logged as such, and the frontier and the choice leave them out, each saying so in one line."""
    settings = LIGHT.model_copy(update={"contention_retries": 1, "contention_wait_s": 2})
    outcome = _load_under(server, settings, until="")
    tags = outcome.tags
    assert tags["quantlab.serving.contended_levels"] == "c1", tags["quantlab.cost.contention"]
    assert tags["quantlab.cost_contended"] == "true"
    assert tags["quantlab.serving.contention.c1"].startswith("contended: other processes kept")
    assert outcome.metrics["cost/serving/c1/runs"] == 2 and outcome.metrics["cost/serving/usd_per_mtok"] > 0
    excluded, lines = _decision_lines(outcome)
    assert excluded == [f"left out fp8: {rests_on_contention('cost/serving/usd_per_mtok', tags)}"]
    assert len(lines) == 1 and lines[0].startswith("fp8: left out of the decision: cost/serving/usd_per_mtok rests")
    print("", tags["quantlab.cost.contention"], *excluded, *lines, sep="\n")


def test_a_run_contended_while_timed_is_re_run_once_the_cores_are_quiet(server):
    """The process competes until the load's first report exists: every run of that load is contended, and is re-run
    by the same guidellm once a quiet second has passed. On a host whose other work never leaves a quiet second
    within the wait, the runs stay contended and are named, as above."""
    settings = LIGHT.model_copy(update={"contention_retries": 1, "contention_wait_s": 20})
    outcome = _load_under(server, settings, until="first report")
    tags = outcome.tags
    print("", tags["quantlab.cost.contention"], sep="\n")
    if "serving/guidellm-retake-1.json" in outcome.artifacts:
        assert tags["quantlab.cost.contention"].endswith("after 1 re-run"), tags
        assert "quantlab.serving.contended_levels" not in tags or tags["quantlab.serving.contended_levels"] == "c1"
        retaken = json.loads(outcome.artifacts["serving/guidellm-retake-1.json"])
        assert [b["config"]["strategy"]["streams"] for b in retaken["benchmarks"]] == [1, 1]  # both runs again
    else:  # never quiet: named, and left out
        assert tags["quantlab.serving.contended_levels"] == "c1" and _decision_lines(outcome)[1]
    assert outcome.metrics["cost/serving/c1/runs"] == 2 and outcome.metrics["cost/serving/c1/output_tokens_per_s"] > 0
