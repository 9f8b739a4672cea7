"""Cost that holds (pure): a load level's runs pooled with 95% intervals, hand-computed; the SLO share's exact bound
over every run's requests; goodput's first-failure rule on a table of attainments; which figures rest on a level
other work competed with; a level's own contention reading, and its own pace against its warm-up's; the scenario's
repeated runs; `pick` ranking a measured cost by its bound and leaving a contended figure out, saying so in one
line."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from scipy import stats

from quantlab.decision import Status, cost_warnings, objective_bound, pick
from quantlab.frontier import Axis, VariantSummary
from quantlab.measure.contention import LoadSampler, Sample, judge_contention, judge_slowdown, reading_between
from quantlab.metrics import (
    CONTENDED_LEVELS_TAG,
    LEVEL_CONTENTION_TAG,
    SINGLE_STREAM_FIGURES_TAG,
    has_entry,
    rests_on_contention,
)
from quantlab.policy import Policy
from quantlab.repeats import Interval, paired_ratio
from quantlab.serving.goodput import Price, attainment_bounds, goodput_level, summarize, usd_per_million_tokens
from quantlab.serving.intervals import pooled, t_interval
from quantlab.serving.levels import LoadLevel
from quantlab.serving.load import scenario
from quantlab.serving.measured import level_requests, warmup_share
from quantlab.serving.settings import ServiceLevels, ServingSettings
from quantlab.stages.serve import _run_verdicts

SLO = ServiceLevels()


def run(label: str, tokens: float, within: int | None, judged: int = 8, rps: float | None = None, **extra) -> LoadLevel:
    """One run of a level: `within` of its `judged` requests met every SLO (None: guidellm judged none)."""
    latencies = {f"{latency}_{q}": 10.0 for latency in LoadLevel.LATENCIES for q in ("p50", "p99", "max")}
    return LoadLevel(
        label=label,
        strategy="concurrent",
        concurrency=float(label.removeprefix("c")),
        output_tokens_per_s=tokens,
        requests_per_s=tokens / 16 if rps is None else rps,
        **(latencies | extra),
        succeeded=judged,
        errors=0,
        incomplete=0,
        output_tokens_min=16,
        slo_attainment=None if within is None else within / judged,
    )


# --- intervals by hand --------------------------------------------------------------------------------------

T_975_2 = 4.302652729749464  # Student t, 2 degrees of freedom, 97.5%: tables give 4.303
T_975_1 = 12.706204736174707  # 1 degree of freedom: 12.706


@pytest.mark.parametrize(
    ("values", "mean", "half"),
    [
        ([10.0, 12.0, 14.0], 12.0, T_975_2 * 2 / math.sqrt(3)),  # s = 2: 12 +- 4.968
        ([1.0, 3.0], 2.0, T_975_1 * math.sqrt(2) / math.sqrt(2)),  # s = sqrt 2, se = 1: 2 +- 12.706
        ([1.0, math.nan, 3.0], 2.0, T_975_1),  # a run that has no figure is left out
        ([5.0, 5.0, 5.0], 5.0, 0.0),  # three identical runs: no spread seen
    ],
)
def test_a_t_interval_over_runs_by_hand(values, mean, half):
    found = t_interval(values)
    assert found is not None and found.mean == pytest.approx(mean)
    assert (found.low, found.high) == pytest.approx((mean - half, mean + half))


def test_a_paired_ratio_by_hand():
    """Two figures measured in the same three rounds: the t interval of their mean log ratio (2 degrees of
    freedom), back-transformed."""
    logs = [math.log(20 / 15), math.log(19 / 14), math.log(20.5 / 16)]
    mean = sum(logs) / 3
    half = T_975_2 * math.sqrt(sum((x - mean) ** 2 for x in logs) / 2) / math.sqrt(3)
    found = paired_ratio([20.0, 19.0, 20.5], [15.0, 14.0, 16.0])
    assert (found.mean, found.low, found.high) == pytest.approx(
        (math.exp(mean), math.exp(mean - half), math.exp(mean + half))
    )
    assert (found.mean, found.low, found.high) == pytest.approx((1.3235, 1.2301, 1.4241), abs=1e-4)
    assert paired_ratio([20.0, 22.0, 24.0], [10.0, 11.0, 12.0]) == Interval(
        2.0, 2.0, 2.0, 3
    )  # the same ratio each round


@pytest.mark.parametrize(
    ("first", "second"),
    [([1.0, 2.0], [1.0]), ([1.0], [2.0]), ([1.0, 0.0], [1.0, 1.0]), ([], [])],  # counts differ, one round, not > 0
)
def test_no_paired_ratio(first, second):
    assert paired_ratio(first, second) is None


def test_runs_keep_their_values_in_order_and_inverted():
    found = t_interval([4.0, 5.0, 2.0])
    assert found.values == (4.0, 5.0, 2.0) and found.inverted(20.0).values == (5.0, 4.0, 10.0)
    assert t_interval([4.0, math.nan, 2.0]).values == ()  # a run without a figure: no run-by-run values
    assert found.rounds("cost/x") == {"cost/x/round_1": 4.0, "cost/x/round_2": 5.0, "cost/x/round_3": 2.0}


@pytest.mark.parametrize("values", [[], [7.0], [7.0, math.nan]])
def test_one_run_has_no_interval(values):
    assert t_interval(values) is None


def test_runs_pool_into_one_level_whose_share_counts_every_request():
    runs = [run("c4", 100.0, 8), run("c4", 110.0, 6), run("c4", 120.0, 7)]
    level = pooled(runs)
    assert level.output_tokens_per_s == pytest.approx(110.0) and level.runs == 3
    assert (level.succeeded, level.slo_attainment) == (24, pytest.approx(21 / 24))
    # Clopper-Pearson, one-sided 95%: the beta quantiles, here by scipy.stats' own beta distribution
    low, high = attainment_bounds(level)
    assert low == pytest.approx(stats.beta.ppf(0.05, 21, 4)) and high == pytest.approx(stats.beta.ppf(0.95, 22, 3))
    # All within SLO: the lower bound is alpha ** (1 / n) (by hand: 24 of 24 -> 0.05 ** (1/24) = 0.8826)
    assert attainment_bounds(pooled([run("c1", 10.0, 8)] * 3))[0] == pytest.approx(0.05 ** (1 / 24))


def test_pooling_refuses_runs_of_several_levels():
    with pytest.raises(ValueError, match="several levels"):
        pooled([run("c1", 1.0, 8), run("c4", 1.0, 8)])


def test_the_summary_logs_each_interval_and_goodput_s_dollars_at_both_ends():
    runs = [run("c1", 20.0, 8), run("c1", 22.0, 8), run("c1", 24.0, 8)]
    runs += [run("c4", 50.0, 8), run("c4", 60.0, 8), run("c4", 70.0, 8)]
    metrics = summarize(runs, SLO, Price(3.6, "test"), None).to_metrics()
    half = T_975_2 * 10 / math.sqrt(3)  # c4: 60 +- 4.303 * 10 / sqrt 3
    assert metrics["cost/serving/c4/output_tokens_per_s"] == pytest.approx(60.0)
    assert metrics["cost/serving/c4/output_tokens_per_s/ci95_low"] == pytest.approx(60 - half)
    assert metrics["cost/serving/c4/output_tokens_per_s/ci95_high"] == pytest.approx(60 + half)
    assert metrics["cost/serving/c4/runs"] == 3 and metrics["cost/serving/c4/succeeded"] == 24
    assert metrics["cost/serving/goodput_tokens_per_s/ci95_low"] == pytest.approx(60 - half)
    # $/Mtok at 3.6 $/h: 1e6 / 3600 * 3.6 / tokens = 1000 / tokens; the cheap end at the fast end
    assert metrics["cost/serving/usd_per_mtok"] == pytest.approx(1000 / 60)
    assert metrics["cost/serving/usd_per_mtok/ci95_low"] == pytest.approx(1000 / (60 + half))
    assert metrics["cost/serving/usd_per_mtok/ci95_high"] == pytest.approx(1000 / (60 - half))
    assert usd_per_million_tokens(3.6, 60) == pytest.approx(1000 / 60)
    for key in metrics:
        assert has_entry(key), key  # every key the summary logs is declared in the metric contract


def test_runs_in_rounds_log_the_decision_figures_round_by_round():
    """Interleaved (serving.interleave) the goodput level's runs are also logged one by one, in the order they ran:
    throughput, requests and dollars (3.6 $/h: 1000 / tokens); back to back, none are."""
    runs = [run("c1", 20.0, 8), run("c4", 50.0, 8), run("c1", 22.0, 8), run("c4", 80.0, 8, rps=4.0)]
    runs += [run("c1", 24.0, 8), run("c4", 40.0, 8)]
    metrics = summarize(runs, SLO, Price(3.6, "test"), None, in_rounds=True).to_metrics()
    rounds = {key: value for key, value in metrics.items() if "/round_" in key}
    assert rounds == pytest.approx(
        {
            "cost/serving/goodput_tokens_per_s/round_1": 50.0,
            "cost/serving/goodput_tokens_per_s/round_2": 80.0,
            "cost/serving/goodput_tokens_per_s/round_3": 40.0,
            "cost/serving/goodput_requests_per_s/round_1": 50 / 16,
            "cost/serving/goodput_requests_per_s/round_2": 4.0,
            "cost/serving/goodput_requests_per_s/round_3": 40 / 16,
            "cost/serving/usd_per_mtok/round_1": 1000 / 50,
            "cost/serving/usd_per_mtok/round_2": 1000 / 80,
            "cost/serving/usd_per_mtok/round_3": 1000 / 40,
        }
    )
    assert all(has_entry(key) for key in rounds)
    assert not [key for key in summarize(runs, SLO, Price(3.6, "test"), None).to_metrics() if "/round_" in key]


def test_a_throughput_interval_reaching_zero_has_no_upper_dollar_end():
    runs = [run("c1", 1.0, 8), run("c1", 30.0, 8)]
    metrics = summarize(runs, SLO, Price(3.6, "test"), None).to_metrics()
    # 15.5 +- 12.706 * 14.5: below 0 by hand, and a throughput is not negative: the interval starts at 0
    assert metrics["cost/serving/goodput_tokens_per_s/ci95_low"] == 0.0
    assert metrics["cost/serving/goodput_tokens_per_s/ci95_high"] == pytest.approx(15.5 + T_975_1 * 14.5)
    assert "cost/serving/usd_per_mtok/ci95_low" in metrics and "cost/serving/usd_per_mtok/ci95_high" not in metrics


def test_one_run_says_why_it_has_no_interval():
    summary = summarize([run("c1", 20.0, 8)], SLO, None, None)
    assert "cost/serving/c1/output_tokens_per_s/ci95_low" not in summary.to_metrics()
    assert "no interval" in summary.unavailable()["c1/ci95"]


# --- the first-failure rule, over each level's runs ---------------------------------------------------------


@pytest.mark.parametrize(
    ("within", "best"),
    [
        # requests within every SLO in each level's 3 runs of 8 (levels c1, c2, c4, c8: load grows with streams)
        ({"c1": (8, 8, 8), "c2": (8, 8, 8), "c4": (8, 8, 8), "c8": (8, 8, 8)}, "c8"),
        # c2 pools 12 of 24 (upper bound 0.67 < 0.9: shown below): the lucky c4 and c8 after it do not count
        ({"c1": (8, 8, 8), "c2": (4, 4, 4), "c4": (8, 8, 8), "c8": (8, 8, 8)}, "c1"),
        # c4 pools 21 of 24 (87.5%, upper bound 0.96: missed, not shown below): c8 still counts
        ({"c1": (8, 8, 8), "c2": (8, 8, 8), "c4": (8, 6, 7), "c8": (8, 8, 8)}, "c8"),
        # one run's 8 of 8 does not rescue its level: 8 + 2 + 2 of 24 is shown below at c1
        ({"c1": (8, 2, 2), "c2": (8, 8, 8), "c4": (8, 8, 8), "c8": (8, 8, 8)}, None),
        # every level below the share, none shown below by its few requests: no goodput
        ({"c1": (7,), "c2": (7,), "c4": (7,), "c8": (7,)}, None),
    ],
)
def test_goodput_stops_at_the_first_level_shown_below_the_goal(within, best):
    rates = {"c1": 1.0, "c2": 2.0, "c4": 3.0, "c8": 3.5}
    runs = [run(label, 16 * rates[label], count) for label, counts in within.items() for count in counts]
    summary = summarize(runs, SLO, None, None)
    assert (summary.goodput.label if summary.goodput else None) == best
    assert goodput_level(summary.levels, SLO) == summary.goodput


# --- what rests on a contended level --------------------------------------------------------------------------

CONTENDED = {
    CONTENDED_LEVELS_TAG: "c4",
    LEVEL_CONTENTION_TAG + "c4": "contended: other processes kept 1.02 of its 2 cores busy",
    SINGLE_STREAM_FIGURES_TAG: "c1: cost/decode_tokens_per_s, cost/ttft_ms_p50",
}


@pytest.mark.parametrize(
    ("metric", "tags", "level"),
    [
        ("cost/serving/c4/output_tokens_per_s", CONTENDED, "c4"),
        ("cost/serving/c4/output_tokens_per_s/ci95_high", CONTENDED, "c4"),
        ("cost/serving/c1/output_tokens_per_s", CONTENDED, None),  # another level's own figure
        ("cost/serving/usd_per_mtok", CONTENDED, "c4"),  # goodput rests on every level up to its first failure
        ("cost/serving/peak_tokens_per_s", CONTENDED, "c4"),
        ("cost/decode_tokens_per_s", CONTENDED, None),  # from c1, which was quiet
        ("cost/decode_tokens_per_s", CONTENDED | {CONTENDED_LEVELS_TAG: "c1,c4"}, "c1"),
        ("cost/weight_bytes", CONTENDED, None),
        ("cost/serving/usd_per_mtok", {}, None),
    ],
)
def test_which_figures_rest_on_a_contended_level(metric, tags, level):
    why = rests_on_contention(metric, tags)
    assert (why is not None) == (level is not None)
    if level is not None:
        assert f"rests on load level {level}" in why and why.startswith(metric)


# --- each run's own reading ---------------------------------------------------------------------------------


def test_a_run_is_judged_on_the_samples_that_bracket_its_window():
    """Two cores, two server threads: the first run's window saw another core's worth of other work, the second's
    none. Each run's reading is the difference of the samples at or just outside its window."""
    samples = [
        Sample(at=0.0, load_1m=3.0, cpu_seconds=0.0, cores_busy_seconds=0.0),
        Sample(at=1.0, load_1m=3.0, cpu_seconds=1.0, cores_busy_seconds=2.0),  # 1 own, 1 other core busy
        Sample(at=5.0, load_1m=3.0, cpu_seconds=5.0, cores_busy_seconds=10.0),
        Sample(at=6.0, load_1m=3.0, cpu_seconds=6.9, cores_busy_seconds=12.0),  # quiet now
        Sample(at=10.0, load_1m=3.0, cpu_seconds=14.5, cores_busy_seconds=20.0),
    ]
    busy = reading_between(samples, 1.2, 4.8, threads=2, cores=2, machine_cpus=2)
    assert (busy.wall_seconds, busy.cpu_seconds, busy.cores_busy_seconds) == (4.0, 4.0, 8.0)  # samples 1.0 and 5.0
    assert busy.other_cores == pytest.approx(1.0) and judge_contention(busy, load_average=False).contended
    quiet = reading_between(samples, 6.0, 10.0, threads=2, cores=2, machine_cpus=2)
    assert quiet.other_cores == pytest.approx(0.1) and not judge_contention(quiet, load_average=False).contended
    # The same quiet window by the 1-minute load average (a minute of the past) would read as contended
    assert judge_contention(quiet.__class__(**{**quiet.__dict__, "load_before": 5.0, "load_after": 5.0})).contended
    assert reading_between(samples, 9.0, 11.0, threads=2, cores=2, machine_cpus=2) is None  # not covered


