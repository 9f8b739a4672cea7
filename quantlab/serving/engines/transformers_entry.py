"""`python -m quantlab.serving.engines.transformers_entry serve ...`: `transformers serve` as quantlab starts it on a
CPU, its command line unchanged after `serve`, with compressed-tensors checkpoints loaded as quantlab's own scoring
loads them. The server's command line names this module: a reader of `served.command` sees what ran.

compressed-tensors 0.19 decompresses MX and NVFP4 weights to BF16 whatever the compute dtype (their E8M0 / FP8 scales
are BF16): at float32 the server's first request failed in every linear layer ("expected m1 and m2 to have the same
dtype, but got: float != c10::BFloat16"), so MXFP8, MXFP4 and NVFP4 checkpoints (and mixes holding them) could not be
served at all. For those the model is loaded exactly as quantlab's loader does on CPU
(`quantlab.quantize.cpu_loading`: decompressed once at load, upcast to the compute dtype; the forward still rounds
activations to the format), so what the server computes is what quantlab scored. Other formats keep the server's own
loading: decompressing an FP8 checkpoint this way makes its requests slower (benchmarks/serving_vs_loop.py).
Every compressed-tensors checkpoint also gets quantlab's fake quantization on CPU (`quantlab.fake_quant`: the same
values as the in-process scoring, without torch's slow cast back from FP8 or rounding a shared input again).

transformers serve builds its model loader inside its command, with no argument that reaches `from_pretrained`'s
`quantization_config` for a compressed-tensors checkpoint: this process wraps `PreTrainedModel.from_pretrained` before
the command runs (this process only; nothing is installed into another).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# For whoever opens the server's log: what was changed.
DECOMPRESSED_NOTICE = "quantlab: {checkpoint} decompressed at load to {dtype}, as quantlab loads it on CPU"
# compressed-tensors' formats whose weights decompress to BF16 (a checkpoint's own, or one of its groups')
DECOMPRESSED_AS_BF16 = {"mxfp8-quantized", "mxfp4-pack-quantized", "nvfp4-pack-quantized"}


def _compressed_tensors_config(location) -> dict | None:
    """The checkpoint's compressed-tensors `quantization_config`, or None (another kind, or not a local folder)."""
    config = Path(str(location)) / "config.json"
    if not config.is_file():
        return None
    quantization = json.loads(config.read_text()).get("quantization_config") or {}
    return quantization if quantization.get("quant_method") == "compressed-tensors" else None


def decompresses_as_bf16(quantization: dict) -> bool:
    groups = (quantization.get("config_groups") or {}).values()
    return bool({quantization.get("format"), *(group.get("format") for group in groups)} & DECOMPRESSED_AS_BF16)


def load_as_quantlab_does() -> None:
    """Wrap transformers' `from_pretrained` in this process: compressed-tensors checkpoints load as quantlab's CPU
    scoring loads them (the module's docstring)."""
    import torch
    from transformers.modeling_utils import PreTrainedModel

    load = PreTrainedModel.from_pretrained.__func__

    def from_pretrained(cls, location, *args, **kwargs):
        dtype = kwargs.get("dtype")
        dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        quantization = _compressed_tensors_config(location)
        if quantization is not None:
            from quantlab import fake_quant

            if fake_quant.install():
                print(fake_quant.INSTALLED_NOTICE, file=sys.stderr, flush=True)
        decompress = quantization is not None and decompresses_as_bf16(quantization)
        if not isinstance(dtype, torch.dtype) or "quantization_config" in kwargs or not decompress:
            return load(cls, location, *args, **kwargs)
        from quantlab.quantize.cpu_loading import cpu_decompression, upcast_decompressed

        model = load(cls, location, *args, **kwargs, **cpu_decompression())
        upcast_decompressed(model, dtype)
        print(DECOMPRESSED_NOTICE.format(checkpoint=location, dtype=dtype), file=sys.stderr, flush=True)
        return model

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def main() -> None:
    load_as_quantlab_does()
    from transformers.cli.transformers import main as transformers_cli

    transformers_cli()


if __name__ == "__main__":
    main()
