"""Serving figures that mean what they say (issue 28, items 7-10), as tables against independent computations:
nearest-rank percentiles kept only where a level's requests support them, checked on guidellm's real reports;
guidellm's own warm-up; goodput as DistServe and vLLM define it, with requests cut off by a level's time limit left
out; the prefill-aware ceiling by hand; one bandwidth probe per sweep and host."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from quantlab.measure.bandwidth import probe_path, sweep_bandwidth
from quantlab.measure.modeled import ModelShape
from quantlab.serving.goodput import clopper_pearson, goodput_level, misses, not_counted, summarize
from quantlab.serving.levels import LoadLevel, load_levels, min_requests, supports
from quantlab.serving.load import scenario
from quantlab.serving.measured import WARMUP_WAVES, level_requests
from quantlab.serving.pricing import fastest_prefill, modeled_served_tokens_per_s
from quantlab.serving.settings import ServiceLevels, ServingSettings

DATA = Path(__file__).parent / "data"
REPORT = DATA / "guidellm-report-c1-c4.json"  # a real guidellm 0.8.1 run, trimmed: 8 requests per level
# A real guidellm 0.8.1 run through quantlab's scenario (transformers serve, a 38M random Llama on 2 busy CPU cores,
# 16 + 16 tokens, c1 and c4, requests_per_level 8, its warm-up), trimmed to the fields read here, with each
# request's own timings kept (guidellm's metrics.sample_size raised to keep every request).
WARMED = DATA / "guidellm-report-warmup-c1-c4.json"
# guidellm-report-c1-c4.json edited by hand (see its metadata.edited_by_hand): c4 with 3 requests cut off by a
# max_duration constraint, as serving.seconds_per_level makes them.
CUT_OFF = DATA / "guidellm-report-c1-c4-cutoff.json"
DISTRIBUTIONS = {"ttft_ms": "time_to_first_token_ms", "itl_ms": "inter_token_latency_ms"}
DISTRIBUTIONS["tpot_ms"] = "time_per_output_token_ms"


# --- percentiles the sample supports -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("q", "n", "supported"),
    [(50, 1, False), (50, 2, True), (90, 9, False), (90, 10, True), (99, 8, False), (99, 99, False), (99, 100, True)]
    + [(95, 19, False), (95, 20, True), (75, 3, False), (75, 4, True)],
)
def test_a_percentile_needs_enough_requests_to_be_more_than_their_maximum(q, n, supported):
    """Independently: numpy's nearest-rank percentile ('inverted_cdf') of 1..n is below n exactly when supported."""
    assert supports(q, n) == supported
    assert (np.percentile(np.arange(1, n + 1), q, method="inverted_cdf") < n) == supported
    least = min_requests(q)  # the fewest that support it: the table's True rows are these
    assert supports(q, least) and not supports(q, least - 1) and (n == least) == (supported and not supports(q, n - 1))


def _window(benchmark: dict, latency: str) -> list[dict]:
    """The requests guidellm measures a latency over: those overlapping its measured window, TTFT's by first token."""
    lo = benchmark["scheduler_metrics"]["measure_start_time"]
    hi = benchmark["scheduler_metrics"]["measure_end_time"]

    def first(request: dict) -> float:
        return request["request_start_time"] + request["time_to_first_token_ms"] / 1000

    if latency == "ttft_ms":
        return [r for r in benchmark["requests"]["successful"] if first(r) >= lo and r["request_start_time"] <= hi]
    return [r for r in benchmark["requests"]["successful"] if r["request_end_time"] >= lo and first(r) <= hi]


def test_guidellms_percentiles_are_nearest_rank_over_its_measured_requests():
    """Each reported percentile is the ceil(q n / 100)-th smallest of the measured requests' own values (numpy's
    'inverted_cdf'); where q n / 100 is whole, guidellm's floating cumulative shares may take the next rank (its p50
    of c4's 20 TTFTs is the 11th). The maximum is the maximum."""
    report = json.loads(WARMED.read_text())
    for benchmark in report["benchmarks"]:
        for latency, name in DISTRIBUTIONS.items():
            values = np.sort([request[name] for request in _window(benchmark, latency)])
            reported = benchmark["metrics"][name]["successful"]
            assert reported["max"] == pytest.approx(values[-1])
            for key, q in (("p10", 10), ("p25", 25), ("p50", 50), ("p75", 75), ("p90", 90), ("p99", 99)):
                rank = math.ceil(q * len(values) / 100)
                allowed = {rank, rank + 1} if q * len(values) % 100 == 0 else {rank}
                assert reported["percentiles"][key] in {values[r - 1] for r in allowed if r <= len(values)}, key
                assert np.percentile(values, q, method="inverted_cdf") == values[rank - 1]


