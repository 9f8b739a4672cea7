"""What a window of work cost in memory and energy: context managers returning frozen readings.

A figure a device cannot give is a str saying why (never zero); NVML (nvidia-ml-py) is optional.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Generic, TypeVar

import psutil
import torch

Reading = TypeVar("Reading")


@dataclass(frozen=True)
class NvmlDevice:
    """One CUDA device as NVML sees it: its handle and the pynvml module, imported lazily."""

    handle: Any
    nvml: Any

    def process_memory_bytes(self) -> int | None:
        """Device memory NVML attributes to this process; None when NVML does not list it
        (e.g. a container's PID namespace hides the host PID)."""
        for process in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if process.pid == os.getpid() and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory)
        return None


def open_nvml_devices(cuda_indices: Sequence[int]) -> list[NvmlDevice] | str:
    """The NVML handles of torch's CUDA devices, or why there are none. torch numbers devices
    after CUDA_VISIBLE_DEVICES, NVML does not: they are matched by UUID."""
    try:
        import pynvml

        pynvml.nvmlInit()
        uuids = [str(torch.cuda.get_device_properties(index).uuid) for index in cuda_indices]
        uuids = [uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}" for uuid in uuids]
        return [NvmlDevice(pynvml.nvmlDeviceGetHandleByUUID(uuid), pynvml) for uuid in uuids]
    except ImportError:
        return "nvidia-ml-py (pynvml) is not installed"
    except Exception as error:  # NVML raises its own error types; any of them means "no NVML"
        return f"NVML unavailable: {error}"


@cache  # by pid: a forked child is another process; a new Process() per sample costs 3x as much
def _process(pid: int) -> psutil.Process:
    return psutil.Process(pid)


def current_rss_bytes() -> int:
    return int(_process(os.getpid()).memory_info().rss)


def process_peak_rss_bytes() -> int:
    """The largest resident set size this process reached (since the last high-water reset)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def _read_high_water_mark() -> int | None:
    try:
        with open("/proc/self/status") as status:
            match = re.search(r"^VmHWM:\s+(\d+) kB", status.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def reset_high_water_mark() -> bool:
    """Make the kernel's peak-RSS counter (VmHWM) start again from the current RSS (Linux >= 4.0:
    writing 5 to /proc/self/clear_refs). False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        return False
    return _read_high_water_mark() is not None


class _Window(Generic[Reading]):
    """A `with` block over the model's devices whose `reading` is set when it ends. NVML serves the
    `_nvml_figure` of CUDA devices; elsewhere `_nvml` says why it does not."""

    _nvml_figure: str
    _reading: Reading | None = None

    def __init__(self, devices: Sequence[torch.device]):
        cuda = [device for device in devices if device.type == "cuda"]
        self._cuda = sorted({torch.cuda.current_device() if device.index is None else device.index for device in cuda})
        self._nvml: list[NvmlDevice] | str = f"no CUDA device: {self._nvml_figure} comes from NVML on NVIDIA GPUs"
        if self._cuda:
            self._nvml = open_nvml_devices(self._cuda)

    def _synchronize(self) -> None:
        for index in self._cuda:
            torch.cuda.synchronize(index)

    @property
    def reading(self) -> Reading:
        if self._reading is None:
            raise RuntimeError(f"{type(self).__name__}.reading is available after its `with` block ends")
        return self._reading


@dataclass(frozen=True)
class MemoryReading:
    peak_bytes: int  # the headline figure; `peak_kind` says what it counts
    peak_kind: str
    process_peak_rss_bytes: int  # over the process's life, loading included
    peak_device_memory_bytes: int | str  # NVML's view of device memory (CUDA only), or why there is none
    device_memory_scope: str | None  # "this process" or "whole device"


