"""quantlab's vLLM plugin `fp8-upcast-gemm` (a `vllm.general_plugins` entry point): not stock vLLM, opt-in per
recipe (`serving.plugins`), and its served speed and memory are labelled so and kept out of cost decisions.

Without AMX-FP8 (every CPU before Diamond Rapids), vLLM's CPU build runs FP8 W8A8 layers through its generic torch
kernels, which call `torch._scaled_mm`: on CPU a reference loop, hundreds of times slower than a GEMM of the same
shape. This registers one more FP8 linear kernel through vLLM's own `register_linear_kernel`, ahead of the generic
torch ones only: it computes the same product as a GEMM of the exact FP8 values in the layer's compute dtype (every
e4m3 and e5m2 value is a bf16 and a float32 value). In float32, where the server computes in float32 (a CPU without
BF16 matmuls, on which bf16 GEMMs are emulated and slow), each product of two FP8 values is exact and the sum
accumulates in float32; in bf16 the GEMM accumulates in float32 and rounds its output to bf16 once, before the scales
(at most 2^-8 relative, against FP8's 2^-4 on the inputs). vLLM's activation quantization and scales are its own;
the weights stay in FP8 beside an upcast copy (3 or 5 bytes per weight resident, not FP8's 1).

It runs in vLLM's environment (imported through PYTHONPATH, found by vLLM through the dist-info beside it), in every
process of a server, and imports nothing of quantlab. vLLM logs the kernel it selects, so a run names this one.
"""

from __future__ import annotations

import logging
import math

import torch

WRITTEN_FOR = "0.32."  # vLLM's kernel interface changes between releases: registered only where it was checked
KERNEL = "QuantlabFP8UpcastGemmKernel"  # the class below: vLLM logs "Selected <it> for <layer>"
# quantlab reads these lines in the server's log (serving/engines/vllm.py)
REGISTERED = f"quantlab plugin fp8-upcast-gemm: registered {KERNEL} for FP8 layers on CPU"
NOT_REGISTERED = "quantlab plugin fp8-upcast-gemm: not registered"

logger = logging.getLogger("vllm.quantlab_fp8_upcast_gemm")


def gemm_dtype(out_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the layer's GEMM runs in: float32 where the layer computes in float32, else bf16 (exact for FP8's
    values, and the dtype CPUs with BF16 matmuls run fast)."""
    return torch.float32 if (out_dtype or torch.get_default_dtype()) == torch.float32 else torch.bfloat16


def scaled_upcast_product(a, b_upcast, scale_a, scale_b, bias, out_dtype, rows: int):
    """(a * scale_a) @ (b * scale_b) + bias for FP8 `a` (tokens x in) and an upcast copy of the FP8 weight (in x out,
    bf16 or float32), the first `rows` rows; scales per tensor, per token (rows x 1) or per output channel (out x 1)."""
    product = torch.mm(a.to(b_upcast.dtype), b_upcast).float()[:rows]
    scale_a = scale_a.float() if scale_a.numel() == 1 else scale_a.float()[:rows]
    scale_b = scale_b.float() if scale_b.numel() == 1 else scale_b.float().reshape(1, -1)
    product = product * scale_a * scale_b
    if bias is not None:
        product = product + bias.float()
    return product.to(out_dtype)


def register() -> None:
    import vllm

    if not vllm.__version__.startswith(WRITTEN_FOR):
        logger.warning("%s: written for vLLM %sx, this is %s", NOT_REGISTERED, WRITTEN_FOR, vllm.__version__)
        return
    from vllm.platforms import PlatformEnum, current_platform

    if not current_platform.is_cpu():
        logger.warning("%s: it serves CPUs only", NOT_REGISTERED)
        return
    from vllm.model_executor.kernels import linear
    from vllm.model_executor.kernels.linear.scaled_mm.pytorch import PerTensorTorchFP8ScaledMMLinearKernel
    from vllm.model_executor.kernels.linear.scaled_mm.ScaledMMLinearKernel import FP8ScaledMMLinearKernel

    kernels = linear._POSSIBLE_FP8_KERNELS[PlatformEnum.CPU]
    if any(kernel.__name__ == KERNEL for kernel in kernels):
        return  # vLLM loads its plugins once per process, and several times in the API server's

    class QuantlabFP8UpcastGemmKernel(FP8ScaledMMLinearKernel):
        @classmethod
        def is_supported(cls, compute_capability=None):
            return (True, None) if current_platform.is_cpu() else (False, "serves CPUs only.")

        @classmethod
        def can_implement(cls, c):
            return True, None  # per-tensor, per-channel weights; static or per-token activations

        def process_weights_after_loading(self, layer) -> None:
            super().process_weights_after_loading(layer)
            weight = getattr(layer, self.layer_param_names[0])
            # exact: converted once, at load, in the dtype the layer computes in
            layer.quantlab_weight_upcast = weight.detach().to(gemm_dtype(self.config.out_dtype))

        def _get_layer_params(self, layer):
            _, weight_scale, input_scale, input_scale_ub = super()._get_layer_params(layer)
            return layer.quantlab_weight_upcast, weight_scale, input_scale, input_scale_ub

        def apply_scaled_mm(self, *, A, B, out_dtype, As, Bs, bias, output_shape):
            rows = math.prod(output_shape[:-1])
            return scaled_upcast_product(A, B, As, Bs, bias, out_dtype, rows).view(*output_shape)

    linear.register_linear_kernel(QuantlabFP8UpcastGemmKernel, PlatformEnum.CPU, "fp8")
    # register_linear_kernel appends, after the generic torch kernels, which always apply: moved to just before them,
    # so a CPU with a native FP8 kernel (AMX-FP8) still uses that one.
    kernels.remove(QuantlabFP8UpcastGemmKernel)
    generic = (
        kernels.index(PerTensorTorchFP8ScaledMMLinearKernel) if PerTensorTorchFP8ScaledMMLinearKernel in kernels else 0
    )
    kernels.insert(generic, QuantlabFP8UpcastGemmKernel)
    logger.info(REGISTERED)
