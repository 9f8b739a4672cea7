"""What produced a measured figure (engine, kernel path, hardware, clock), and the machine a variant ran on.

The kernel path matters: a measured tokens/s means little without it (one FP8 checkpoint runs FP8 matmuls on an
H100, BF16 ones on a CPU). Read it after the model has run: compressed-tensors decompresses on the first forward.
"""

from __future__ import annotations

import os
import platform
from collections import Counter
from collections.abc import Sequence
from contextlib import suppress
from functools import cache
from typing import Any

import torch

from quantlab.host_share import visible_cores


def describe_engine(model: torch.nn.Module) -> str:
    import transformers

    attention = getattr(getattr(model, "config", None), "_attn_implementation", None) or "default"
    return (
        f"transformers {transformers.__version__} (attention {attention}), torch {torch.__version__}; "
        "greedy forward loop with the model's KV cache"
    )


@cache
def cpu_model_name() -> str:
    with suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


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


_DTYPE_NAMES = {
    torch.float32: "FP32",
    torch.bfloat16: "BF16",
    torch.float16: "FP16",
    torch.float8_e4m3fn: "FP8 E4M3",
    torch.float8_e5m2: "FP8 E5M2",
    torch.int8: "INT8",
    torch.uint8: "UINT8",
    torch.int32: "INT32",
}
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def describe_quantization_args(args: Any) -> str:
    """compressed-tensors QuantizationArgs in words, e.g. "INT4 group-64 symmetric"."""
    number = "FP" if str(getattr(args.type, "value", args.type)) == "float" else "INT"
    strategy = str(getattr(args.strategy, "value", args.strategy) or "")
    granularity = {
        "group": f"group-{args.group_size}",
        "channel": "per-channel",
        "tensor": "per-tensor",
        "token": "per-token",
        "block": f"block-{args.block_structure}",
        "tensor_group": f"tensor-group-{args.group_size}",
    }.get(strategy, strategy)
    words = [f"{number}{args.num_bits}", granularity, "dynamic" if args.dynamic is True else ""]
    if number == "INT":
        words.append("symmetric" if args.symmetric else "asymmetric")
    return " ".join(word for word in words if word)


def linear_kernel_path(module: torch.nn.Module) -> str:
    """The path one linear layer's matmul takes."""
    if type(module).__name__ == "CompressedTensorsFP8Linear":
        return "FP8 matmul (torch scaled_mm, row-wise scales; transformers CompressedTensorsFP8Linear)"
    weight = getattr(module, "weight", None)
    compute = "unknown dtype"
    if isinstance(weight, torch.Tensor):
        compute = _DTYPE_NAMES.get(weight.dtype, str(weight.dtype).removeprefix("torch."))
    scheme = getattr(module, "quantization_scheme", None)
    if scheme is None or scheme.weights is None or not getattr(module, "quantization_enabled", True):
        return f"{compute} matmul"
    stored = describe_quantization_args(scheme.weights)
    if hasattr(module, "weight_packed") or (isinstance(weight, torch.Tensor) and weight.dtype in _FP8_DTYPES):
        return f"{stored} weights still compressed (compressed-tensors decompresses them on the first forward)"
    from compressed_tensors.quantization import QuantizationStatus  # installed: it attached the scheme

    status = getattr(module, "quantization_status", None)
    # Before compression, compressed-tensors quantize-dequantizes the weights every forward.
    if status is not None and status < QuantizationStatus.COMPRESSED:
        path = f"{stored} weights fake-quantized each forward, {compute} matmul"
    else:
        path = f"{stored} weights dequantized to {compute} once, {compute} matmul"
    if scheme.input_activations is not None:
        path += f", {describe_quantization_args(scheme.input_activations)} activations fake-quantized"
    return path


def kernel_path(model: torch.nn.Module) -> str:
    """Every distinct linear-layer path with how many layers take it, most common first,
    then where the weights live, e.g. "BF16 matmul (211 Linear) on CPU"."""
    paths = Counter(linear_kernel_path(module) for module in model.modules() if isinstance(module, torch.nn.Linear))
    devices = sorted({str(parameter.device) for parameter in model.parameters()})
    placement = "CPU" if devices == ["cpu"] else ", ".join(devices)
    if not paths:
        return f"no torch.nn.Linear layers found, on {placement}"
    return "; ".join(f"{path} ({count} Linear)" for path, count in paths.most_common()) + f" on {placement}"
