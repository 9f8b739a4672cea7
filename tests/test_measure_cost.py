"""measure_cost end to end on a tiny random Llama saved to disk, on CPU."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny import tiny_llama_config

from quantlab.measure.cost import BatchFigures, _percentile, measure_cost
from quantlab.measure.settings import MeasureSettings
from quantlab.measure.timing import GenerationTiming
from quantlab.metrics import spec
from quantlab.repeats import Interval
from quantlab.stages.measure import measure

REPO = Path(__file__).resolve().parents[1]
MEASURED_KEYS = [
    "cost/load_seconds",
    "cost/peak_memory_bytes",
    "cost/prefill_tokens_per_s",
    "cost/decode_tokens_per_s",
    "cost/ttft_ms_p50",
    "cost/itl_ms_p50",
    "cost/roofline_efficiency",
]
MODELED_KEYS = [
    "cost/weight_bytes",
    "cost/weight_bytes_in_memory",
    "cost/bits_per_weight",
    "cost/kv_bytes_per_token",
    "cost/max_concurrent_sequences",
    "cost/roofline_decode_tokens_per_s",
    "cost/usd_per_million_output_tokens",
]
SMALL = dict(
    prompt_tokens=8,
    output_tokens=4,
    warmup=1,
    repeats=2,
    bandwidth_probe_bytes=4_000_000,
    bandwidth_probe_repeats=2,
    target={"accelerator": "L4", "price_per_hour": 0.8},
)


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    from transformers import LlamaForCausalLM

    config = tiny_llama_config(max_position_embeddings=128)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-measure")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def report(tiny_model, tiny_checkpoint):
    settings = MeasureSettings(batch_sizes=[1, 2], **SMALL)
    return measure_cost(tiny_model, None, settings, tiny_checkpoint, load_seconds=0.25)


def test_every_measured_and_modeled_key_is_there_and_positive(report):
    metrics = report.to_metrics()
    for key in MEASURED_KEYS + MODELED_KEYS:
        assert key in metrics, key
        assert metrics[key] > 0, key
    assert metrics["cost/load_seconds"] == 0.25
    assert metrics["cost/bits_per_weight"] == pytest.approx(32.0)


def test_a_tail_percentile_is_logged_only_where_the_timings_support_it(report):
    """2 timed runs of 4 tokens: their TTFT p99 would be their maximum, not a tail; 6 decode steps no ITL p90."""
    metrics, tags = report.to_metrics(), report.to_tags()
    for figure in ("ttft_ms_p90", "ttft_ms_p99", "itl_ms_p90", "itl_ms_p99"):
        assert f"cost/{figure}" not in metrics, figure
    assert tags["quantlab.cost.unavailable.ttft_ms_p99"] == (
        "2 timed runs: a p99 needs at least 100 (the p99 of 2 is their maximum)"
    )
    assert tags["quantlab.cost.unavailable.itl_ms_p90"].startswith("6 decode steps: a p90 needs at least 10")


@pytest.mark.parametrize(
    ("count", "q", "kept"),
    [(2, 50, True), (3, 90, False), (10, 90, True), (99, 99, False), (100, 99, True), (1, 50, True)],
)
def test_which_percentiles_a_count_supports(count, q, kept):
    values = [float(value) for value in range(1, count + 1)]
    found = _percentile(values, q, "runs")
    assert isinstance(found, float) is kept
    if kept:
        assert found == pytest.approx(np.percentile(values, q)) and found <= max(values)


def test_other_batch_sizes_carry_their_size_in_the_key(report):
    metrics = report.to_metrics()
    assert metrics["cost/decode_tokens_per_s_bs2"] > 0
    assert "cost/ttft_ms_p50_bs2" in metrics
    assert not any(key.endswith("_bs1") for key in metrics)


def test_gpu_only_figures_are_absent_with_a_reason_never_zero(report):
    metrics, tags = report.to_metrics(), report.to_tags()
    for figure in ("energy_joules_per_token", "energy_joules_per_token_bs2", "peak_device_memory_bytes"):
        assert f"cost/{figure}" not in metrics
        assert "no CUDA device" in tags[f"quantlab.cost.unavailable.{figure}"]


def test_figures_say_which_engine_kernel_path_and_hardware_produced_them(report):
    tags = report.to_tags()
    assert tags["quantlab.cost.engine"].startswith("transformers ")
    assert tags["quantlab.cost.kernel_path"] == "FP32 matmul (15 Linear) on CPU"
    assert tags["quantlab.cost.hardware"].startswith("CPU: ")
    assert tags["quantlab.cost.clock"] == "time.perf_counter"
    assert tags["quantlab.cost.target"].startswith("L4: ")
    assert all(key.startswith("quantlab.cost.") for key in tags)


def test_decode_is_timed_step_by_step(report):
    default, larger = report.measured.batches
    assert (default.batch_size, larger.batch_size) == (1, 2)
    assert default.roofline_efficiency == pytest.approx(
        default.decode_tokens_per_s / default.local_roofline_decode_tokens_per_s
    )


def test_cpu_threads_apply_during_the_measurement_only(tiny_model, tiny_checkpoint):
    before = torch.get_num_threads()
    settings = MeasureSettings(cpu_threads=1, **SMALL)
    report = measure_cost(tiny_model, None, settings, tiny_checkpoint)
    assert "1 torch threads" in report.to_tags()["quantlab.cost.hardware"]
    assert torch.get_num_threads() == before
    assert "load_seconds" in report.unavailable()


def test_disabled_measurement_keeps_the_modeled_figures(tiny_model, tiny_checkpoint):
    report = measure_cost(tiny_model, None, MeasureSettings(enabled=False, **SMALL), tiny_checkpoint, 0.1)
    metrics = report.to_metrics()
    assert "cost/decode_tokens_per_s" not in metrics
    assert metrics["cost/weight_bytes"] > 0
    assert report.to_tags()["quantlab.cost.unavailable.decode_tokens_per_s"] == "measure.enabled is false"


def test_a_workload_longer_than_the_model_allows_is_refused(tiny_model, tiny_checkpoint):
    settings = MeasureSettings(prompt_tokens=120, output_tokens=16)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        measure_cost(tiny_model, None, settings, tiny_checkpoint)


def test_the_runner_stage_returns_metrics_and_tags(tiny_model, tiny_checkpoint):
    metrics, tags = measure(tiny_model, None, MeasureSettings(**SMALL), tiny_checkpoint, 0.5)
    assert metrics["cost/decode_tokens_per_s"] > 0
    assert tags["quantlab.cost.kernel_path"]


def test_the_spread_table_of_the_benchmark_script():
    spec = importlib.util.spec_from_file_location("measure_spread", REPO / "benchmarks" / "measure_spread.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    rows = script.spread_rows([{"a": 10.0, "b": 0.0}, {"a": 12.0, "b": 0.0}, {"a": 11.0}])
    assert rows == [("a", 3, 11.0, 10.0, 12.0, pytest.approx(2 / 11)), ("b", 2, 0.0, 0.0, 0.0, None)]
    assert "n/a" in script.format_table(rows)


# --- Each figure measured once: batch size 1 left to the serve stage's single-stream level -----------------------


def test_a_batch_size_left_to_the_serve_stage_is_not_timed_but_its_memory_and_roofline_are(
    tiny_model, tiny_checkpoint, tmp_path
):
    from quantlab.measure.cost import SingleStream

    stream = SingleStream("c1", prompt_tokens=6, output_tokens=4)
    settings = MeasureSettings(batch_sizes=[1, 2], **SMALL)
    # One sweep's probe folder for both measurements: they divide by the same bandwidth, as a sweep's variants do
    # (two probes differ by tens of percent on a busy machine, which a comparison of ceilings must not see).
    probe_dir = tmp_path / "sweep"
    report = measure_cost(tiny_model, None, settings, tiny_checkpoint, 0.25, probe_dir, single_stream=stream)
    metrics, tags = report.to_metrics(), report.to_tags()
    for name in ("decode_tokens_per_s", "prefill_tokens_per_s", "ttft_ms_p50", "itl_ms_p50", "roofline_efficiency"):
        assert f"cost/{name}" not in metrics, name  # the serve stage logs these
        assert f"quantlab.cost.unavailable.{name}" not in tags, name  # ... so they are not "unavailable"
    for name in ("ttft_ms_p90", "ttft_ms_p99", "itl_ms_p90", "itl_ms_p99", "energy_joules_per_token"):
        assert "serve stage's c1 level" in tags[f"quantlab.cost.unavailable.{name}"], name
    assert metrics["cost/peak_memory_bytes"] > 0 and metrics["cost/local_roofline_decode_tokens_per_s"] > 0
    assert metrics["cost/decode_tokens_per_s_bs2"] > 0  # batch size 2 is still this stage's, and timed
    assert "serve stage's c1 level" in tags["quantlab.cost.single_stream"]
    assert report.contention() is not None  # batch size 2 was timed: its verdict stands

    # The roofline is the served workload's (6 + 4 tokens), not the loop's (8 + 4): a shorter context is faster.
    timed_here = measure_cost(
        tiny_model, None, MeasureSettings(batch_sizes=[1], **SMALL), tiny_checkpoint, 0.25, probe_dir
    )
    here = timed_here.to_metrics()["cost/local_roofline_decode_tokens_per_s"]
    assert metrics["cost/local_roofline_decode_tokens_per_s"] > here


def test_with_only_batch_size_1_left_to_the_serve_stage_nothing_is_timed_and_no_verdict_is_made(
    tiny_model, tiny_checkpoint
):
    from quantlab.measure.cost import SingleStream

    stream = SingleStream("sync", prompt_tokens=8, output_tokens=4)
    report = measure_cost(tiny_model, None, MeasureSettings(**SMALL), tiny_checkpoint, single_stream=stream)
    metrics, tags = report.to_metrics(), report.to_tags()
    assert report.contention() is None and "quantlab.cost.host_load" not in tags
    assert not any(key.startswith("measure/") for key in metrics)
    assert metrics["cost/peak_memory_bytes"] > 0 and metrics["cost/measured_bandwidth_bytes_per_s"] > 0
    assert "timed here: none" in tags["quantlab.cost.workload"]


@pytest.mark.parametrize(
    ("ttft_ms", "itl_ms", "roofline", "expected"),
    [
        # 32 prompt tokens in 80 ms: 400 tokens/s; a 40 ms gap between tokens: 25 tokens/s; half a 50 tokens/s roofline
        (80.0, 40.0, 50.0, {"prefill_tokens_per_s": 400.0, "decode_tokens_per_s": 25.0, "roofline_efficiency": 0.5}),
        (80.0, 40.0, None, {"prefill_tokens_per_s": 400.0, "decode_tokens_per_s": 25.0}),  # no roofline: no ratio
        (160.0, 10.0, 200.0, {"prefill_tokens_per_s": 200.0, "decode_tokens_per_s": 100.0, "roofline_efficiency": 0.5}),
    ],
)
def test_the_single_stream_figures_come_from_the_levels_medians(ttft_ms, itl_ms, roofline, expected):
    from quantlab.measure.cost import SingleStream

    figures = SingleStream("c1", prompt_tokens=32, output_tokens=16).figures(ttft_ms, itl_ms, roofline)
    assert figures == pytest.approx(expected | {"ttft_ms_p50": ttft_ms, "itl_ms_p50": itl_ms})


def test_the_timed_throughputs_are_logged_with_their_interval_over_the_repeats(report):
    """2 repeats per batch size: each throughput is their mean, with its 95% t interval around it."""
    metrics = report.to_metrics()
    for figure in (
        "prefill_tokens_per_s",
        "decode_tokens_per_s",
        "prefill_tokens_per_s_bs2",
        "decode_tokens_per_s_bs2",
    ):
        low, high = metrics[f"cost/{figure}/ci95_low"], metrics[f"cost/{figure}/ci95_high"]
        assert low <= metrics[f"cost/{figure}"] <= high, figure
        assert spec(f"cost/{figure}/ci95_low").timed and spec(f"cost/{figure}/ci95_high").higher_is_better
    for figure in ("ttft_ms_p50", "itl_ms_p50", "roofline_efficiency"):  # not throughputs: no interval
        assert f"cost/{figure}/ci95_low" not in metrics, figure


def _timing(first_token_s: float, decode_step_s: float, batch_size: int = 2) -> GenerationTiming:
    return GenerationTiming(
        batch_size, prompt_tokens=16, first_token_s=first_token_s, inter_token_s=(decode_step_s,) * 3
    )


@pytest.mark.parametrize(
    "steps",
    [
        (0.010, 0.020),  # two repeats: decode 200 and 100 tokens/s
        (0.010, 0.011, 0.012, 0.013),
        (0.025, 0.025, 0.025),  # no spread: an interval of one point
    ],
)
def test_a_batchs_throughputs_are_means_with_a_student_t_interval(steps):
    from scipy import stats

    timings = [_timing(0.1 * step / steps[0], step) for step in steps]
    found = BatchFigures.summarize(timings, joules="none here", local_roofline="none here")
    decode = [timing.decode_tokens_per_s for timing in timings]
    assert found.decode_tokens_per_s == pytest.approx(np.mean(decode))
    interval = found.intervals["decode_tokens_per_s"]
    if np.std(decode) == 0:
        assert interval.low == interval.high == pytest.approx(np.mean(decode))
    else:
        expected = stats.t.interval(0.95, len(decode) - 1, loc=np.mean(decode), scale=stats.sem(decode))
        assert (interval.low, interval.high) == pytest.approx(expected)
    assert interval.runs == len(steps) and set(found.intervals) == {"prefill_tokens_per_s", "decode_tokens_per_s"}


def test_one_repeat_gives_no_interval():
    found = BatchFigures.summarize([_timing(0.1, 0.01)], joules="none here", local_roofline="none here")
    assert found.intervals == {} and found.decode_tokens_per_s == pytest.approx(100.0 * 2)


@pytest.mark.parametrize(
    ("itl", "ttft", "decode", "prefill"),
    [
        # ITL 40 ms [30, 50]: 25 tokens/s [20, 33.3]; 32 prompt tokens in 80 ms [60, 100]: 400 tokens/s [320, 533.3]
        (
            Interval(40.0, 30.0, 50.0, 3),
            Interval(80.0, 60.0, 100.0, 3),
            (25.0, 20.0, 1000 / 30),
            (400.0, 320.0, 3200 / 6),
        ),
        # A latency interval reaching 0 leaves the throughput's upper end unbounded: only its lower end is logged
        (Interval(10.0, -2.0, 22.0, 2), None, (100.0, 1000 / 22, math.inf), None),
        (None, None, None, None),  # one run of the level: no interval
    ],
)
def test_the_single_stream_throughput_intervals_are_the_latency_intervals_inverted(itl, ttft, decode, prefill):
    from quantlab.measure.cost import SingleStream

    found = SingleStream("c1", prompt_tokens=32, output_tokens=16).intervals(ttft, itl)
    for name, expected in (("decode_tokens_per_s", decode), ("prefill_tokens_per_s", prefill)):
        if expected is None:
            assert name not in found
            continue
        assert (found[name].mean, found[name].low, found[name].high) == pytest.approx(expected)
        ends = found[name].ends(f"cost/{name}")
        assert set(ends) == {f"cost/{name}/ci95_low"} | (
            {f"cost/{name}/ci95_high"} if math.isfinite(expected[2]) else set()
        )
