"""The serve stage: guidellm's report read into load levels, goodput and dollars (tables); the scenario and server
command lines; then a real `transformers serve` of the tiny Llama under real guidellm load: figures present and
consistent, and no server left after success, after failures, or after the sweep is SIGKILLed."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient
from test_engines import launch, under_load
from test_resilience import Sweep, _init_store, _sweep_args, _wait_until, sweeps  # noqa: F401 - sweeps: a fixture
from test_sweep import quantlab
from tiny import save_tiny_llama

from quantlab.measure.settings import MeasureSettings
from quantlab.metrics import Scale, spec
from quantlab.recipe import Recipe
from quantlab.serving.engines import ENGINES
from quantlab.serving.engines.transformers_serve import CPU_ENTRY, FIXED_LENGTH, STOCK_ENTRY
from quantlab.serving.goodput import Price, goodput_level, misses, summarize, usd_per_million_tokens
from quantlab.serving.launcher import ServerFailed, launched_server, running_server, wait_healthy
from quantlab.serving.levels import LoadLevel, ReportError, level_label, levels_from_metrics, load_levels
from quantlab.serving.load import LoadFailed, LoadGenerator, run_load, scenario
from quantlab.serving.pricing import CPU_USD_PER_CORE_HOUR, serving_price, table_entry_for
from quantlab.serving.settings import ServiceLevels, ServingSettings
from quantlab.stages.measure import contention_over
from quantlab.stages.serve import CHART_ARTIFACT, REPORT_ARTIFACT, VariantServer, serve_load, single_stream
from recipes import REPO, tiny_recipe, write

REPORT = Path(__file__).parent / "data" / "guidellm-report-c1-c4.json"  # a real guidellm 0.8.1 run, trimmed
SLO = ServiceLevels(ttft_ms=500, itl_ms=100)


def _level(label: str, tokens: float, ttft: float = 100, itl: float = 50, errors: int = 0, ok: int = 8) -> LoadLevel:
    """A level of `ok` requests whose latencies are at most `ttft` and `itl`; all within SLO when they meet it."""
    met = 1.0 if ttft <= SLO.ttft_ms and itl <= SLO.itl_ms else 0.0
    attainment = None if not ok and not errors else ok * met / (ok + errors)
    latencies = {"ttft_ms_p50": ttft / 2, "ttft_ms_p99": math.nan, "ttft_ms_max": ttft, "itl_ms_p50": itl / 2}
    latencies |= {"itl_ms_p99": math.nan, "itl_ms_max": itl, "tpot_ms_p50": itl, "tpot_ms_p99": math.nan}
    return LoadLevel(
        label,
        "concurrent",
        1,
        tokens,
        tokens / 16,
        **latencies,
        tpot_ms_max=itl,
        succeeded=ok,
        errors=errors,
        incomplete=0,
        output_tokens_min=16,
        slo_attainment=attainment,
    )


# --- guidellm's report, goodput, dollars: pure ---------------------------------------------------------------


def test_a_real_report_reads_into_one_level_per_benchmark():
    c1, c4 = load_levels(json.loads(REPORT.read_text()))
    assert (c1.label, c4.label) == ("c1", "c4")
    assert c1.succeeded == c4.succeeded == 8 and c1.errors == c4.errors == 0
    assert c1.output_tokens_min == 16  # the fixed length reached the server
    for level in (c1, c4):  # 8 requests: p50s, and maxima for the p99s they cannot support
        assert level.ttft_ms_max >= level.ttft_ms_p50 > 0 and level.itl_ms_max >= level.itl_ms_p50 > 0
        assert math.isnan(level.ttft_ms_p99) and list(level.left_out()) == ["p99"]
        assert all(math.isfinite(value) for value in level.figures().values())
    assert c4.output_tokens_per_s > c1.output_tokens_per_s


@pytest.mark.parametrize(
    ("report", "message"),
    [
        ({"metadata": {"version": 1}, "benchmarks": [{}]}, "format 1"),
        ({"metadata": {"version": 2}, "benchmarks": []}, "no benchmark"),
    ],
)
def test_a_report_this_version_cannot_read_is_refused(report, message):
    with pytest.raises(ReportError, match=message):
        load_levels(report)


@pytest.mark.parametrize(
    ("strategy", "label"),
    [
        ({"type_": "concurrent", "streams": 4}, "c4"),
        ({"type_": "synchronous"}, "sync"),
        ({"type_": "throughput", "max_concurrency": 512}, "max"),
        ({"type_": "constant", "rate": 2.5}, "r2.5"),
        ({"type_": "poisson", "rate": 0.123456}, "r0.123"),
    ],
)
def test_level_labels(strategy, label):
    assert level_label(strategy) == label


@pytest.mark.parametrize(
    ("levels", "best"),
    [
        ([_level("c1", 10), _level("c4", 30)], "c4"),  # both meet: the faster
        ([_level("c1", 10), _level("c4", 30, ttft=900)], "c1"),  # c4 misses TTFT
        ([_level("c1", 10), _level("c4", 30, itl=150)], "c1"),  # c4 misses ITL
        ([_level("c1", 10), _level("c4", 30, errors=1)], "c1"),  # one failed of 9: 89% < 90%
        ([_level("c1", 10), _level("c4", 30, errors=1, ok=9)], "c4"),  # one failed of 10: 90% reached
        ([_level("c1", 10, ttft=600), _level("c4", 30, ttft=900)], None),
        ([_level("c1", 10, ok=0, ttft=math.nan, itl=math.nan)], None),  # nothing succeeded: no latency at all
    ],
)
def test_goodput_is_the_highest_load_whose_share_of_requests_meets_every_slo(levels, best):
    found = goodput_level(levels, SLO)
    assert (found.label if found else None) == best


def test_a_missed_level_says_why():
    assert (
        misses(_level("c4", 30, ttft=900, itl=150, errors=2), SLO)
        == "0% of requests within every SLO (2 errored) < 90%"
    )


@pytest.mark.parametrize(("price", "tokens", "usd"), [(3.6, 1000, 1.0), (2.0, 50, 2.0 / (50 * 3600) * 1e6)])
def test_usd_per_million_tokens(price, tokens, usd):
    assert usd_per_million_tokens(price, tokens) == pytest.approx(usd)


def test_no_dollar_figure_at_zero_throughput():
    with pytest.raises(ValueError, match="no dollar figure"):
        usd_per_million_tokens(1.0, 0.0)


def test_summary_metrics_and_what_is_absent():
    levels = [_level("c1", 10), _level("c4", 30, ttft=900)]
    summary = summarize(levels, SLO, Price(3.6, "test"), modeled_tokens_per_s=60)
    metrics = summary.to_metrics()
    assert metrics["cost/serving/goodput_tokens_per_s"] == 10  # c1: c4 misses TTFT
    assert metrics["cost/serving/usd_per_mtok"] == pytest.approx(usd_per_million_tokens(3.6, 10))
    assert metrics["cost/serving/peak_tokens_per_s"] == 30
    assert metrics["cost/serving/peak_vs_modeled"] == pytest.approx(0.5)
    assert metrics["cost/serving/c4/ttft_ms_max"] == 900 and "cost/serving/c4/ttft_ms_p99" not in metrics
    assert summary.to_tags("transformers")["quantlab.serving.goodput_level"] == "c1"
    none = summarize([_level("c4", 30, ttft=900)], SLO, Price(3.6, "test"), None)
    assert "cost/serving/usd_per_mtok" not in none.to_metrics()
    assert none.unavailable()["goodput"] == "c4: 0% of requests within every SLO < 90%"
    assert "peak_vs_modeled" in none.unavailable()


def test_logged_levels_read_back_as_levels():
    levels = [_level("c1", 10), _level("c4", 30, ttft=900)]
    metrics = summarize(levels, SLO, None, None).to_metrics()
    back = levels_from_metrics(metrics | {"cost/weight_bytes": 1.0})
    assert [level.label for level in back] == ["c1", "c4"]
    assert [level.figures() for level in back] == [level.figures() for level in levels]


@pytest.mark.parametrize(
    ("key", "higher", "scale"),
    [
        ("cost/serving/usd_per_mtok", False, Scale.USD),
        ("cost/serving/goodput_tokens_per_s", True, Scale.TOKENS_PER_S),
        ("cost/serving/c4/ttft_ms_p99", False, Scale.MILLISECONDS),
        ("cost/serving/c4/ttft_ms_max", False, Scale.MILLISECONDS),
        ("cost/serving/c4/incomplete", None, Scale.COUNT),
        ("cost/serving/r2.5/output_tokens_per_s", True, Scale.TOKENS_PER_S),
        ("cost/serving/sync/errors", False, Scale.COUNT),
        ("cost/serving/c1/slo_attainment", True, Scale.FRACTION),
    ],
)
def test_serving_keys_are_in_the_metric_contract(key, higher, scale):
    found = spec(key)
    assert found.entry and (found.higher_is_better, found.scale) == (higher, scale)


@pytest.mark.parametrize(
    ("serving", "measure", "gpu", "cores", "expected"),
    [
        ({"price_per_hour": 5.0}, {}, None, 2, 5.0),  # the recipe's own price wins
        ({}, {}, None, 2, 2 * CPU_USD_PER_CORE_HOUR),  # CPU: per core-hour
        ({}, {"target": {"price_per_hour": 4.0}}, "NVIDIA H100 80GB HBM3", 1, None),  # H100 is not the SXM target
        ({}, {"target": {"accelerator": "H200", "price_per_hour": 4.0}}, "NVIDIA H200", 1, 4.0),
        ({}, {"target": {"accelerator": "H200"}}, "NVIDIA H200", 1, None),  # no price anywhere: no dollar figure
    ],
)
def test_serving_price(serving, measure, gpu, cores, expected):
    price = serving_price(ServingSettings(**serving), MeasureSettings(**measure), gpu, cores)
    assert (price.usd_per_hour if price else None) == (pytest.approx(expected) if expected else None)


@pytest.mark.parametrize(
    ("serving", "measure", "expected"),
    [
        ({}, {}, ("c1", 32, 16)),  # the default load's c1 level times batch size 1
        ({"concurrency": [4, 1], "prompt_tokens": 64}, {}, ("c1", 64, 16)),
        ({"profile": "sweep"}, {}, ("sync", 32, 16)),  # guidellm's sweep starts with its synchronous level
        ({"concurrency": [2, 4]}, {}, None),  # no single-stream level: the measure stage times batch size 1
        ({"profile": "goodput"}, {}, None),
        ({"enabled": False}, {}, None),
        ({}, {"batch_sizes": [8]}, None),  # batch size 1 not asked for at all
        ({}, {"batch_sizes": [8, 1]}, ("c1", 32, 16)),
        ({}, {"enabled": False}, None),
    ],
)
def test_batch_size_1_is_the_serve_stages_where_it_has_a_single_stream_level(serving, measure, expected):
    found = single_stream(ServingSettings(**serving), MeasureSettings(**measure))
    assert (found and (found.level, found.prompt_tokens, found.output_tokens)) == expected


@pytest.mark.parametrize(
    ("stages", "expected"),
    [
        ([{}, {}], {}),  # nothing timed: no verdict
        (
            [{"quantlab.cost_contended": "false", "quantlab.cost.contention": "not contended: a"}, {}],
            {"quantlab.cost_contended": "false", "quantlab.cost.contention": "not contended: a"},
        ),
        (
            [
                {"quantlab.cost_contended": "false", "quantlab.cost.contention": "not contended: a"},
                {"quantlab.cost_contended": "true", "quantlab.cost.contention": "contended: b"},
            ],
            {"quantlab.cost_contended": "true", "quantlab.cost.contention": "contended: b"},
        ),
        (
            [
                {"quantlab.cost_contended": "false", "quantlab.cost.contention": "not contended: a"},
                {"quantlab.cost_contended": "false", "quantlab.cost.contention": "not contended: b"},
            ],
            {"quantlab.cost_contended": "false", "quantlab.cost.contention": "not contended: a; not contended: b"},
        ),
    ],
)
def test_the_contention_verdict_spans_every_timed_stage(stages, expected):
    assert contention_over(*stages) == expected


def test_a_gpu_name_finds_its_table_entry_by_the_longest_match():
    assert table_entry_for("NVIDIA H100 NVL", MeasureSettings()) == "H100-NVL"
    assert table_entry_for("NVIDIA H200", MeasureSettings()) == "H200"
    assert table_entry_for("NVIDIA A100-SXM4-80GB", MeasureSettings()) is None  # spelled otherwise: not guessed
    assert table_entry_for("NVIDIA H100 80GB HBM3", MeasureSettings()) is None  # which H100 it is, it does not say


# --- what is sent: the scenario and the command lines ------------------------------------------------------


def test_transformers_scenario_removes_ignore_eos_and_fixes_the_length(tmp_path):
    settings = ServingSettings(concurrency=[4, 1], requests_per_level=6, seconds_per_level=30)
    found = scenario(settings, "transformers", "http://127.0.0.1:9", tmp_path / "ckpt", None, tmp_path / "r.json")
    body = found["spec"]["backend"]["extras"]["body"]
    # null: guidellm drops the field it would add (transformers serve answers it with HTTP 422)
    assert body["ignore_eos"] is None and body["max_tokens"] == 16
    assert json.loads(body["generation_config"]) == {"eos_token_id": -1} and body["generation_config"] == FIXED_LENGTH
    assert found["spec"]["backend"]["request_format"] == "/v1/completions"
    # sorted levels, each run serving.repeats times (3) back to back
    assert [level["profile.streams"] for level in found["benchmarks"]] == [1, 1, 1, 4, 4, 4]
    assert {"kind": "max_requests", "count": 6} in found["spec"]["constraints"]
    assert {"kind": "max_duration", "seconds": 30} in found["spec"]["constraints"]
    assert found["spec"]["data"] == [{"kind": "synthetic_text", "prompt_tokens": 32, "output_tokens": 16}]
    assert found["spec"]["tokenizer"]["model"] == str(tmp_path / "ckpt")  # local: no hub


def test_vllm_scenario_keeps_its_ignore_eos_and_other_profiles(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    settings = ServingSettings(profile="sweep", levels=4)
    found = scenario(settings, "vllm", "http://127.0.0.1:9", tmp_path, prompts, tmp_path / "r.json")
    assert found["spec"]["backend"]["extras"]["body"] == {"max_tokens": 16, "ignore_eos": True}
    assert found["spec"]["profile"] == {
        "kind": "sweep",
        "sweep_size": 4,
        "strategy_type": "constant",
        "warmup": {"percent": 0.25, "mode": "requests"},  # guidellm's own warm-up (serving.measured)
    }
    assert found["spec"]["data"] == [{"kind": "json_file", "path": str(prompts)}]
    goodput = scenario(ServingSettings(profile="goodput"), "vllm", "u", tmp_path, None, tmp_path / "r.json")
    assert goodput["spec"]["profile"]["kind"] == "goodput" and goodput["spec"]["metrics"]["slo"]["ttft_ms"] == 2000
    assert goodput["spec"]["profile"]["target_attainment"] == 0.9  # serving.slo.attainment


def _transformers_serve(checkpoint: Path, port: int) -> list[str]:
    return ENGINES["transformers"].command(Path(sys.executable), launch(checkpoint, port))


def test_validate_names_a_missing_prompts_file(tmp_path, tiny_llama):
    recipe = write(tmp_path / "r.yaml", tiny_recipe(tiny_llama.path, serving={"prompts": "nowhere.jsonl"}))
    done = quantlab("validate", str(recipe), cwd=tmp_path)
    assert done.returncode == 2
    assert f"serving.prompts: no such file: {tmp_path / 'nowhere.jsonl'}" in done.stderr


# --- a real server under real load -------------------------------------------------------------------------


def _served_processes(marker: str) -> list[psutil.Process]:
    """Live servers, guards and guidellm runs whose command line names `marker` (a checkpoint path, or the variant's
    load's scratch directory `<temp dir>/quantlab-load-<variant>-`), with every process they started. The marker
    must be the test's own, in a folder of its own: this scans the whole machine, and a bare `/fp8-` once found (and
    SIGKILLed) the fp8 server of another test run sharing the machine."""
    found = set()
    for process in psutil.process_iter(["cmdline"]):
        line = " ".join(process.info["cmdline"] or [])
        if marker in line and any(word in line for word in ("transformers.cli", "guidellm", "serving.guard")):
            with contextlib.suppress(psutil.NoSuchProcess):
                found |= {process, *process.children(recursive=True)}
    return list(found)


def _all_gone(processes: list[psutil.Process], timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def _gone(marker: str, timeout: float = 15) -> bool:
    return _all_gone(_served_processes(marker), timeout) and not _served_processes(marker)


# SLOs a busy 2-core host meets (its ITL spikes past 200 ms): these tests check the figures, not the machine.
FAST = ServingSettings(
    prompt_tokens=16,
    output_tokens=16,
    concurrency=[1, 4],
    requests_per_level=2,  # in each of 2 runs: as many requests in all as one run of 8 (a half share of warm-up)
    repeats=2,
    contention_retries=0,  # these tests check the figures; tests/test_serving_contended.py the re-runs
    slo={"ttft_ms": 10_000, "itl_ms": 2_000},
)


# Big enough that a decode step costs more than streaming its token (the tiny Llama's does not: 4 streams there
# are no faster than 1), small enough to serve in seconds: 38M parameters.
SMALL_SHAPE = dict(
    hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = save_tiny_llama(tmp_path_factory.mktemp("small-llama"), **SMALL_SHAPE)
    logs = tmp_path_factory.mktemp("serve-logs")
    cost = {
        "cost/measured_bandwidth_bytes_per_s": 5e9,
        "cost/loaded_weight_bytes": 1.5e8,
        "cost/local_roofline_decode_tokens_per_s": 400.0,  # the measure stage's, at the served workload
    }
    recipe = Recipe.model_validate(tiny_recipe(model, serving=FAST.model_dump()))
    stream = single_stream(FAST, MeasureSettings())  # c1 times batch size 1: the measure stage left it
    scratch = tmp_path_factory.mktemp("scratch")  # guidellm's, for _served_processes to tell ours apart
    with (
        mock.patch.object(tempfile, "tempdir", str(scratch)),
        VariantServer(model, "small", None, recipe, "cpu", torch.float32, logs / "cache", logs) as server,
    ):
        server.launch_early()  # as a variant does: the server and guidellm start together
        outcome = serve_load(
            server.ready(scoring=False), FAST, MeasureSettings(), REPO, torch.float32, cost, logs, stream
        )
    return outcome, logs, model, scratch


def test_a_served_variant_logs_consistent_figures(served):
    outcome, logs, model, scratch = served
    metrics = outcome.metrics
    for level in ("c1", "c4"):
        for figure in (
            "output_tokens_per_s",
            "requests_per_s",
            "ttft_ms_p50",
            "ttft_ms_max",
            "itl_ms_p50",
            "itl_ms_max",
        ):
            assert (
                math.isfinite(metrics[f"cost/serving/{level}/{figure}"])
                and metrics[f"cost/serving/{level}/{figure}"] > 0
            )
        assert metrics[f"cost/serving/{level}/errors"] == 0
        # two runs of the level: each figure the mean of the two, within its 95% interval over them
        assert metrics[f"cost/serving/{level}/runs"] == 2
        for figure in ("output_tokens_per_s", "ttft_ms_p50", "itl_ms_p50"):
            low, high = (metrics[f"cost/serving/{level}/{figure}/{end}"] for end in ("ci95_low", "ci95_high"))
            assert low <= metrics[f"cost/serving/{level}/{figure}"] <= high
        for figure in ("ttft_ms", "itl_ms", "tpot_ms"):  # at least 2 requests a run: p50s and maxima, p99 from 100
            assert metrics[f"cost/serving/{level}/{figure}_max"] >= metrics[f"cost/serving/{level}/{figure}_p50"]
    # Batch size 1, timed once: the c1 level's medians are the variant's single-stream figures.
    c1_itl, c1_ttft = metrics["cost/serving/c1/itl_ms_p50"], metrics["cost/serving/c1/ttft_ms_p50"]
    assert metrics["cost/decode_tokens_per_s"] == pytest.approx(1000 / c1_itl)
    assert metrics["cost/prefill_tokens_per_s"] == pytest.approx(FAST.prompt_tokens * 1000 / c1_ttft)
    assert metrics["cost/ttft_ms_p50"] == c1_ttft and metrics["cost/itl_ms_p50"] == c1_itl
    # and their intervals are the c1 level's latency intervals over its two runs, inverted
    itl_low, itl_high = (metrics[f"cost/serving/c1/itl_ms_p50/{end}"] for end in ("ci95_low", "ci95_high"))
    if itl_low > 0:
        assert metrics["cost/decode_tokens_per_s/ci95_low"] == pytest.approx(1000 / itl_high)
        assert metrics["cost/decode_tokens_per_s/ci95_high"] == pytest.approx(1000 / itl_low)
    else:  # a latency interval reaching 0 bounds the throughput from below only
        assert "cost/decode_tokens_per_s/ci95_high" not in metrics
    assert metrics["cost/prefill_tokens_per_s/ci95_low"] <= metrics["cost/prefill_tokens_per_s"]
    assert metrics["cost/roofline_efficiency"] == pytest.approx(metrics["cost/decode_tokens_per_s"] / 400.0)
    # The load's verdict counts the server and guidellm as the stage's own work, not as other work.
    assert outcome.tags["quantlab.cost_contended"] in ("true", "false")
    assert outcome.tags["quantlab.cost.contention"].split(":")[0] in ("contended", "not contended")
    # Uncontended, the stage's own share counts the server's and guidellm's CPU, on which the stage's own process only
    # waits. 0.5 failed (0.39-0.47) while guidellm's fork server, orphaned at its runner's exit, took its own and its
    # workers' CPU time out of the stage's tree (quantlab.serving.guidellm_runner now reaps it); the bound is kept low.
    if outcome.tags["quantlab.cost_contended"] == "false":
        assert metrics["measure/serve/cpu_seconds_per_wall_second"] > 0.25, outcome.tags["quantlab.cost.contention"]
    # Continuous batching: four streams on the same server decode together.
    assert metrics["cost/serving/c4/output_tokens_per_s"] > metrics["cost/serving/c1/output_tokens_per_s"]
    assert metrics["cost/serving/peak_tokens_per_s"] == metrics["cost/serving/c4/output_tokens_per_s"]
    assert metrics["cost/serving/usd_per_mtok"] > 0 and metrics["cost/serving/peak_vs_modeled"] > 0
    assert (
        outcome.params["served.engine"] == "transformers"
        and "--continuous-batching" in outcome.params["served.command"]
    )
    assert outcome.params["served.price_source"].startswith(f"{torch.get_num_threads()} CPU cores")
    report = json.loads(outcome.artifacts[REPORT_ARTIFACT])
    assert report["benchmarks"][0]["metrics"]["output_token_count"]["successful"]["min"] == 16  # fixed length
    assert outcome.artifacts[CHART_ARTIFACT][:8] == b"\x89PNG\r\n\x1a\n"
    assert "Uvicorn running" in (logs / "small.server.log").read_text()
    assert (logs / "small.guidellm.log").is_file()
    assert _gone(str(model), timeout=5) and _gone(str(scratch / "quantlab-load-small-"), timeout=5)  # with the stage


TWO_STREAMS = FAST.model_copy(update={"concurrency": [2], "requests_per_level": 4, "repeats": 1})


@pytest.fixture(scope="module")
def served_then_killed(tmp_path_factory, tiny_llama):
    """One server's life: a load with no single-stream level (the measure stage times batch size 1 there), then the
    server killed while a stage uses it, which the stage sees as a refused connection."""
    work = tmp_path_factory.mktemp("served-then-killed")
    recipe = Recipe.model_validate(tiny_recipe(tiny_llama.path, serving=TWO_STREAMS.model_dump()))
    with (
        pytest.raises(ServerFailed) as failure,
        VariantServer(tiny_llama.path, "dies", None, recipe, "cpu", torch.float32, work, work) as server,
    ):
        served = server.ready(scoring=False)
        server.launch_early()  # guidellm, as the runner starts it
        load = serve_load(served, TWO_STREAMS, MeasureSettings(), REPO, torch.float32, {}, work, None)
        (engine,) = psutil.Process(served.server.process.pid).children()  # under its guard: the server itself
        engine.send_signal(signal.SIGKILL)
        served.server.process.wait(timeout=10)  # the guard ends as the server did
        raise ConnectionRefusedError(f"Cannot connect to {served.server.url}")
    return load, failure.value, served.server.url


def test_a_load_without_a_single_stream_level_still_says_whether_it_was_contended(served_then_killed):
    """Goodput and $/Mtok are timings too: the verdict comes with every profile, not only where the load times
    batch size 1 (where the measure stage times it, it gives its own too, and the run's combines both)."""
    load, _, _ = served_then_killed
    assert load.tags["quantlab.cost_contended"] in ("true", "false")
    assert load.tags["quantlab.cost.contention"].split(":")[0] in ("contended", "not contended")
    assert "cost/decode_tokens_per_s" not in load.metrics  # batch size 1 is the measure stage's here
    assert load.metrics["cost/serving/c2/output_tokens_per_s"] > 0


def test_a_server_that_dies_while_a_stage_uses_it_fails_the_variant_with_its_own_end(served_then_killed, tiny_llama):
    """The stage sees a refused connection; the variant fails with what the server said (its exit and log's tail)."""
    _, failure, url = served_then_killed
    first = str(failure).splitlines()[0]
    assert first.startswith("the transformers server killed by SIGKILL; its log ends: "), first
    assert str(failure).endswith(f"(the stage saw ConnectionRefusedError: Cannot connect to {url})")
    assert _gone(str(tiny_llama.path), timeout=5)


def test_a_server_that_never_becomes_healthy_fails_with_its_log_and_is_stopped(tmp_path, tiny_llama):
    def command_for(port: int) -> list[str]:
        return _transformers_serve(tiny_llama.path, port)

    started = time.monotonic()
    healthy_within = r"did not answer http://127.0.0.1:\d+/health within 0.5 s"
    log = tmp_path / "server.log"
    with (
        pytest.raises(ServerFailed, match=healthy_within) as failure,
        running_server(command_for, "transformers", log, os.environ, startup_timeout_s=0.5),
    ):
        pass
    assert "serving.startup_timeout_s" in str(failure.value) and "its log ends" in str(failure.value)
    assert time.monotonic() - started < 30
    assert _gone(str(tiny_llama.path), timeout=5)


def test_a_server_started_early_and_waited_for_after_its_deadline_is_healthy_not_failed(tmp_path):
    """A server launched beside the evaluate stage is first waited for when that stage ends, which on CPU can be
    after its start-up deadline: long healthy by then, it passes (it once failed without a single health request)."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "health").write_text("ok")  # GET /health answers 200

    def command_for(port: int) -> list[str]:
        return [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(tmp_path / "site")]

    with launched_server(command_for, "transformers", tmp_path / "server.log", os.environ) as server:
        wait_healthy(server, 60)
        started_long_ago = dataclasses.replace(server, started_at=time.monotonic() - 1000)
        wait_healthy(started_long_ago, 300)  # its deadline passed 700 s ago
        server.process.kill()
        server.process.wait()
        with pytest.raises(ServerFailed, match="the server stopped before it was healthy"):
            wait_healthy(started_long_ago, 300)


def test_a_taken_port_is_named(tmp_path, tiny_llama):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        never_started = [sys.executable, "-c", "raise SystemExit('must not start')"]
        with (
            pytest.raises(ServerFailed, match=f"port {port} on 127.0.0.1 is taken"),
            running_server(lambda _: never_started, "transformers", tmp_path / "log", os.environ, 5, port),
        ):
            pass


def test_guidellm_imports_before_its_scenario_and_a_failed_run_says_why(tmp_path):
    """The load generator starts early: guidellm imported, it waits for the scenario; handed a scenario guidellm
    rejects, the run fails with guidellm's exit code and log, and no process of it is left."""
    idle = [sys.executable, "-c", "import time; time.sleep(600)"]  # a live "server" nothing is sent to
    with (
        launched_server(lambda port: idle, "transformers", tmp_path / "server.log", os.environ) as server,
        LoadGenerator(tmp_path / "load", tmp_path / "guidellm.log", worker_processes=1) as load,
    ):
        load.start()
        load.wait_imported(timeout_s=120)
        assert (tmp_path / "load" / "imported").is_file() and not list((tmp_path / "load").glob("scenario-*.json"))
        waiting = _served_processes(str(tmp_path / "load"))
        assert waiting and all(p.is_running() for p in waiting)  # imported, and waiting for its scenario
        rejected = {"spec": {"outputs": [{"kind": "json", "path": str(load.report_path)}]}, "benchmarks": "none"}
        with pytest.raises(LoadFailed, match=r"guidellm exited with code [1-9]\d*; its log ends:\n"):
            load.run(rejected, server, timeout_s=120)
    assert _gone(str(tmp_path / "load"), timeout=5)


def test_a_server_killed_under_load_fails_the_stage_and_guidellm_is_stopped(tmp_path, tiny_llama):
    def command_for(port: int) -> list[str]:
        return _transformers_serve(tiny_llama.path, port)

    settings = ServingSettings(output_tokens=64, concurrency=[2], requests_per_level=200)
    with running_server(command_for, "transformers", tmp_path / "server.log", os.environ, 120) as server:
        spec = scenario(settings, "transformers", server.url, tiny_llama.path, None, tmp_path / "report.json")
        load_log = tmp_path / "guidellm.log"
        server_process = psutil.Process(server.process.pid).children()[0]  # under its guard

        def kill_when_loaded() -> None:  # a real fault: the engine process dies while requests are in flight
            _wait_for(lambda: "concurrent@2" in load_log.read_text() if load_log.exists() else False, 60)
            server_process.send_signal(signal.SIGKILL)

        killer = threading.Thread(target=kill_when_loaded, daemon=True)
        killer.start()
        with pytest.raises(ServerFailed, match="the server died under load: the transformers server killed by SIGKILL"):
            run_load(spec, tmp_path, load_log, server, timeout_s=300, worker_processes=1)
    assert _gone(str(tiny_llama.path), timeout=10)


def _wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.1)


