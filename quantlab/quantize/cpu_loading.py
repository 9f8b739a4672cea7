"""How a compressed-tensors checkpoint loads on a CPU, for quantlab's own scoring (`quantlab.models`) and for
`transformers serve` started through quantlab (`quantlab.serving.engines.transformers_entry`): one way, so that what
the server computes is what quantlab scored."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cpu_decompression() -> dict:
    """`from_pretrained` arguments that decompress a compressed-tensors checkpoint once, at load, on a CPU.

    compressed-tensors 0.19 otherwise decompresses on every forward, and MX and NVFP4 weights come back as BF16
    whatever the compute dtype (their E8M0 / FP8 scales are BF16): a float32 activation then meets a BF16 weight
    ("expected m1 and m2 to have the same dtype"). The forward still rounds the activations to the format on every
    pass. `upcast_decompressed` after it."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return {"quantization_config": CompressedTensorsConfig(dequantize=True)}


def upcast_decompressed(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Decompressed weights and scales in the compute dtype (exact: every narrower float is a subset of it)."""
    for parameter in model.parameters():
        if parameter.is_floating_point() and parameter.dtype != dtype:
            parameter.data = parameter.data.to(dtype)