@pytest.mark.parametrize(
    ("measured", "warm_up", "slowed"),
    [
        (96.0, 51.0, True),  # 1.88x, 45 ms more: bf16's c4 run that served 31.7 tok/s against 61.6 in its other rounds
        (178.0, 58.5, True),  # 3.04x
        (76.0, 51.0, False),  # 1.49x: under the ratio
        (77.0, 51.0, True),  # 1.51x, 26 ms more
        (30.0, 12.0, True),  # 2.5x, 18 ms more
        (24.0, 12.0, False),  # 2x, but only 12 ms more: a tiny model's milliseconds jitter by that much
        (8.0, 3.0, False),  # 2.7x, 5 ms more
        (46.0, 60.0, False),  # faster than its warm-up: a slow warm-up leaves the measured figures whole
        (96.0, None, False),  # no warm-up request in guidellm's sample: nothing to compare with
        (math.nan, 51.0, False),  # no measured median
    ],
)
def test_a_run_measured_well_slower_than_its_own_warm_up_is_contended(measured, warm_up, slowed):
    verdict = judge_slowdown(measured, warm_up)
    assert (verdict is not None) == slowed
    if slowed:
        assert verdict.contended and verdict.cause == "it slowed while timed"
        assert f"{measured / warm_up:.2f}x its warm-up's ({warm_up:.1f} ms)" in verdict.reason


