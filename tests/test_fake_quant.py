"""quantlab.fake_quant: its FP8 rounding against torch's own cast, bit for bit; when a rounded input is reused."""

from __future__ import annotations

import pytest
import torch

from quantlab.fake_quant import E4M3_MAX, install, round_to_fp8_e4m3, rounds_on_cpu

FP8 = torch.float8_e4m3fn


def torch_rounding(values: torch.Tensor) -> torch.Tensor:
    return values.to(FP8).to(values.dtype)


def same_bits(left: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Elementwise: the same bit pattern (so -0 differs from +0, and NaN matches any NaN)."""
    integers = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[left.dtype]
    return (left.view(integers) == right.view(integers)) | (left.isnan() & right.isnan())


def every_bfloat16() -> torch.Tensor:
    """All 65,536 BF16 bit patterns, clamped to FP8's range as compressed-tensors clamps before rounding."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return patterns.clamp(-E4M3_MAX, E4M3_MAX)


def fp8_grid_in_float32() -> torch.Tensor:
    """Every finite FP8 value, the midpoints between neighbours (ties), and the float32 values either side of both."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite()].unique()
    midpoints = (grid[1:] + grid[:-1]) / 2
    points = torch.cat([grid, midpoints])
    return torch.cat([points, points.nextafter(points + 1), points.nextafter(points - 1)]).clamp(-E4M3_MAX, E4M3_MAX)


def random_float32(count: int = 2_000_000) -> torch.Tensor:
    """Random bit patterns (every binade alike, so mostly clamped) and values at activation scales."""
    generator = torch.Generator().manual_seed(0)
    patterns = torch.randint(-(2**31), 2**31, (count,), dtype=torch.int64, generator=generator)
    patterns = patterns.to(torch.int32).view(torch.float32)
    scaled = torch.randn(count, generator=generator) * torch.logspace(-12, 3, count, base=2)
    return torch.cat([patterns, scaled]).clamp(-E4M3_MAX, E4M3_MAX)


@pytest.mark.parametrize(
    ("name", "values"),
    [("every bfloat16", every_bfloat16()), ("fp8 grid, ties and neighbours", fp8_grid_in_float32())]
    + [("random float32", random_float32())],
)
def test_rounding_is_torch_cast_bit_for_bit(name, values):
    rounded, expected = round_to_fp8_e4m3(values), torch_rounding(values)
    differs = ~same_bits(rounded, expected)
    assert not differs.any(), (name, values[differs][:5], expected[differs][:5], rounded[differs][:5])
    assert rounded.dtype == values.dtype


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (0.0, 0.0),  # zero stays zero
        (2.0**-10, 0.0),  # a tie on the subnormal grid goes to the even step: 0
        (3 * 2.0**-10, 2 * 2.0**-9),  # ... and here to the even step above
        (-(2.0**-12), -0.0),  # a negative value too small to keep is -0, as torch's cast gives
        (1.0625, 1.0),  # halfway between 1 and 1.125: the even mantissa
        (1.1875, 1.25),  # halfway between 1.125 and 1.25: the even mantissa
        (447.0, 448.0),  # FP8's largest finite value
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rounding_table(value, expected, dtype):
    rounded = round_to_fp8_e4m3(torch.tensor([value], dtype=dtype))
    assert same_bits(rounded, torch.tensor([expected], dtype=dtype)).all(), rounded


def test_nan_stays_nan():
    assert round_to_fp8_e4m3(torch.tensor([float("nan")], dtype=torch.bfloat16)).isnan().all()


@pytest.mark.parametrize(
    ("tensor", "taken"),
    [
        (torch.zeros(2, dtype=torch.bfloat16), True),
        (torch.zeros(2, dtype=torch.float32), True),
        (torch.zeros(2, dtype=torch.float16), False),  # compressed-tensors' own rounding handles it
        (torch.zeros(2, dtype=torch.float64), False),
    ],
)
def test_which_tensors_it_rounds(tensor, taken):
    assert rounds_on_cpu(tensor) is taken


def test_install_routes_fp8_fake_quantization_and_leaves_int8_alone(monkeypatch):
    """compressed-tensors' own fake_quantize, per-token FP8 as FP8_DYNAMIC's activations: the same values
    through quantlab's rounding as through the original, and the original still rounds INT8."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle import forward_helpers
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize

    install()
    assert install() is False  # once per process
    patched = forward_helpers.round_to_quantized_type_args
    calls = []
    monkeypatch.setattr("quantlab.fake_quant.round_to_fp8_e4m3", lambda v: calls.append(v) or round_to_fp8_e4m3(v))

    activations = torch.randn(4, 64, 96, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16) * 3
    fp8 = QuantizationArgs(num_bits=8, type="float", strategy="token", dynamic=True, symmetric=True)
    int8 = QuantizationArgs(num_bits=8, type="int", strategy="token", dynamic=True, symmetric=True)
    scale = activations.abs().amax(-1, keepdim=True).float() / E4M3_MAX
    zero_point = torch.zeros_like(scale)
    outputs = {}
    for rounding in (patched, patched.original):
        monkeypatch.setattr(forward_helpers, "round_to_quantized_type_args", rounding)
        outputs[rounding] = [fake_quantize(activations, scale, zero_point, args) for args in (fp8, int8)]
    assert len(calls) == 1  # the FP8 call went through quantlab's rounding, the INT8 one did not
    for ours, theirs in zip(outputs[patched], outputs[patched.original], strict=True):
        assert torch.equal(ours, theirs)


def count_roundings(monkeypatch) -> dict[str, int]:
    """Dynamic roundings computed from now on, by who computed them: quantlab's per-token FP8 ("quantlab") or
    compressed-tensors' scales ("compressed-tensors": its own path, whichever rounding it then calls)."""
    from compressed_tensors.quantization.lifecycle import forward

    from quantlab import fake_quant

    counted = {"quantlab": 0, "compressed-tensors": 0}

    def counting(who, function):
        def counted_call(*args, **kwargs):
            counted[who] += 1
            return function(*args, **kwargs)

        return counted_call

    monkeypatch.setattr(fake_quant, "fp8_per_token", counting("quantlab", fake_quant.fp8_per_token))
    dynamic = forward.compute_dynamic_scales_and_zp
    monkeypatch.setattr(forward, "compute_dynamic_scales_and_zp", counting("compressed-tensors", dynamic))
    return counted


def _linear(global_scale: bool = False) -> torch.nn.Linear:
    from compressed_tensors.quantization import QuantizationStatus

    layer = torch.nn.Linear(96, 8)
    layer.quantization_status = QuantizationStatus.FROZEN
    if global_scale:
        layer.input_global_scale = torch.nn.Parameter(torch.tensor([1.0]), requires_grad=False)
    return layer


def _args(**changes):
    from compressed_tensors.quantization import QuantizationArgs

    settings = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
    return QuantizationArgs(**(settings | changes))


def _same_input(activations):
    return activations


def _changed_in_place(activations):
    return activations.mul_(2)


def _equal_copy(activations):
    return activations.clone()


@pytest.mark.parametrize(
    ("case", "second_input", "second_args", "base_name", "global_scale", "inference", "reused"),
    [
        ("the same tensor, unchanged, equal args", _same_input, {}, "input", False, False, True),
        ("changed in place since", _changed_in_place, {}, "input", False, False, False),
        ("an equal copy (another tensor)", _equal_copy, {}, "input", False, False, False),
        ("other args", _same_input, {"strategy": "group", "group_size": 32}, "input", False, False, False),
        ("a layer with a global scale", _same_input, {}, "input", True, False, False),
        ("an inference-mode tensor (no version counter)", _same_input, {}, "input", False, True, False),
        ("an output, not an input", _same_input, {}, "output", False, False, False),
    ],
)
def test_a_dynamic_input_is_rounded_once_only_while_that_is_exact(
    monkeypatch, case, second_input, second_args, base_name, global_scale, inference, reused
):
    """Two layers' `forward_quantize` in a row: the second reuses the first's rounding exactly when the tensor, its
    content and the args are the same; whatever it returns equals compressed-tensors' own function."""
    from compressed_tensors.quantization.lifecycle import forward

    install()
    ours = forward.forward_quantize
    computed = count_roundings(monkeypatch)
    mode = torch.inference_mode() if inference else torch.no_grad()
    with mode:
        activations = torch.randn(2, 16, 96, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        first = ours(_linear(), activations, base_name, _args())
        second_activations = second_input(activations)
        second = ours(_linear(global_scale), second_activations, base_name, _args(**second_args))
        expected = ours.original(_linear(global_scale), second_activations, base_name, _args(**second_args))
    assert (second is first) is reused, case
    assert sum(computed.values()) == (1 if reused else 2) + 1, case  # + 1: the original's own, for `expected`
    assert torch.equal(second, expected), case


def special_activations(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Random activations over 40 binades, with signed zeros, values too small to survive, and a row of zeros."""
    generator = torch.Generator().manual_seed(3)
    values = torch.randn(shape, generator=generator) * torch.logspace(-30, 10, shape[-1], base=2)
    values = values.to(dtype)
    values[0, 0, :5] = torch.tensor([-0.0, 0.0, -1e-30, 1e-30, 3.0])
    values[0, -1] = 0.0
    values[-1, 0] = -0.0
    return values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 7, 96), (4, 33, 1536)], ids=["served token", "small", "prefill"])
def test_per_token_fp8_is_compressed_tensors_own_bit_for_bit(dtype, shape):
    from compressed_tensors.quantization.lifecycle import forward

    from quantlab.fake_quant import fp8_per_token

    install()
    values = special_activations(shape, dtype)
    theirs = forward.forward_quantize.original(_linear(), values, "input", _args())
    ours = fp8_per_token(values)
    assert ours.dtype == theirs.dtype == dtype
    assert same_bits(ours, theirs).all()


@pytest.mark.parametrize(
    ("case", "args", "shape", "dtype", "applies"),
    [
        ("per token, (batch, tokens, width), BF16", {}, (2, 3, 64), torch.bfloat16, True),
        ("per token, float32", {}, (2, 3, 64), torch.float32, True),
        ("2-D input: compressed-tensors scales it per tensor", {}, (3, 64), torch.bfloat16, False),
        ("per group", {"strategy": "group", "group_size": 32}, (2, 3, 64), torch.bfloat16, False),
        ("asymmetric", {"symmetric": False}, (2, 3, 64), torch.bfloat16, False),
        ("INT8", {"type": "int"}, (2, 3, 64), torch.bfloat16, False),
        ("scales rounded to FP8 themselves", {"scale_dtype": torch.float8_e4m3fn}, (2, 3, 64), torch.bfloat16, False),
        ("float16", {}, (2, 3, 64), torch.float16, False),
    ],
)
def test_where_quantlabs_per_token_fp8_applies(case, args, shape, dtype, applies):
    from quantlab.fake_quant import fp8_per_token_applies

    assert fp8_per_token_applies(_args(**args), torch.zeros(shape, dtype=dtype)) is applies, case
