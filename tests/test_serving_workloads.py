"""serving.workloads: named request shapes (presets and a recipe's own), validated up front; the ratio of two
variants' goodput with its interval (hand-computed cases); the per-workload report table; then one real
`transformers serve` of the tiny Llama under two tiny workloads, with a third too long for the server skipped."""

from __future__ import annotations

import json
import math

import pytest
import torch
from scipy import stats
from test_sweep import quantlab

from quantlab.errors import BadInput
from quantlab.frontier import VariantSummary, compute_frontiers
from quantlab.measure.settings import MeasureSettings
from quantlab.metrics import rests_on_contention, spec
from quantlab.recipe import Recipe, load_recipe
from quantlab.report import render_markdown, workload_table
from quantlab.serving.goodput import WORKLOADS_TAG
from quantlab.serving.intervals import Interval, ratio_interval, t_interval
from quantlab.serving.settings import ServingSettings
from quantlab.stages.serve import CHART_ARTIFACT, VariantServer, kv_tokens_that_fit, serve_load
from recipes import REPO, tiny_recipe, write

# --- the recipe's section: pure ---------------------------------------------------------------------------------


def test_presets_and_a_recipes_own_shape_in_order_the_first_setting_the_primary_shape():
    settings = ServingSettings(workloads=["prefill-heavy", {"name": "mine", "prompt_tokens": 16, "output_tokens": 4}])
    shapes = [(w.name, w.prompt_tokens, w.output_tokens) for w in settings.workload_shapes()]
    assert shapes == [("prefill-heavy", 1024, 128), ("mine", 16, 4)]
    assert (settings.prompt_tokens, settings.output_tokens) == (1024, 128)  # what the batch-1 timing reads
    assert ServingSettings.model_validate(settings.model_dump()) == settings  # a dumped section reads back
    every = ServingSettings(workloads=["chat", "prefill-heavy", "decode-heavy", {"name": "long-context"}])
    assert [(w.prompt_tokens, w.output_tokens) for w in every.workload_shapes()] == [
        (128, 128),
        (1024, 128),
        (128, 1024),
        (8192, 512),
    ]


def test_unset_workloads_is_the_one_shape_of_prompt_and_output_tokens():
    settings = ServingSettings(prompt_tokens=32, output_tokens=8)
    (only,) = settings.workload_shapes()
    assert (only.prompt_tokens, only.output_tokens) == (32, 8) and settings.workloads is None
    assert settings.skipped_workloads(16) == {}  # served as given, as before workloads existed


def test_a_workload_longer_than_the_server_takes_is_skipped_with_one_line():
    settings = ServingSettings(workloads=["chat", "long-context"])
    assert settings.skipped_workloads(8704) == {}
    assert settings.skipped_workloads(4096) == {
        "long-context": "workload long-context skipped: 8192 + 512 tokens exceed the server's longest sequence, 4096 "
        "(serving.max_model_len, or the model's own)"
    }


@pytest.mark.parametrize(
    ("workloads", "field", "message"),
    [
        (["chat", "nope"], "serving.workloads[1]", "unknown workload preset 'nope'; known: chat, prefill-heavy"),
        (["chat", "chat"], "serving.workloads", "workload names must be distinct; repeated: ['chat']"),
        ([{"name": "a", "prompt_tokens": 0, "output_tokens": 4}], "serving.workloads[0] (a).prompt_tokens", "greater"),
        ([{"name": "a", "prompt_tokens": 8, "output_tokens": 1}], "serving.workloads[0] (a).output_tokens", "greater"),
        ([{"name": "a/b", "prompt_tokens": 8, "output_tokens": 4}], "serving.workloads[0] (a/b).name", "1-64 letters"),
        ([{"name": "a", "prompt_tokens": 8}], "serving.workloads[0] (a).output_tokens", "required key is missing"),
        ([], "serving.workloads", "at least 1 item"),
    ],
)
def test_bad_workloads_are_named_by_field(tmp_path, workloads, field, message):
    recipe = write(tmp_path / "r.yaml", tiny_recipe(tmp_path, serving={"workloads": workloads}))
    with pytest.raises(BadInput) as refused:
        load_recipe(recipe)
    (problem,) = [p for p in refused.value.problems if p.field.startswith("serving")]
    assert problem.field == field and message in problem.message, problem