def test_a_quiet_run_that_slowed_while_timed_is_judged_contended_and_its_level_names_why():
    """A machine that slows with no process busy (another tenant of the host, the hypervisor) cannot be caused from
    inside a test: the runs are built by hand, on counters where the server's own work kept the cores busy."""
    sampler = LoadSampler(threads=2)
    sampler.samples = [
        Sample(at=float(at), load_1m=0.0, cpu_seconds=2.0 * at, cores_busy_seconds=2.0 * at) for at in range(5)
    ]
    steady = run("c1", 20.0, 2, 2, itl_ms_p50=50.0, started_at=0.5, ended_at=1.5, warm_up_itl_ms=48.0)
    slowed = replace(steady, itl_ms_p50=96.0, started_at=2.5, ended_at=3.5, warm_up_itl_ms=51.0)
    first, second = _run_verdicts([steady, slowed], sampler)
    assert not first.contended and first.reason.startswith("not contended: other processes kept 0.00")
    assert second.contended and "1.88x its warm-up's (51.0 ms)" in second.reason
    tags = {CONTENDED_LEVELS_TAG: "c1", LEVEL_CONTENTION_TAG + "c1": second.reason}
    assert rests_on_contention("cost/serving/c1/output_tokens_per_s", tags) == (
        "cost/serving/c1/output_tokens_per_s rests on load level c1, timed while contended (its measured requests' "
        "median inter-token latency, 96.0 ms, was 1.88x its warm-up's (51.0 ms), with no other process's work to show "
        "for it: the machine slowed while it was timed)"
    )


