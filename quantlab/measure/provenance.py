"""What produced a measured figure (engine, kernel path, hardware, clock), and the machine a variant ran on."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from functools import cache

import torch


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


def hardware() -> dict[str, str]:
    """The machine in brief: every variant's `hardware.*` params (the cost tag, `describe_hardware`,
    details the devices a measurement used)."""
    found = {"cpu": platform.processor() or platform.machine(), "cpu_count": str(os.cpu_count())}
    if not torch.cuda.is_available():
        return found | {"gpu": "none"}
    return found | {"gpu": torch.cuda.get_device_name(0), "gpu_count": str(torch.cuda.device_count())}


def _describe_gpu(index: int) -> str:
    gpu = torch.cuda.get_device_properties(index)
    return (
        f"cuda:{index} {gpu.name} (SM {gpu.major}.{gpu.minor}, {gpu.total_memory} B, {gpu.multi_processor_count} SMs)"
    )


def describe_hardware(devices: Sequence[torch.device]) -> str:
    host = f"{cpu_model_name()}, {visible_cores()} cores visible, {torch.get_num_threads()} torch threads"
    indices = sorted({device.index or 0 for device in devices if device.type == "cuda"})
    if not indices:
        return f"CPU: {host}"
    return f"GPU: {'; '.join(map(_describe_gpu, indices))}; host: {host}"
