"""Served figures against the batch loop and the modeled ceiling, side by side in one run, for each variant.

For each variant of the recipe, one after another in this process (checkpoints from the cache, built if missing):

1. the measure stage's loop: the loaded model generating the serving workload's lengths (serving.prompt_tokens,
   serving.output_tokens; greedy, no early stop) at batch 1 and at the highest serving concurrency, in-process;
2. the serve stage: the same checkpoint behind the recipe's server under guidellm's load (its serving section);
3. the modeled figures: the decode ceiling on this machine (measured copy bandwidth, weights as loaded) at batch 1
   and at the peak level's concurrency, and quantlab's modeled serving rate on the recipe's target accelerator.

Then the ratios: served / loop at the same concurrency (what the server's HTTP, scheduling and tokenizer cost),
served peak / modeled ceiling here, loop / modeled ceiling here. Run it alone on the machine:

    .venv/bin/python benchmarks/serving_vs_loop.py --cache-dir ~/.cache/quantlab
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2-135m.yaml")
    parser.add_argument("--variant", action="append", help="only these variants (repeatable); default: all")
    parser.add_argument("--cache-dir", type=Path, required=True, help="checkpoints are taken from (or built in) it")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    from quantlab.models import load_checkpoint, materialize, pick_device, pick_dtype, resolve_source
    from quantlab.quantize import METHODS
    from quantlab.recipe import load_recipe
    from quantlab.stages.measure import measure
    from quantlab.stages.quantize import quantize_variant
    from quantlab.stages.serve import VariantServer, serve_load

    args = parse_args(argv)
    loaded = load_recipe(args.recipe)
    recipe, recipe_dir = loaded.recipe, loaded.path.parent
    serving = recipe.serving
    top = max(serving.concurrency)
    # The loop times the serving workload's lengths, at batch 1 and at the top serving concurrency.
    loop_settings = recipe.measure.model_copy(
        update={"prompt_tokens": serving.prompt_tokens, "output_tokens": serving.output_tokens, "batch_sizes": [1, top]}
    )
    device = pick_device(recipe.runtime)
    dtype = pick_dtype(recipe.runtime, device)
    source = materialize(resolve_source(recipe.model, recipe_dir), args.cache_dir)
    rows = []
    for variant in recipe.variants:
        if args.variant and variant.name not in args.variant:
            continue
        checkpoint = quantize_variant(source, variant, recipe.calibration, recipe_dir, args.cache_dir, device, False)
        model, tokenizer = load_checkpoint(checkpoint.path, dtype, device)
        cost, _ = measure(model, tokenizer, loop_settings, checkpoint.path, None)
        del model, tokenizer
        stored = METHODS[variant.method].stored_format
        with (
            tempfile.TemporaryDirectory() as logs,
            VariantServer(
                checkpoint.path, variant.name, stored, recipe, device, dtype, args.cache_dir, Path(logs)
            ) as on,
        ):
            served = serve_load(on.ready(), serving, recipe.measure, recipe_dir, dtype, cost, Path(logs))
        rows.append((variant.name, cost, served.metrics))
        print(f"{variant.name}: done", flush=True)

    levels = ", ".join(f"c{level}" for level in serving.concurrency)
    print(
        f"\n{recipe.name} on {device}: {serving.prompt_tokens} prompt + {serving.output_tokens} output tokens; "
        f"loop at batch 1 and {top}, served at {levels} ({serving.requests_per_level} requests each)\n"
    )
    header = (
        f"{'variant':<16}{'loop b1':>9}{f'loop b{top}':>9}{'srv c1':>9}{f'srv c{top}':>9}{'model b1':>10}"
        f"{'model pk':>10}{'target':>10}{'srv/loop c1':>13}{f'srv/loop c{top}':>13}{'peak/model':>12}{'loop/model':>12}"
    )
    print(header + "\n" + "-" * len(header))
    for name, cost, metrics in rows:
        loop1, loop_top = cost.get("cost/decode_tokens_per_s"), cost.get(f"cost/decode_tokens_per_s_bs{top}")
        served1, served_top = (
            metrics.get("cost/serving/c1/output_tokens_per_s"),
            metrics.get(f"cost/serving/c{top}/output_tokens_per_s"),
        )
        model1, model_peak = (
            cost.get("cost/local_roofline_decode_tokens_per_s"),
            metrics.get("cost/serving/modeled_tokens_per_s"),
        )
        target = cost.get("cost/serving_decode_tokens_per_s")
        print(
            f"{name:<16}{_n(loop1):>9}{_n(loop_top):>9}{_n(served1):>9}{_n(served_top):>9}{_n(model1):>10}"
            f"{_n(model_peak):>10}{_n(target):>10}{_r(served1, loop1):>13}{_r(served_top, loop_top):>13}"
            f"{_r(metrics.get('cost/serving/peak_tokens_per_s'), model_peak):>12}{_r(loop1, model1):>12}"
        )
    print(
        "\nloop b<N>: decode tokens/s of the in-process loop (all sequences); srv c<N>: served output tokens/s at N "
        "streams; model b1 / model pk: the memory-bound decode ceiling here (measured copy bandwidth) at batch 1 / at "
        "the served peak's concurrency; target: quantlab's modeled serving rate on the recipe's target accelerator "
        "(not this machine, shown for scale)."
    )


def _n(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _r(numerator: float | None, denominator: float | None) -> str:
    return "-" if not numerator or not denominator else f"{numerator / denominator:.2f}"


if __name__ == "__main__":
    main()