# --- the scenario ---------------------------------------------------------------------------------------------


def test_each_level_runs_back_to_back_and_a_half_share_warms_few_requests(tmp_path):
    settings = ServingSettings(concurrency=[1, 4], requests_per_level=2, repeats=3)
    found = scenario(settings, "transformers", "http://127.0.0.1:9", tmp_path, None, tmp_path / "r.json")
    assert [level["profile.streams"] for level in found["benchmarks"]] == [1, 1, 1, 4, 4, 4]
    # A quarter would send 8 and 32 a run, a half 6 and 16: two waves of warm-up are most of what c4 sends
    assert warmup_share(settings) == 0.5 and found["spec"]["profile"]["warmup"]["percent"] == 0.5
    assert [level["constraints[0].count"] for level in found["benchmarks"]] == [6, 6, 6, 16, 16, 16]
    assert level_requests(settings, 4, warmup_share(settings)) == (16, 8)
    again = scenario(settings, "transformers", "u", tmp_path, None, tmp_path / "r.json", runs=[4, 1])
    assert [level["profile.streams"] for level in again["benchmarks"]] == [4, 1]


def test_profiles_that_choose_their_levels_run_once(tmp_path):
    settings = ServingSettings(profile="goodput", repeats=3)
    assert settings.runs_per_level() == 1
    assert scenario(settings, "vllm", "u", tmp_path, None, tmp_path / "r.json")["benchmarks"] == []