class MemoryTracker(_Window[MemoryReading]):
    """Peak memory over a window.

    Host: the kernel's exact peak-RSS counter, reset when the window opens, where Linux allows
    it; elsewhere a thread samples the RSS every `sample_interval_s` (and may miss a short
    spike). No sampling thread runs on CPU when the counter works: on a small machine a third
    runnable thread stalls torch's worker threads and slows the very thing being timed.
    CUDA: torch's peak allocated bytes summed over the model's devices (the headline), and
    NVML's device memory of this process, sampled by a thread."""

    _nvml_figure = "device memory"

    def __init__(self, devices: Sequence[torch.device], sample_interval_s: float = 0.02):
        super().__init__(devices)
        self._interval = sample_interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak_nvml: int | None = None
        self._nvml_scope: str | None = None

    def __enter__(self) -> MemoryTracker:
        self._synchronize()
        for index in self._cuda:
            torch.cuda.reset_peak_memory_stats(index)
        self._peak_before = _read_high_water_mark() or process_peak_rss_bytes()
        self._kernel_peak = reset_high_water_mark()
        self._peak_rss = current_rss_bytes()
        self._sample()
        # Only this thread samples between here and `__exit__`'s join: no lock needed.
        if not self._kernel_peak or not isinstance(self._nvml, str):
            self._thread = threading.Thread(target=self._sample_until_stopped, name="memory-tracker", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exception: object) -> None:
        self._synchronize()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        if self._kernel_peak:
            self._peak_rss = max(self._peak_rss, _read_high_water_mark() or 0)
        self._reading = self._read()

    def _sample_until_stopped(self) -> None:
        while not self._stop.wait(self._interval):
            self._sample()

    def _sample(self) -> None:
        self._peak_rss = max(self._peak_rss, current_rss_bytes())
        if isinstance(self._nvml, str):
            return
        per_process = [device.process_memory_bytes() for device in self._nvml]
        if all(value is not None for value in per_process):
            device_bytes, self._nvml_scope = sum(per_process), "this process"  # type: ignore[arg-type]
        else:
            used = (device.nvml.nvmlDeviceGetMemoryInfo(device.handle).used for device in self._nvml)
            device_bytes, self._nvml_scope = sum(map(int, used)), "whole device"
        self._peak_nvml = max(self._peak_nvml or 0, device_bytes)

    def _read(self) -> MemoryReading:
        if self._cuda:
            peak = sum(torch.cuda.max_memory_allocated(index) for index in self._cuda)
            kind = f"torch.cuda.max_memory_allocated, summed over cuda:{','.join(map(str, self._cuda))}"
        else:
            peak = self._peak_rss
            method = (
                "kernel high-water mark VmHWM, reset when the window opened"
                if self._kernel_peak
                else f"sampled every {self._interval * 1000:g} ms"
            )
            kind = f"peak resident set size of the whole process ({method})"
        return MemoryReading(
            peak_bytes=peak,
            peak_kind=kind,
            process_peak_rss_bytes=max(self._peak_before, self._peak_rss),
            # With NVML open, `__enter__`'s own sample set a peak.
            peak_device_memory_bytes=self._nvml if isinstance(self._nvml, str) else self._peak_nvml,
            device_memory_scope=self._nvml_scope,
        )


class EnergyTracker(_Window[float | str]):
    """Joules the model's GPUs drew over a window (whole devices, other processes included), from NVML's
    cumulative counters (Volta and newer); or why there is no figure."""

    _nvml_figure = "energy"

    def __enter__(self) -> EnergyTracker:
        self._start_mj = self._counters()
        return self

    def __exit__(self, *exception: object) -> None:
        end_mj = self._counters()
        if isinstance(self._nvml, str):  # also when a counter read failed
            self._reading = self._nvml
        else:
            self._reading = sum(end - start for start, end in zip(self._start_mj, end_mj)) / 1000

    def _counters(self) -> list[int]:
        """Every device's counter in millijoules once its work is done; on failure (pre-Volta
        GPUs have no energy counter) the tracker records why and reports no figure."""
        if isinstance(self._nvml, str):
            return []
        self._synchronize()
        try:
            return [int(device.nvml.nvmlDeviceGetTotalEnergyConsumption(device.handle)) for device in self._nvml]
        except Exception as error:  # NVML raises its own error types
            self._nvml = f"NVML energy counter unavailable: {error}"
            return []