def test_a_level_logs_the_percentiles_its_requests_support_and_the_maximum_otherwise():
    """8 requests at c1, 20 timed TTFTs at c4 (23 measured): p50 kept, p99 (their maximum) left out and said so."""
    report = json.loads(WARMED.read_text())
    levels = load_levels(report)
    for level, benchmark in zip(levels, report["benchmarks"]):
        for latency, name in DISTRIBUTIONS.items():
            values = [request[name] for request in _window(benchmark, latency)]
            assert getattr(level, f"{latency}_max") == pytest.approx(max(values))
            assert math.isnan(getattr(level, f"{latency}_p99"))
            assert getattr(level, f"{latency}_p50") == benchmark["metrics"][name]["successful"]["percentiles"]["p50"]
            assert level.tail(latency) == getattr(level, f"{latency}_max")
        figures = level.figures()
        assert not any(key.endswith("_p99") for key in figures) and "ttft_ms_max" in figures
        assert list(level.left_out()) == ["p99"] and "needs at least 100" in level.left_out()["p99"]
    c1, c4 = levels
    assert (c1.succeeded, c1.sampled, c4.succeeded, c4.sampled) == (8, None, 23, 20)
    assert "20 requests timed at c4" in c4.left_out()["p99"]


def test_the_first_report_s_p99_of_8_requests_is_its_maximum_and_is_logged_as_the_maximum():
    report = json.loads(REPORT.read_text())
    for level, benchmark in zip(load_levels(report), report["benchmarks"]):
        ttft = benchmark["metrics"]["time_to_first_token_ms"]["successful"]
        assert ttft["count"] == 8 and ttft["percentiles"]["p99"] == ttft["max"]  # nearest rank: rank 8 of 8
        assert level.ttft_ms_max == ttft["max"] and math.isnan(level.ttft_ms_p99)
        metrics = summarize([level], ServiceLevels(), None, None).to_metrics()
        assert f"cost/serving/{level.label}/ttft_ms_max" in metrics
        assert f"cost/serving/{level.label}/ttft_ms_p99" not in metrics


# --- guidellm's warm-up ---------------------------------------------------------------------------------------


def test_the_warm_up_leaves_each_stream_s_first_two_waves_out_of_the_real_report():
    """In the real run (requests_per_level 8): the first 2c requests sent at each level are in no figure, and at
    least 8 are measured."""
    report = json.loads(WARMED.read_text())
    for benchmark, streams in zip(report["benchmarks"], (1, 4)):
        assert benchmark["config"]["warmup"]["percent"] == 0.25
        measured = {id(r) for latency in DISTRIBUTIONS for r in _window(benchmark, latency)}
        sent = sorted(benchmark["requests"]["successful"], key=lambda request: request["request_start_time"])
        assert not measured & {id(request) for request in sent[: WARMUP_WAVES * streams]}
        assert benchmark["metrics"]["request_totals"]["successful"] >= 8


def test_each_run_s_warm_up_pace_is_the_median_itl_of_its_requests_done_before_its_window_opened():
    """The pace the serve stage holds a run's measured requests against (quantlab.measure.contention.judge_slowdown),
    by hand from each request's own timings in the real run."""
    report = json.loads(WARMED.read_text())
    for level, benchmark in zip(load_levels(report), report["benchmarks"]):
        opened = benchmark["scheduler_metrics"]["measure_start_time"]
        requests = benchmark["requests"]["successful"]
        done_before = [r["inter_token_latency_ms"] for r in requests if r["request_end_time"] < opened]
        assert len(done_before) >= WARMUP_WAVES * int(level.label.removeprefix("c"))
        assert level.warm_up_itl_ms == pytest.approx(float(np.median(done_before)))
    assert load_levels(json.loads(REPORT.read_text()))[0].warm_up_itl_ms is None  # trimmed of its requests' timings