def test_sigkill_of_the_sweep_leaves_no_server(tmp_path, tiny_llama, sweeps):  # noqa: F811 - the fixture
    recipe = tiny_recipe(
        tiny_llama.path,
        variants=[{"name": "bf16", "method": "bf16"}],
        evals={"tasks": []},
        serving=FAST.model_dump(include={"prompt_tokens", "output_tokens"}) | {"requests_per_level": 200},
    )
    path = write(tmp_path / "recipe.yaml", recipe)
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    _init_store(uri)
    cache = tmp_path / "cache"
    sweep = Sweep(_sweep_args(path, uri, cache), tmp_path, env={"TMPDIR": str(tmp_path)})
    sweeps.append(sweep)
    # The bf16 checkpoint lives in the sweep's cache: its server and guidellm name it.

    def server_and_load() -> list[psutil.Process]:
        load = _served_processes(str(tmp_path / "quantlab-load-bf16-"))  # with guidellm's workers
        running = _served_processes(str(cache)) + load
        # the server and guidellm, each guarded
        return running if len(running) >= 4 and under_load("bf16", tmp_path) else []

    # guidellm's guard is up a moment before guidellm itself: wait for all four, not the first, and for the load.
    running = _wait_until(server_and_load, sweep, "the server and guidellm's load, each under its guard")
    sweep.kill_group()  # the sweep and its variant process, SIGKILL: no teardown code runs
    assert _all_gone(running, timeout=10), [p.cmdline() for p in running if p.is_running()]


