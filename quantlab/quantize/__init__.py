"""Quantization methods by recipe name. A new method is one file plus one line here: what it stores per weight is
declared in its own file (`Method.linear_bytes`), and the compressed-tensors format it stores (`Method.stored_format`)
is what each serving engine's own table looks up (`quantlab.serving.engines`)."""

from quantlab.quantize.awq_int4 import AwqInt4
from quantlab.quantize.base import Method
from quantlab.quantize.bf16 import Bf16
from quantlab.quantize.fp8 import Fp8
from quantlab.quantize.fp8_block import Fp8Block
from quantlab.quantize.gptq_int4 import GptqInt4
from quantlab.quantize.int8 import Int8
from quantlab.quantize.mixed import PART_METHODS, Mixed
from quantlab.quantize.mxfp4 import Mxfp4
from quantlab.quantize.mxfp8 import Mxfp8
from quantlab.quantize.nvfp4 import Nvfp4
from quantlab.quantize.nvfp4a16 import Nvfp4A16
from quantlab.quantize.w4a8_fp8 import W4A8Fp8

METHODS: dict[str, type[Method]] = {
    "bf16": Bf16,
    "fp8": Fp8,
    "awq_int4": AwqInt4,
    "gptq_int4": GptqInt4,
    "int8": Int8,
    "mixed": Mixed,  # a format per group of layers: quantlab sensitivity --budget-bits writes it
    "fp8_block": Fp8Block,
    "mxfp8": Mxfp8,
    "nvfp4": Nvfp4,
    "nvfp4a16": Nvfp4A16,
    "mxfp4": Mxfp4,
    "w4a8_fp8": W4A8Fp8,
}
PART_METHODS.update({name: method for name, method in METHODS.items() if method is not Mixed})