@pytest.mark.parametrize(
    ("requests", "concurrency", "sent", "share"),
    [
        # a quarter would send 12 and 32 (44): two waves of 4 streams are most of what c4 sends, a half sends 42
        (8, [1, 4], [18, 24], 0.5),
        (128, [1, 8, 32, 64], [172, 184, 256, 512], 0.25),
        (100, [2], [136], 0.25),
    ],
)
def test_each_level_sends_its_warm_up_on_top_of_the_requests_it_measures(tmp_path, requests, concurrency, sent, share):
    """guidellm leaves out the first int(share * sent) + 1 requests to complete, and TTFT's window the up to
    streams - 1 others then in flight: the share of what a level sends covers two waves of its streams, and the rest
    less streams is at least requests_per_level; of a quarter and a half, the one that sends fewer in all."""
    settings = ServingSettings(requests_per_level=requests, concurrency=concurrency, slo={"ttft_ms": 700}, repeats=1)
    found = scenario(settings, "transformers", "http://127.0.0.1:9", tmp_path, None, tmp_path / "r.json")
    spec = found["spec"]
    assert spec["profile"]["warmup"] == {"percent": share, "mode": "requests"}
    assert spec["metrics"]["slo"] == {"ttft_ms": 700, "tpot_ms": 200}  # guidellm's tpot_ms is each request's ITL
    counts = [level["constraints[0].count"] for level in found["benchmarks"]]
    assert counts == sent == [level_requests(settings, streams, Fraction(share))[0] for streams in concurrency]
    for streams, count in zip(concurrency, counts):
        warmup = int(share * count)
        assert warmup >= 2 * streams and count - warmup - streams >= requests
    # guidellm's data worker makes no more requests ahead than the busiest level sends (its default: 4096)
    assert spec["data_loader"] == {"kind": "pytorch", "prefetch_factor": max(sent)}


def test_guidellms_goodput_search_aims_at_the_recipe_s_share(tmp_path):
    settings = ServingSettings(profile="goodput", slo={"attainment": 0.95})
    spec = scenario(settings, "vllm", "u", tmp_path, None, tmp_path / "r.json")["spec"]
    assert spec["profile"]["target_attainment"] == 0.95 and spec["profile"]["warmup"]["percent"] == 0.25
    assert spec["constraints"][0]["count"] == level_requests(settings, None)[0] == 12
    assert spec["data_loader"]["prefetch_factor"] == 12


# --- goodput as the field defines it ---------------------------------------------------------------------------


def _level(label: str, rps: float, attainment: float | None, errors: int = 0, incomplete: int = 0) -> LoadLevel:
    latencies = {f"{latency}_{q}": 10.0 for latency in DISTRIBUTIONS for q in ("p50", "p99", "max")}
    return LoadLevel(
        label=label,
        strategy="concurrent",
        concurrency=1,
        output_tokens_per_s=16 * rps,
        requests_per_s=rps,
        **latencies,
        succeeded=20,
        errors=errors,
        incomplete=incomplete,
        output_tokens_min=16,
        slo_attainment=attainment,
    )


@pytest.mark.parametrize(
    ("levels", "share", "best"),
    [
        ([_level("c1", 1, 1.0), _level("c4", 3, 0.95)], 0.9, "c4"),  # both reach 90%: the higher load
        ([_level("c1", 1, 1.0), _level("c4", 3, 0.85)], 0.9, "c1"),  # c4 below 90%
        ([_level("c1", 1, 0.89), _level("c4", 3, 0.9)], 0.9, "c4"),  # the highest load that reaches it
        ([_level("c1", 1, 1.0), _level("c4", 3, 0.9, errors=2)], 0.9, "c4"),  # 2 errors of 20: 90% still met
        ([_level("c1", 1, 1.0), _level("c4", 3, 0.95)], 0.99, "c1"),  # the share is the recipe's
        ([_level("c1", 1, 0.5), _level("c4", 3, 0.0)], 0.9, None),
        ([_level("c1", 1, None)], 0.9, None),  # guidellm judged no request
        ([_level("c8", 2.5, 1.0), _level("c4", 3, 1.0)], 0.9, "c4"),  # load by requests/s, not by streams
    ],
)
def test_goodput_is_the_highest_load_at_which_the_share_of_requests_meets_every_slo(levels, share, best):
    """DistServe's goodput (and vLLM's benchmark's --goodput share): the expected level by hand."""
    found = goodput_level(levels, ServiceLevels(attainment=share))
    assert (found.label if found else None) == best


