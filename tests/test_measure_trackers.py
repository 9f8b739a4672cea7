"""Trackers on CPU: peak RSS, GPU-only figures absent with a reason, clocks, bandwidth."""

from __future__ import annotations

import pytest
import torch

from quantlab.measure import trackers
from quantlab.measure.timing import CpuClock, clock_for, measure_copy_bandwidth
from quantlab.measure.trackers import EnergyTracker, MemoryTracker

CPU = [torch.device("cpu")]
MB = 1_000_000


def allocate_and_hold(megabytes: int) -> torch.Tensor:
    return torch.ones(megabytes * MB // 4, dtype=torch.float32)  # ones: every page is touched


@pytest.mark.parametrize("kernel_counter", [True, False], ids=["high-water-mark", "sampling-thread"])
def test_peak_rss_grows_when_the_window_allocates(monkeypatch, kernel_counter):
    if not kernel_counter:
        monkeypatch.setattr(trackers, "reset_high_water_mark", lambda: False)
    before = trackers.current_rss_bytes()
    with MemoryTracker(CPU, sample_interval_s=0.001) as tracker:
        held = allocate_and_hold(200)
        del held
    reading = tracker.reading
    assert reading.peak_bytes - before >= 190 * MB
    assert reading.process_peak_rss_bytes >= reading.peak_bytes
    assert ("high-water" in reading.peak_kind) == kernel_counter


def test_peak_rss_of_a_quiet_window_stays_near_the_rss_before_it():
    before = trackers.current_rss_bytes()
    with MemoryTracker(CPU) as tracker:
        pass
    assert tracker.reading.peak_bytes - before < 50 * MB


def test_gpu_only_figures_are_absent_with_a_reason_on_cpu():
    with MemoryTracker(CPU) as memory, EnergyTracker(CPU) as energy:
        allocate_and_hold(1)
    assert "no CUDA device" in memory.reading.peak_device_memory_bytes  # why there is no figure
    assert "no CUDA device" in energy.reading  # why there are no joules


def test_a_reading_before_the_window_closes_is_an_error():
    tracker = MemoryTracker(CPU)
    with pytest.raises(RuntimeError):
        tracker.reading  # noqa: B018 - the property raises; reading it is the test


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
    assert "read + write" in reading.method