def test_validate_exits_2_with_one_line_naming_the_file_and_the_workload(tmp_path):
    recipe = write(tmp_path / "r.yaml", tiny_recipe(tmp_path, serving={"workloads": ["chat", "chatt"]}))
    done = quantlab("validate", str(recipe), cwd=tmp_path)
    assert done.returncode == 2
    (line,) = [line for line in done.stderr.splitlines() if "serving" in line]
    assert str(recipe) in line and "serving.workloads[1]" in line and "unknown workload preset 'chatt'" in line
    assert "Traceback" not in done.stderr


def test_a_prompt_length_beside_workloads_must_be_the_first_ones():
    with pytest.raises(ValueError, match=r"prompt_tokens \(32\) differs from the first workload's \(chat: 128\)"):
        ServingSettings(workloads=["chat"], prompt_tokens=32)


# --- the ratio of two goodputs and its interval: hand-computed --------------------------------------------------

T1, T2, T4 = 12.706204736174694, 4.302652729911275, 2.7764451051977987  # t(0.975) at 1, 2 and 4 degrees of freedom


def _around(mean: float, se: float, runs: int, t: float) -> Interval:
    return Interval(mean, mean - t * se, mean + t * se, runs)


@pytest.mark.parametrize(
    ("variant", "baseline", "expected"),
    [
        # a baseline without spread: the variant's relative error alone, on its own degrees of freedom (runs - 1);
        # runs 9 and 11: mean 10, se 1, log-scale se 0.1
        (t_interval([9, 11]), Interval(5, 5, 5, 3), (2.0, 2 / math.exp(T1 * 0.1), 2 * math.exp(T1 * 0.1))),
        # equal relative errors (0.05 each, 3 runs each): se sqrt(2) * 0.05 on Welch's 4 degrees of freedom
        (
            _around(10, 0.5, 3, T2),
            _around(20, 1.0, 3, T2),
            (0.5, 0.5 * math.exp(-T4 * 0.05 * math.sqrt(2)), 0.5 * math.exp(T4 * 0.05 * math.sqrt(2))),
        ),
        # a variant interval that reached below 0 and starts at 0 (interval_of): its se from its upper half
        # (10 +- 4.303 * 3: se 3, log-scale 0.3), the baseline's 0.05; Welch's degrees of freedom
        (
            Interval(10, 0.0, 10 + T2 * 3, 3),
            _around(20, 1.0, 3, T2),
            (
                0.5,
                0.5
                * math.exp(
                    -stats.t.ppf(0.975, (0.3**2 + 0.05**2) ** 2 / (0.3**4 / 2 + 0.05**4 / 2)) * math.hypot(0.3, 0.05)
                ),
                0.5
                * math.exp(
                    stats.t.ppf(0.975, (0.3**2 + 0.05**2) ** 2 / (0.3**4 / 2 + 0.05**4 / 2)) * math.hypot(0.3, 0.05)
                ),
            ),
        ),
        (Interval(4, 4, 4, 3), Interval(2, 2, 2, 3), (2.0, 2.0, 2.0)),  # no spread on either side
        (Interval(4, 3, 5, 1), Interval(2, 1, 3, 3), None),  # one run: no spread to estimate
        (Interval(4, 3, 5, 3), Interval(0, 0, 0, 3), None),  # no ratio to a baseline without throughput
    ],
)
def test_ratio_interval_by_hand(variant, baseline, expected):
    found = ratio_interval(variant, baseline)
    if expected is None:
        assert found is None
        return
    assert (found.mean, found.low, found.high) == pytest.approx(expected, rel=1e-9)
    assert found.low <= found.mean <= found.high


def test_kv_cache_tokens_fit_beside_the_weights():
    gib = 2**30
    assert kv_tokens_that_fit(1000, 1024, 80 * gib, 16 * gib, 512) == 1000  # room to spare: as sized for the load
    assert kv_tokens_that_fit(10**9, 2**17, 80 * gib, 16 * gib, 8704) == int(64 * gib * 0.8) // 2**17
    assert kv_tokens_that_fit(10**9, 2**17, 8 * gib, 16 * gib, 8704) == 8704  # no room: one sequence, as vLLM needs


