"""Quantization methods by recipe name. A new method is one file plus one line here."""

from quantlab.quantize.awq_int4 import AwqInt4
from quantlab.quantize.base import Method
from quantlab.quantize.bf16 import Bf16
from quantlab.quantize.fp8 import Fp8
from quantlab.quantize.gptq_int4 import GptqInt4
from quantlab.quantize.int8 import Int8

METHODS: dict[str, type[Method]] = {
    "bf16": Bf16,
    "fp8": Fp8,
    "awq_int4": AwqInt4,
    "gptq_int4": GptqInt4,
    "int8": Int8,
}
