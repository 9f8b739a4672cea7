"""What produced a measured figure: the engine, the kernel path, the hardware and the clock."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from quantlab.measure.kernels import kernel_path


@dataclass(frozen=True)
class Provenance:
    engine: str
    kernel_path: str
    hardware: str
    clock: str


def describe_engine(model: torch.nn.Module) -> str:
    import transformers

    attention = getattr(getattr(model, "config", None), "_attn_implementation", None) or "default"
    return (
        f"transformers {transformers.__version__} (attention {attention}), torch {torch.__version__}; "
        "greedy forward loop with the model's KV cache"
    )


@cache
def cpu_model_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def visible_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def describe_hardware(devices: Sequence[torch.device]) -> str:
    host = f"{cpu_model_name()}, {visible_cores()} cores visible, {torch.get_num_threads()} torch threads"
    indices = sorted({device.index or 0 for device in devices if device.type == "cuda"})
    if not indices:
        return f"CPU: {host}"
    gpus = []
    for index in indices:
        properties = torch.cuda.get_device_properties(index)
        gpus.append(
            f"cuda:{index} {properties.name} (SM {properties.major}.{properties.minor}, "
            f"{properties.total_memory} B, {properties.multi_processor_count} SMs)"
        )
    return f"GPU: {'; '.join(gpus)}; host: {host}"


def provenance(model: torch.nn.Module, devices: Sequence[torch.device], clock: str) -> Provenance:
    return Provenance(describe_engine(model), kernel_path(model), describe_hardware(devices), clock)
