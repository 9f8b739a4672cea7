"""Trackers on CPU: percentiles, peak RSS, GPU-only figures absent with a reason, clocks, bandwidth."""

from __future__ import annotations

import pytest
import torch

from quantlab.measure import trackers
from quantlab.measure.bandwidth import measure_copy_bandwidth
from quantlab.measure.clocks import CpuClock, clock_for
from quantlab.measure.stats import median, percentile
from quantlab.measure.trackers import EnergyTracker, MemoryTracker

CPU = [torch.device("cpu")]
MB = 1_000_000


@pytest.mark.parametrize(
    ("samples", "q", "expected"),
    [
        (list(range(1, 11)), 50, 5.5),  # rank 4.5: midway between 5 and 6
        (list(range(1, 11)), 90, 9.1),  # rank 8.1
        (list(range(1, 11)), 99, 9.91),  # rank 8.91
        (list(range(1, 11)), 0, 1),
        (list(range(1, 11)), 100, 10),
        ([10, 1, 7], 50, 7),  # order of samples does not matter
        ([3.0], 99, 3.0),
        ([2, 4], 75, 3.5),
    ],
)
def test_percentiles_of_known_samples(samples, q, expected):
    assert percentile(samples, q) == pytest.approx(expected)


def test_percentile_refuses_nonsense():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1], 101)
    assert median([4, 1, 3, 2]) == 2.5


def allocate_and_hold(megabytes: int) -> torch.Tensor:
    return torch.ones(megabytes * MB // 4, dtype=torch.float32)  # ones: every page is touched


@pytest.mark.parametrize("kernel_counter", [True, False], ids=["high-water-mark", "sampling-thread"])
def test_peak_rss_grows_when_the_window_allocates(monkeypatch, kernel_counter):
    if not kernel_counter:
        monkeypatch.setattr(trackers, "reset_high_water_mark", lambda: False)
    with MemoryTracker(CPU, sample_interval_s=0.001) as tracker:
        held = allocate_and_hold(200)
        del held
    reading = tracker.reading
    assert reading.peak_bytes - reading.baseline_bytes >= 190 * MB
    assert reading.peak_rss_bytes == reading.peak_bytes
    assert reading.process_peak_rss_bytes >= reading.peak_bytes
    assert ("high-water" in reading.peak_kind) == kernel_counter


def test_peak_rss_of_a_quiet_window_stays_near_the_baseline():
    with MemoryTracker(CPU) as tracker:
        pass
    assert tracker.reading.peak_bytes - tracker.reading.baseline_bytes < 50 * MB


def test_gpu_only_figures_are_absent_with_a_reason_on_cpu():
    with MemoryTracker(CPU) as memory, EnergyTracker(CPU) as energy:
        allocate_and_hold(1)
    assert memory.reading.peak_device_memory_bytes is None
    assert "no CUDA device" in memory.reading.unavailable["peak_device_memory_bytes"]
    assert energy.reading.joules is None
    assert "no CUDA device" in energy.reading.unavailable_reason


def test_a_reading_before_the_window_closes_is_an_error():
    tracker = MemoryTracker(CPU)
    with pytest.raises(RuntimeError):
        tracker.reading


def test_the_cpu_clock_is_perf_counter():
    clock = clock_for(torch.device("cpu"), CPU)
    assert isinstance(clock, CpuClock)
    start = clock.mark()
    end = clock.mark()
    clock.settle()
    assert clock.seconds(start, end) >= 0


def test_copy_bandwidth_is_positive_and_says_how_it_was_measured():
    reading = measure_copy_bandwidth(torch.device("cpu"), nbytes=4 * MB, repeats=3)
    assert reading.bytes_per_s > 0
    assert len(reading.samples_bytes_per_s) == 3
    assert "read + write" in reading.method