# --- pick on a measured cost --------------------------------------------------------------------------------

USD = "cost/serving/usd_per_mtok"


def variant(name: str, usd: float, low: float | None, high: float | None, tags: dict | None = None) -> VariantSummary:
    metrics = {USD: usd} | ({f"{USD}/ci95_low": low} if low is not None else {})
    metrics |= {f"{USD}/ci95_high": high} if high is not None else {}
    return VariantSummary(name, name, True, metrics, tags or {}, is_baseline=name == "bf16")


def test_pick_ranks_a_measured_cost_by_its_upper_bound():
    """int4 looks cheapest on its mean, but its runs spread: fp8's upper bound is lower, so fp8 ranks first."""
    variants = [variant("bf16", 3.0, 2.9, 3.1), variant("fp8", 1.5, 1.4, 1.6), variant("int4", 1.0, 0.5, 3.0)]
    decision = pick(variants, "bf16", Policy(max_drop_any_task=None), Axis(USD, False))
    assert decision.chosen == "fp8"
    assert objective_bound(variants[2], Axis(USD, False)) == 3.0
    assert "ranked by its 95% upper bound" in decision.summary
    assert decision.verdict("int4").reasons == (f"ranks after fp8 by the 95% upper bound of {USD}: $3 vs $1.6",)


def test_pick_leaves_a_contended_figure_out_and_says_so_in_one_line():
    tags = {CONTENDED_LEVELS_TAG: "c4", LEVEL_CONTENTION_TAG + "c4": "contended: other processes kept 1.02 busy"}
    variants = [variant("bf16", 3.0, 2.9, 3.1), variant("fp8", 1.5, 1.4, 1.6, tags)]
    decision = pick(variants, "bf16", Policy(max_drop_any_task=None), Axis(USD, False))
    assert decision.chosen == "bf16" and decision.verdict("fp8").status is Status.REJECTED
    lines = [line for line in decision.warnings if "left out of the decision" in line]
    assert lines == [
        f"fp8: left out of the decision: {USD} rests on load level c4, timed while contended "
        "(other processes kept 1.02 busy)"
    ]
    assert cost_warnings(variants, [USD]) == decision.warnings
