"""Why FP8 scores slower than BF16 on a CPU (issue 31): what the activations' rounding costs, side by side.

quantlab scores an FP8 (W8A8) checkpoint on a CPU as compressed-tensors runs it: weights decompressed once at load
(`quantlab.models.cpu_decompression`, status DECOMPRESSED: no per-forward weight rounding), and every Linear's input
rounded to FP8 per token on every forward (dynamic scales), which is the format's arithmetic and what a
faithful score must include. This prints

(1) a prefill at lm-eval's batch shape and a decode at batch 1 (a served stream), in the compute dtype quantlab
    picks here (`--dtype`), with that rounding done by quantlab.fake_quant (as quantlab scores), by
    compressed-tensors' own functions (torch's cast to FP8 and back, each layer its own: the same values), and off
    (compressed-tensors' `quantization_enabled`), interleaved, medians; the differences are its cost each way;
(2) each operation of the rounding (compressed-tensors' per-token dynamic FP8 path: absmax, divide, clamp, cast to
    float8_e4m3fn, cast back, multiply) on one activation-shaped tensor, in ns per element, and the round trip
    through torch's casts against quantlab.fake_quant.

    .venv/bin/python benchmarks/fp8_activation_cost.py --checkpoint ~/.cache/quantlab/checkpoints/fp8-<key>
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from cpu_dtype import decode_tokens_per_s, prefill_tokens_per_s  # noqa: E402


def seconds(work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


WAYS = ("quantlab.fake_quant (as scored)", "compressed-tensors' own functions", "off (not the format)")


def three_ways(checkpoint: Path, dtype: torch.dtype, batch: int, tokens: int, repeats: int) -> None:
    """A prefill (lm-eval's batch shape) and a decode (a served stream's tokens at batch 1, after a 32-token prompt)
    with the activations' fake quantization done by quantlab.fake_quant, by compressed-tensors' own functions (the
    same values), and not at all; interleaved, medians."""
    from compressed_tensors.quantization.lifecycle import forward, forward_helpers

    from quantlab.models import load_checkpoint

    model, _ = load_checkpoint(checkpoint, dtype, "cpu")  # installs quantlab.fake_quant
    ours = {"round": forward_helpers.round_to_quantized_type_args, "forward": forward.forward_quantize}
    quantized = [module for module in model.modules() if getattr(module, "quantization_scheme", None) is not None]
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens))
    prompt = torch.randint(0, model.config.vocab_size, (1, 32))

    def set_way(way: str) -> None:
        functions = {name: f.original for name, f in ours.items()} if way == WAYS[1] else ours
        forward_helpers.round_to_quantized_type_args = functions["round"]
        forward.forward_quantize = functions["forward"]
        for module in quantized:
            module.quantization_enabled = way != WAYS[2]

    # torch.no_grad, as lm-eval and generate() run (a rounded input is not reused in inference mode)
    def prefill_s() -> float:
        return ids.numel() / prefill_tokens_per_s(model, ids, torch.no_grad, passes=1)

    def decode_ms_per_token(count: int = 16) -> float:
        return 1000 / decode_tokens_per_s(model, prompt, count, torch.no_grad)

    found: dict[tuple[str, str], list[float]] = {}
    prefill_s(), decode_ms_per_token(4)  # one warm-up for all: switching changes no buffer or kernel choice
    for _ in range(repeats):
        for way in WAYS:
            set_way(way)
            found.setdefault((way, "prefill"), []).append(prefill_s())
            found.setdefault((way, "decode"), []).append(decode_ms_per_token())
    set_way(WAYS[0])
    median = {key: statistics.median(times) for key, times in found.items()}
    print(
        f"{dtype}, {len(quantized)} quantized Linear layers, {repeats} interleaved rounds: a prefill of {batch} x "
        f"{tokens} tokens (s) and decode at batch 1 (ms per token)"
    )
    for way in WAYS:
        print(
            f"  fake quantization {way:36s} prefill {median[way, 'prefill']:6.2f} s  decode {median[way, 'decode']:6.1f} ms"
        )
    for figure in ("prefill", "decode"):
        scored, theirs, off = (median[way, figure] for way in WAYS)
        print(
            f"  {figure}: quantlab's / compressed-tensors' own {scored / theirs:.2f}; the fake quantization is "
            f"{100 * (theirs - off) / theirs:.0f}% of it their way, {100 * (scored - off) / scored:.0f}% quantlab's"
        )


def rounding_operations(rows: int, width: int, dtype: torch.dtype, repeats: int) -> None:
    from quantlab.fake_quant import round_to_fp8_e4m3

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
        f"  round to FP8 and back: torch's casts {both_casts / x.numel() * 1e9:.2f}, quantlab.fake_quant "
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
        three_ways(args.checkpoint, dtype, args.batch, args.tokens, args.repeats)
    rounding_operations(args.batch * args.tokens, 1536, dtype, 5)


if __name__ == "__main__":
    main()
