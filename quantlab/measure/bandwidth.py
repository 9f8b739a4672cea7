"""The memory bandwidth of the hardware a variant runs on, measured rather than looked up:
a datasheet figure is a peak that a CPU VM or a throttled GPU may never reach, and the
roofline efficiency is only honest against what this machine can actually move."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from quantlab.measure.clocks import clock_for


@dataclass(frozen=True)
class BandwidthReading:
    bytes_per_s: float  # median over the samples
    samples_bytes_per_s: tuple[float, ...]
    method: str


def measure_copy_bandwidth(device: torch.device, nbytes: int, repeats: int) -> BandwidthReading:
    """Copy an `nbytes` tensor on `device` `repeats` times; each copy reads and writes
    `nbytes`, so it moves 2 x nbytes (STREAM's "copy" convention)."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)  # ones, not empty: touch every page
    target = torch.empty_like(source)
    target.copy_(source)  # untimed: first-touch page faults and lazy allocation
    clock = clock_for(device, [device])
    samples = []
    for _ in range(repeats):
        clock.settle()
        start = clock.mark()
        target.copy_(source)
        end = clock.mark()
        clock.settle()
        samples.append(2 * nbytes / clock.seconds(start, end))
    del source, target
    return BandwidthReading(
        bytes_per_s=float(np.median(samples)),
        samples_bytes_per_s=tuple(samples),
        method=f"torch copy of {nbytes} B on {device} (read + write counted), median of {repeats}",
    )