def test_a_level_below_the_share_says_why():
    slo = ServiceLevels(ttft_ms=500, itl_ms=100)
    assert misses(_level("c4", 3, 0.85, errors=1), slo) == "85% of requests within every SLO (1 errored) < 90%"
    assert misses(_level("c4", 3, None), slo) == "guidellm judged no request against the SLOs"
    summary = summarize([_level("c4", 3, 0.5)], slo, None, None)
    assert summary.to_tags("transformers")["quantlab.serving.goodput_definition"] == (
        "DistServe's: the highest load level (by requests/s) with at least 90% of requests with TTFT <= 500 ms and "
        "ITL <= 100 ms, none counted after the first level shown below that share (95% exact upper bound). vLLM's "
        "request goodput (requests within every SLO per second at one level) is each level's good_requests_per_s"
    )
    runs = summarize([_level("c4", 3, 0.5)] * 3, slo, None, None).definition()
    assert "each level's share counted over the requests of its 3 runs" in runs
    assert summary.unavailable()["goodput"] == "c4: 50% of requests within every SLO < 90%"


def _judged(label: str, in_flight: float, rps: float, within: int, of: int) -> LoadLevel:
    """A level whose `within` of `of` requests met every SLO, at `in_flight` mean requests in flight."""
    return replace(_level(label, rps, within / of), concurrency=in_flight, succeeded=of)


@pytest.mark.parametrize(
    ("levels", "best", "why_not"),
    [
        # 10 of 20 at c4: its 95% upper bound, 70%, is under 90%; c8's lucky 20 of 20 after it does not count
        (
            [_judged("c1", 1, 1, 20, 20), _judged("c4", 4, 3, 10, 20), _judged("c8", 8, 5, 20, 20)],
            "c1",
            {
                "c4": "50% of requests within every SLO < 90%",
                "c8": "not counted: c4 before it is shown below 90% within every SLO (50% of 20 requests, 95% upper "
                "bound 69.8%)",
            },
        ),
        # 17 of 20 at c4 misses 90%, but is not shown below it (upper bound 96%): c8 still counts
        ([_judged("c1", 1, 1, 20, 20), _judged("c4", 4, 3, 17, 20), _judged("c8", 8, 5, 20, 20)], "c8", {}),
        # listed out of order: taken by requests in flight
        ([_judged("c8", 8, 5, 20, 20), _judged("c1", 1, 1, 20, 20), _judged("c4", 4, 3, 2, 20)], "c1", {}),
    ],
)
def test_no_level_counts_after_the_first_shown_below_the_goal(levels, best, why_not):
    slo = ServiceLevels()
    found = goodput_level(levels, slo)
    assert (found.label if found else None) == best
    if why_not:
        assert not_counted(levels, slo) == why_not


@pytest.mark.parametrize(
    ("successes", "trials", "lower", "upper"),
    [
        (8, 8, 0.05 ** (1 / 8), 1.0),  # the 8 of 8: over 69% at 95%
        (0, 8, 0.0, 1 - 0.05 ** (1 / 8)),
        (10, 20, 0.3020, 0.6980),  # scipy.stats.binomtest(10, 20).proportion_ci(0.90, "exact")
        (17, 20, 0.6563, 0.9578),
    ],
)
def test_attainment_bounds_are_clopper_pearsons(successes, trials, lower, upper):
    assert clopper_pearson(successes, trials, 0.05) == pytest.approx((lower, upper), abs=1e-4)
    level = _judged("c4", 4, 3, successes, trials)
    metrics = summarize([level], ServiceLevels(), None, None).to_metrics()
    assert metrics["cost/serving/c4/slo_attainment_lower"] == pytest.approx(lower, abs=1e-4)
    assert metrics["cost/serving/c4/slo_attainment_upper"] == pytest.approx(upper, abs=1e-4)
    # vLLM's request goodput: 3 requests/s over 20 requests is a 6.67 s window
    assert metrics["cost/serving/c4/good_requests_per_s"] == pytest.approx(successes / (trials / 3))