# --- keys, contention and the report's table: pure --------------------------------------------------------------


def test_workload_keys_are_in_the_metric_contract_and_their_own_contention_decides():
    found = spec("cost/serving/workload/chat/usd_per_mtok/ci95_high")
    assert found.entry == "cost/serving/workload/<workload>/usd_per_mtok/ci95_high" and found.higher_is_better is False
    assert spec("cost/serving/workload/chat/c4/good_requests_per_s").label.endswith(", chat workload")
    tags = {
        "quantlab.serving.workload/chat/contended_levels": "c4",
        "quantlab.serving.workload/chat/contention.c4": "x",
    }
    assert "rests on load level c4" in rests_on_contention("cost/serving/workload/chat/goodput_tokens_per_s", tags)
    assert rests_on_contention("cost/serving/workload/long/goodput_tokens_per_s", tags) is None
    assert rests_on_contention("cost/serving/goodput_tokens_per_s", tags) is None  # the primary's own tags decide


def _variant(
    name: str,
    figures: dict[str, tuple[float, float, float, int]],
    baseline: bool = False,
    rounds: tuple[float, ...] = (),
    **tags: str,
):
    """A variant whose workloads logged goodput (mean, low, high) at a level of `runs` runs, c4; `rounds`: each
    workload's goodput round by round (served interleaved)."""
    shapes = [{"name": n, "prompt_tokens": 8, "output_tokens": 4} for n in ("chat", "long", "once")]
    metrics: dict[str, float] = {}
    all_tags = {WORKLOADS_TAG: json.dumps(shapes)} | tags
    for workload, (mean, low, high, runs) in figures.items():
        key = f"cost/serving/workload/{workload}"
        metrics |= {f"{key}/goodput_tokens_per_s": mean, f"{key}/c4/runs": runs}
        if runs > 1:
            metrics |= {f"{key}/goodput_tokens_per_s/ci95_low": low, f"{key}/goodput_tokens_per_s/ci95_high": high}
        metrics |= {f"{key}/goodput_tokens_per_s/round_{n}": value for n, value in enumerate(rounds, 1)}
        all_tags[f"quantlab.serving.workload/{workload}/goodput_level"] = "c4"
    return VariantSummary(name, "bf16" if baseline else "fp8", True, metrics, all_tags, is_baseline=baseline)


def test_the_report_shows_each_workloads_ratio_to_the_baseline_with_its_interval():
    base = _variant("bf16", {"chat": (20, 20 - T2, 20 + T2, 3), "long": (5, 4, 6, 3), "once": (8, 8, 8, 1)}, True)
    why = "workload long skipped: 8 + 4 tokens exceed the server's longest sequence, 10"
    fp8 = _variant(
        "fp8",
        {"chat": (10, 10 - T2 * 0.5, 10 + T2 * 0.5, 3), "once": (4, 4, 4, 1)},
        **{"quantlab.serving.unavailable.workload/long": why},
    )
    table = workload_table([base, fp8])
    expected_low, expected_high = (0.5 * math.exp(sign * T4 * 0.05 * math.sqrt(2)) for sign in (-1, 1))
    assert table.rows[0][0] == "chat (8 + 4)" and table.rows[0][3] == "1 (the baseline)"
    assert table.rows[1][:2] == ("", "fp8") and table.rows[1][3] == f"0.5x [{expected_low:.3g}, {expected_high:.3g}]"
    assert table.rows[3] == ("", "fp8", f"none: {why}", "")
    assert table.rows[5][3] == "0.5x (no interval: one run of a level)"
    assert workload_table([VariantSummary("bf16", "bf16", True, {}, {}, is_baseline=True)]) is None


