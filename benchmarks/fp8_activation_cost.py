"""Why FP8 scores slower than BF16 on a CPU (issue 31): what the activations' rounding costs, side by side.

quantlab scores an FP8 (W8A8) checkpoint on a CPU as compressed-tensors runs it: weights decompressed once at load
(`quantlab.models.cpu_decompression`, status DECOMPRESSED: no per-forward weight rounding), and every Linear's input
rounded to FP8 per token on every forward (dynamic scales), which is the format's arithmetic and what a
faithful score must include. This prints

(1) one forward of the checkpoint at lm-eval's batch shape, in the compute dtype quantlab picks here (`--dtype`),
    with that rounding done by quantlab.fp8_rounding (as quantlab scores), by compressed-tensors' own rounding
    (torch's cast to FP8 and back: the same values), and off (compressed-tensors' `quantization_enabled`),
    interleaved, medians; the differences are the rounding's whole cost each way;
(2) each operation of the rounding (compressed-tensors' per-token dynamic FP8 path: absmax, divide, clamp, cast to
    float8_e4m3fn, cast back, multiply) on one activation-shaped tensor, in ns per element, and the round trip
    through torch's casts against quantlab.fp8_rounding.

    .venv/bin/python benchmarks/fp8_activation_cost.py --checkpoint ~/.cache/quantlab/checkpoints/fp8-<key>
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch


def seconds(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


ROUNDINGS = ("quantlab's (as scored)", "compressed-tensors' own (torch's cast)", "off (not the format)")


def forward_three_ways(checkpoint: Path, dtype: torch.dtype, batch: int, tokens: int, repeats: int) -> None:
    """One forward with the activations rounded by quantlab.fp8_rounding, by compressed-tensors' own rounding
    (torch's cast to FP8 and back: the same values, slower), and not at all; interleaved, medians."""
    from compressed_tensors.quantization.lifecycle import forward_helpers

    from quantlab.models import load_checkpoint

    model, _ = load_checkpoint(checkpoint, dtype, "cpu")  # installs quantlab's rounding
    ours = forward_helpers.round_to_quantized_type_args
    quantized = [module for module in model.modules() if getattr(module, "quantization_scheme", None) is not None]
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens))

    def forward(rounding: str) -> None:
        forward_helpers.round_to_quantized_type_args = ours.original if rounding == ROUNDINGS[1] else ours
        for module in quantized:
            module.quantization_enabled = rounding != ROUNDINGS[2]
        with torch.inference_mode():
            model(ids)

    forward(ROUNDINGS[0])  # one warm-up for all: switching changes no buffer or kernel choice
    found: dict[str, list[float]] = {rounding: [] for rounding in ROUNDINGS}
    for _ in range(repeats):
        for rounding in ROUNDINGS:
            started = time.perf_counter()
            forward(rounding)
            found[rounding].append(time.perf_counter() - started)
    forward_helpers.round_to_quantized_type_args = ours
    median = {rounding: statistics.median(times) for rounding, times in found.items()}
    print(
        f"forward of {batch} x {tokens} tokens in {dtype}, {len(quantized)} quantized Linear layers, "
        f"{repeats} interleaved rounds"
    )
    for rounding, seconds_ in median.items():
        print(f"  activations' FP8 rounding {rounding:40s} {seconds_:7.2f} s")
    scored, torch_cast, off = median.values()
    print(
        f"  ratio quantlab's / torch's cast {scored / torch_cast:.2f}; the rounding is "
        f"{100 * (torch_cast - off) / torch_cast:.0f}% of the forward with torch's cast, "
        f"{100 * (scored - off) / scored:.0f}% with quantlab's"
    )


def rounding_operations(rows: int, width: int, dtype: torch.dtype, repeats: int) -> None:
    from quantlab.fp8_rounding import round_to_fp8_e4m3

    x = torch.randn(rows, width, dtype=dtype)
    scale = x.abs().amax(dim=-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    as_fp8 = x.to(torch.float8_e4m3fn)
    steps = {
        "per-token absmax": lambda: x.abs().amax(dim=-1, keepdim=True),
        "divide by scale": lambda: x / scale,
        "clamp to FP8 range": lambda: torch.clamp(x, -448.0, 448.0),
        "cast to float8_e4m3fn": lambda: x.to(torch.float8_e4m3fn),
        f"cast back to {str(dtype).removeprefix('torch.')}": lambda: as_fp8.to(dtype),
        "multiply by scale": lambda: x * scale,
    }
    print(f"rounding steps on a {rows} x {width} {dtype} activation ({x.numel():,} elements), median of {repeats}")
    total = 0.0
    for name, step in steps.items():
        per_element = seconds(step, repeats) / x.numel() * 1e9
        total += per_element
        print(f"  {name:24s} {per_element:6.2f} ns/element")
    print(f"  {'all steps':24s} {total:6.2f} ns/element")
    both_casts = seconds(lambda: x.to(torch.float8_e4m3fn).to(dtype), repeats)
    quantlabs = seconds(lambda: round_to_fp8_e4m3(x), repeats)
    print(
        f"  round to FP8 and back: torch's casts {both_casts / x.numel() * 1e9:.2f}, quantlab.fp8_rounding "
        f"{quantlabs / x.numel() * 1e9:.2f} ns/element (ratio {quantlabs / both_casts:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="an FP8 (W8A8 dynamic) checkpoint quantlab wrote")
    parser.add_argument("--batch", type=int, default=16, help="the embedded recipe's evals.batch_size")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="auto: what quantlab computes in here"
    )
    args = parser.parse_args()
    from quantlab.models import default_dtype

    dtype = default_dtype("cpu") if args.dtype == "auto" else getattr(torch, args.dtype)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.cpu.get_capabilities().get('cpu_name')}"
    )
    if args.checkpoint is not None:
        forward_three_ways(args.checkpoint, dtype, args.batch, args.tokens, args.repeats)
    rounding_operations(args.batch * args.tokens, 1536, dtype, 5)


if __name__ == "__main__":
    main()