def test_a_variant_whose_server_dies_fails_alone_with_its_server_log(tmp_path, tiny_llama, sweeps):  # noqa: F811
    recipe = tiny_recipe(
        tiny_llama.path,
        variants=[{"name": "bf16", "method": "bf16"}, {"name": "fp8", "method": "fp8"}],
        evals={"tasks": []},
        serving=FAST.model_dump(include={"prompt_tokens", "concurrency"}) | {"output_tokens": 32, "repeats": 1},
    )
    path = write(tmp_path / "recipe.yaml", recipe)
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    _init_store(uri)
    sweep = Sweep(_sweep_args(path, uri, tmp_path / "cache"), tmp_path, env={"TMPDIR": str(tmp_path)})
    sweeps.append(sweep)
    checkpoint, load = str(tmp_path / "cache" / "checkpoints" / "fp8-"), str(tmp_path / "quantlab-load-fp8-")

    def fp8_server() -> psutil.Process | None:
        return next((p for p in _served_processes(checkpoint) if p.cmdline()[2] in (CPU_ENTRY, STOCK_ENTRY)), None)

    server = _wait_until(fp8_server, sweep, "fp8's server")
    _wait_until(lambda: _served_processes(load) and under_load("fp8", tmp_path), sweep, "guidellm's load on fp8")
    server.send_signal(signal.SIGKILL)
    code, _ = sweep.wait()
    assert code == 1, sweep.text()[-3000:]
    client = MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "tiny"]
    runs = {
        r.data.tags["quantlab.variant"]: r
        for r in client.search_runs([experiment.experiment_id], "tags.`quantlab.role` = 'variant'")
    }
    assert (
        runs["bf16"].info.status == "FINISHED" and runs["bf16"].data.metrics["cost/serving/c4/output_tokens_per_s"] > 0
    )
    assert runs["fp8"].info.status == "FAILED"
    assert "the server died under load" in runs["fp8"].data.tags["quantlab.failure"]
    logs = {item.path for item in client.list_artifacts(runs["fp8"].info.run_id, "logs")}
    assert {"logs/variant.log", "logs/server.log", "logs/guidellm.log"} <= logs
    assert _gone(checkpoint, timeout=5) and _gone(load, timeout=5)