def test_served_in_the_same_rounds_the_ratio_is_paired_round_by_round():
    """Both goodputs drift over three rounds alike (20, 30, 40 against 10, 15, 20): the ratio is 0.5 in each round,
    an interval of no width, where each one's own interval over its runs is wide; without the rounds, the ratio's
    interval comes from the two intervals."""
    base_chat, fp8_chat = (30, 30 - 10 * T2, 30 + 10 * T2, 3), (15, 15 - 5 * T2, 15 + 5 * T2, 3)
    base = _variant("bf16", {"chat": base_chat}, True, rounds=(20, 30, 40))
    fp8 = _variant("fp8", {"chat": fp8_chat}, rounds=(10, 15, 20))
    assert workload_table([base, fp8]).rows[1][3] == "0.5x [0.5, 0.5] (paired by round)"
    unpaired = workload_table([_variant("bf16", {"chat": base_chat}, True), _variant("fp8", {"chat": fp8_chat})])
    assert unpaired.rows[1][3].startswith("0.5x [") and "paired" not in unpaired.rows[1][3]


# --- a real server under two tiny workloads ---------------------------------------------------------------------

TWO_SHAPES = ServingSettings(
    workloads=[
        {"name": "short", "prompt_tokens": 16, "output_tokens": 4},
        {"name": "longer", "prompt_tokens": 24, "output_tokens": 4},
        {"name": "too-long", "prompt_tokens": 60, "output_tokens": 8},
    ],
    max_model_len=64,
    concurrency=[1],
    requests_per_level=2,
    repeats=1,
    contention_retries=0,  # tests/test_serving_contended.py has the re-runs
    slo={"ttft_ms": 10_000, "itl_ms": 2_000},
)


def test_each_workload_is_served_under_its_own_keys_and_the_first_under_the_plain_ones(tmp_path, tiny_llama):
    recipe = Recipe.model_validate(tiny_recipe(tiny_llama.path, serving=TWO_SHAPES.model_dump()))
    with VariantServer(tiny_llama.path, "shapes", None, recipe, "cpu", torch.float32, tmp_path, tmp_path) as server:
        server.launch_early()
        outcome = serve_load(server.ready(scoring=False), TWO_SHAPES, MeasureSettings(), REPO, torch.float32, {}, None)
    metrics, tags = outcome.metrics, outcome.tags
    for name in ("short", "longer"):
        key = f"cost/serving/workload/{name}"
        assert metrics[f"{key}/c1/output_tokens_per_s"] > 0 and metrics[f"{key}/c1/errors"] == 0
        assert metrics[f"{key}/goodput_tokens_per_s"] > 0 and metrics[f"{key}/usd_per_mtok"] > 0
        assert tags[f"quantlab.serving.workload/{name}/goodput_level"] == "c1"
        assert tags[f"quantlab.serving.workload/{name}/contention"].split(":")[0] in ("contended", "not contended")
    # the primary workload keeps the plain keys the frontier and pick read: the same figures
    plain = {
        key: value for key, value in metrics.items() if key.startswith("cost/serving/") and "/workload/" not in key
    }
    assert plain == {
        key.replace("workload/short/", ""): value
        for key, value in metrics.items()
        if key.startswith("cost/serving/workload/short/")
    }
    assert not any(key.startswith("cost/serving/workload/too-long/") for key in metrics)
    skipped = tags["quantlab.serving.unavailable.workload/too-long"]
    assert skipped.startswith("workload too-long skipped: 60 + 8 tokens exceed the server's longest sequence, 64")
    assert [shape["name"] for shape in json.loads(tags[WORKLOADS_TAG])] == ["short", "longer", "too-long"]
    assert tags["quantlab.cost_contended"] in ("true", "false")
    assert (
        "workload short: " in tags["quantlab.cost.contention"]
        and "workload longer: " in tags["quantlab.cost.contention"]
    )
    assert CHART_ARTIFACT in outcome.artifacts and "serving/workload/longer/guidellm.json" in outcome.artifacts
    # the report's table, the served variant as its own baseline
    summary = VariantSummary("shapes", "bf16", True, metrics, tags, is_baseline=True)
    text = render_markdown([summary], compute_frontiers([summary]), None)
    assert "### Per workload" in text and "too-long (60 + 8)" in text and "1 (the baseline)" in text
