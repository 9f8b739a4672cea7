"""Why FP8 scores slower than BF16 on a CPU (issue 31): what the activations' rounding costs, side by side.

quantlab scores an FP8 (W8A8) checkpoint on a CPU as compressed-tensors runs it: weights decompressed once at load
(`quantlab.models.cpu_decompression`, status DECOMPRESSED: no per-forward weight rounding), and every Linear's input
rounded to FP8 per token on every forward (dynamic scales), which is the format's arithmetic and what a
faithful score must include. This prints

(1) one forward of the checkpoint at lm-eval's batch shape, with that rounding on and off (compressed-tensors'
    `quantization_enabled`), interleaved, medians; the difference is the rounding's whole cost;
(2) each operation of the rounding (compressed-tensors' per-token dynamic FP8 path: absmax, divide, clamp, cast to
    float8_e4m3fn, cast back, multiply) on one activation-shaped tensor, in ns per element.

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


def forward_with_and_without_rounding(checkpoint: Path, batch: int, tokens: int, repeats: int) -> None:
    from quantlab.models import load_checkpoint

    model, _ = load_checkpoint(checkpoint, torch.float32, "cpu")
    quantized = [module for module in model.modules() if getattr(module, "quantization_scheme", None) is not None]
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens))

    def forward() -> None:
        with torch.inference_mode():
            model(ids)

    forward()  # one warm-up for both settings: a toggle changes no buffer or kernel choice
    found: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for enabled in (True, False):
            for module in quantized:
                module.quantization_enabled = enabled
            started = time.perf_counter()
            forward()
            found[enabled].append(time.perf_counter() - started)
    on, off = statistics.median(found[True]), statistics.median(found[False])
    print(
        f"forward of {batch} x {tokens} tokens, {len(quantized)} quantized Linear layers, {repeats} interleaved pairs"
    )
    print(f"  activations rounded to FP8 (as scored)  {on:8.2f} s")
    print(f"  rounding off (not the format)          {off:8.2f} s")
    print(f"  ratio {on / off:.2f}: the rounding is {100 * (on - off) / on:.0f}% of the scored forward")


def rounding_operations(rows: int, width: int, repeats: int) -> None:
    x = torch.randn(rows, width)
    scale = x.abs().amax(dim=-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    as_fp8 = x.to(torch.float8_e4m3fn)
    steps = {
        "per-token absmax": lambda: x.abs().amax(dim=-1, keepdim=True),
        "divide by scale": lambda: x / scale,
        "clamp to FP8 range": lambda: torch.clamp(x, -448.0, 448.0),
        "cast to float8_e4m3fn": lambda: x.to(torch.float8_e4m3fn),
        "cast back to float32": lambda: as_fp8.to(torch.float32),
        "multiply by scale": lambda: x * scale,
    }
    print(f"rounding steps on a {rows} x {width} float32 activation ({x.numel():,} elements), median of {repeats}")
    total = 0.0
    for name, step in steps.items():
        per_element = seconds(step, repeats) / x.numel() * 1e9
        total += per_element
        print(f"  {name:24s} {per_element:6.2f} ns/element")
    print(f"  {'all steps':24s} {total:6.2f} ns/element")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, help="an FP8 (W8A8 dynamic) checkpoint quantlab wrote")
    parser.add_argument("--batch", type=int, default=16, help="the embedded recipe's evals.batch_size")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.checkpoint is not None:
        forward_with_and_without_rounding(args.checkpoint, args.batch, args.tokens, args.repeats)
    rounding_operations(args.batch * args.tokens, 1536, 5)


if __name__ == "__main__":
    main()