def test_requests_cut_off_by_the_time_limit_do_not_remove_goodput():
    """c4 with 3 requests cut off (the edited report): guidellm's attainment leaves them out (1.0), and so does
    goodput: c4, the higher load, is it; it logs the cut-off count."""
    c1, c4 = load_levels(json.loads(CUT_OFF.read_text()))
    assert (c4.incomplete, c4.succeeded, c4.slo_attainment) == (3, 8, 1.0)
    summary = summarize([c1, c4], ServiceLevels(ttft_ms=500, itl_ms=200), None, None)
    assert summary.goodput is c4
    metrics = summary.to_metrics()
    assert metrics["cost/serving/goodput_requests_per_s"] == c4.requests_per_s
    assert metrics["cost/serving/c4/incomplete"] == 3


def test_old_slo_keys_are_refused_with_their_new_names():
    with pytest.raises(ValueError, match="ttft_p99_ms is now ttft_ms: a limit on each request"):
        ServiceLevels(ttft_p99_ms=1000)
    with pytest.raises(ValueError, match="less than 1"):
        ServiceLevels(attainment=1.0)


# --- the ceiling, prefill included; one bandwidth probe per sweep ----------------------------------------------

# K and V of 10 layers x 5 heads x 500 dims in BF16: kv = 10 * 5 * 500 * 2 * 2 = 1e5 bytes per token; tied
# embeddings, so all 1e9 weight bytes are streamed.
SHAPE = ModelShape(
    hidden_size=100,
    num_layers=10,
    num_attention_heads=5,
    num_kv_heads=5,
    head_dim=500,
    intermediate_size=100,
    vocab_size=100,
    tie_word_embeddings=True,
)


@pytest.mark.parametrize(
    ("prefill_rate", "batch", "expected"),
    [
        # prefill max(1.04e9 / 1e11, 400 / 4000) = 0.1 s; decode 9 * (1e9 + 4e5 * 105) / 1e11 = 0.09378 s
        (4000, 4, 40 / (0.1 + 0.09378)),
        # memory-bound prefill 0.0104 s: about one more decode step, which yields the first token
        (None, 4, 40 / (0.0104 + 0.09378)),
        # prefill max(1.01e9 / 1e11, 100 / 4000) = 0.025 s; decode 9 * (1e9 + 1e5 * 105) / 1e11 = 0.090945 s
        (4000, 1, 10 / (0.025 + 0.090945)),
        # a prefill faster than the bandwidth allows changes nothing: 0.0104 s > 400 / 1e6
        (1e6, 4, 40 / (0.0104 + 0.09378)),
    ],
)
def test_the_served_ceiling_counts_prefill(prefill_rate, batch, expected):
    """1e9 streamed bytes, 1e5 KV bytes per token, 100 prompt + 10 output tokens, 1e11 B/s (hand calculation)."""
    found = modeled_served_tokens_per_s(SHAPE, 1e9, 2, 1e11, prefill_rate, 100, 10, batch)
    assert found == pytest.approx(expected, rel=1e-9)


def test_the_fastest_prefill_timed_is_the_one_the_ceiling_uses():
    metrics = {
        "cost/prefill_tokens_per_s": 300.0,
        "cost/prefill_tokens_per_s_bs4": 900.0,
        "cost/decode_tokens_per_s": 1e4,
    }
    assert fastest_prefill(metrics) == 900.0 and fastest_prefill({}) is None


def test_one_bandwidth_probe_per_sweep_and_host(tmp_path):
    """The first variant's probe is every later one's (two probes of a busy machine never agree to the last bit);
    no sweep folder: a probe of its own each time."""
    device = torch.device("cpu")
    first = sweep_bandwidth(tmp_path, device, 1 << 20, 2)
    assert first.bytes_per_s > 0 and "taken once for the sweep on this host" in first.method
    assert probe_path(tmp_path, device).is_file()
    again = [sweep_bandwidth(tmp_path, device, 1 << 20, 2) for _ in range(3)]
    assert all(reading == first for reading in again)
    alone = [sweep_bandwidth(None, device, 1 << 20, 2).bytes_per_s for _ in range(3)]
    assert len(set(alone)) > 1
