"""The KV cache quantized beside any method (a variant's `kv_cache:`): llm-compressor's `kv_cache_scheme`, K and V
rounded to the format where attention writes them, with static scales calibrated on the recipe's samples."""

from __future__ import annotations

from typing import TYPE_CHECKING

from quantlab.quantize.base import CalibrationSet, calibrated_oneshot

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def quantize_kv_cache(model: PreTrainedModel, strategy: str, calibration: CalibrationSet | None) -> None:
    """Attach and calibrate FP8 (E4M3, symmetric, static) K/V quantization to every attention module of `model`,
    after its method ran: the checkpoint's `quantization_config.kv_cache_scheme`, `k_scale`/`v_scale` per attention
    (`strategy`: "tensor", or "attn_head" for one scale per KV head).

    A pass of its own rather than a field on each method's modifier, so that it applies to any method (bf16 included)
    unchanged. `targets=[]` keeps it off the Linear layers: with the default targets llm-compressor would reset the
    schemes the method attached (tested on the tiny Llama: the weights' config groups survive, and the
    scales agree with those of `kv_cache_scheme` set on FP8_DYNAMIC's own modifier to bf16's precision). Its calibration runs with the weights' quantization
    disabled (llm-compressor disables every module's while it calibrates), so the scales fit the unquantized K/V."""
    from compressed_tensors.quantization import QuantizationArgs
    from llmcompressor.modifiers.quantization import QuantizationModifier

    scheme = QuantizationArgs(num_bits=8, type="float", strategy=strategy, dynamic=False, symmetric=True)
    calibrated_oneshot(model, [QuantizationModifier(kv_cache_scheme=scheme, targets=[])], calibration)
