"""Optional NVML access (nvidia-ml-py): a process's device memory and the energy counters.

Every entry point answers with a reason instead of a value when NVML cannot help, so that
GPU-only figures are reported absent with that reason rather than as zero.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NvmlDevice:
    """One CUDA device as NVML sees it."""

    handle: Any
    nvml: Any  # the pynvml module, imported lazily

    def process_memory_bytes(self) -> int | None:
        """Device memory NVML attributes to this process; None when NVML does not list it
        (e.g. a container's PID namespace hides the host PID)."""
        pid = os.getpid()
        for process in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if process.pid == pid and process.usedGpuMemory is not None:
                return int(process.usedGpuMemory)
        return None

    def used_memory_bytes(self) -> int:
        """Device memory in use by every process on the device."""
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def energy_millijoules(self) -> int:
        """The device's energy counter since the driver loaded (Volta and newer)."""
        return int(self.nvml.nvmlDeviceGetTotalEnergyConsumption(self.handle))


def open_nvml_device(torch_index: int) -> NvmlDevice | str:
    """The NVML handle of torch's CUDA device `torch_index`, or why there is none.

    torch numbers devices after CUDA_VISIBLE_DEVICES, NVML does not: match by UUID."""
    try:
        import pynvml
    except ImportError:
        return "nvidia-ml-py (pynvml) is not installed"
    try:
        import torch

        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(torch_index).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    except Exception as error:  # NVML raises its own error types; any of them means "no NVML"
        return f"NVML unavailable: {error}"
    return NvmlDevice(handle, pynvml)
