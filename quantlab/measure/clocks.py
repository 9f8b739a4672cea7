"""Timestamps for timing model work: perf_counter on CPU, CUDA events on GPU.

CUDA kernels run asynchronously, so a host clock read while they are queued measures the
queueing, not the work. Events are recorded on the stream of the device that produces the
logits (the last one when a model is spread over several) and read after `settle()`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch


class CpuClock:
    description = "time.perf_counter"

    def mark(self) -> float:
        return time.perf_counter()

    def settle(self) -> None:
        pass

    def seconds(self, start: float, end: float) -> float:
        return end - start


class CudaClock:
    description = "CUDA events"

    def __init__(self, record_on: torch.device, devices: Sequence[torch.device]):
        self.record_on = record_on
        self.devices = list(devices)

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.record_on))
        return event

    def settle(self) -> None:
        """Wait until all queued work is done; read `seconds` only after this."""
        for device in self.devices:
            torch.cuda.synchronize(device)

    def seconds(self, start: torch.cuda.Event, end: torch.cuda.Event) -> float:
        return start.elapsed_time(end) / 1000


Clock = CpuClock | CudaClock


def clock_for(record_on: torch.device, devices: Sequence[torch.device]) -> Clock:
    """The clock for work on `devices`, whose results end up on `record_on`."""
    if record_on.type == "cuda":
        return CudaClock(record_on, [device for device in devices if device.type == "cuda"])
    return CpuClock()
