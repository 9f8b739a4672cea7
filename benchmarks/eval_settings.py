"""Which compute dtype, batch size and thread count score fastest here? lm-eval on the embedded model.

Loads the embedded SmolLM2-135M (the GGUF, dequantized once into the cache) the way a sweep's
variant does (`quantlab.models.load_checkpoint`) and scores it with quantlab's own lm-eval call
(`quantlab.evaluate.lm_eval_runner.run_tasks`) on the embedded recipe's first task, once per
setting, in one process. The first setting runs again at the end: the gap between its two runs is
the drift of the machine during the benchmark. Printed per setting: seconds, the score (a batch
size moves padding, hence float sums in the last bits; a dtype moves more), and lm-eval's chosen
batch size for `auto`.

lm-eval's `auto` batch size is left out of the defaults: its probe (`HFLM._detect_batch_size`) runs
five forward passes at batch 64 over the longest request and halves only on an out-of-memory error,
which a CPU with free RAM never raises, so it probes for minutes and then runs at 64
(`--setting float32/auto/2`: 203 s for 4 documents that take 8 s at batch 16).

The thread rows answer issue 15's overlap question on a CPU: if one thread takes about twice as
long as two, two variants side by side on one thread each take as long as one after the other.

    .venv/bin/python benchmarks/eval_settings.py
    .venv/bin/python benchmarks/eval_settings.py --task pydoc_cloze --limit 40 --setting float32/16/2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from sweep_overhead import EVALS_DIR, OFFLINE_ENV, REPO

# dtype / batch size / torch threads
DEFAULT_SETTINGS = (
    "float32/16/2",
    "bfloat16/16/2",
    "float32/4/2",
    "float32/64/2",
    "float32/16/1",
    "float32/16/2",
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="mmlu_dev", help="an lm-eval task (evals/ included; default mmlu_dev)")
    parser.add_argument("--limit", type=int, default=40, help="documents (default 40, as the embedded recipe)")
    parser.add_argument(
        "--setting",
        action="append",
        help=f"DTYPE/BATCH/THREADS, repeatable (default: {', '.join(DEFAULT_SETTINGS)})",
    )
    parser.add_argument("--cache-dir", type=Path, help="quantlab's cache (default: a temporary directory)")
    args = parser.parse_args(argv)
    args.setting = args.setting or list(DEFAULT_SETTINGS)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(OFFLINE_ENV)
    import torch
    import yaml

    from quantlab.evaluate.lm_eval_runner import TaskRequest, run_tasks, task_manager
    from quantlab.measure.provenance import cpu_model_name, visible_cores
    from quantlab.models import load_checkpoint, materialize, resolve_source
    from quantlab.recipe import ModelSpec

    embedded = yaml.safe_load((REPO / "recipes" / "smollm2-135m.yaml").read_text())["model"]
    with tempfile.TemporaryDirectory(prefix="quantlab-eval-settings-") as scratch:
        cache_dir = args.cache_dir or Path(scratch)
        source = materialize(resolve_source(ModelSpec(**embedded), REPO / "recipes"), cache_dir)
        checkpoint = Path(source.location)
        task_manager(EVALS_DIR)  # built once, as a sweep's fork server does: not part of any row
        load_before = os.getloadavg()[0]
        rows = []
        for text in args.setting:
            dtype, batch, threads = text.split("/")
            torch.set_num_threads(int(threads))
            model, tokenizer = load_checkpoint(checkpoint, getattr(torch, dtype), "cpu")
            started = time.perf_counter()
            (scores,) = run_tasks(
                model,
                tokenizer,
                [TaskRequest(args.task, limit=args.limit)],
                EVALS_DIR,
                batch if batch == "auto" else int(batch),
            )
            seconds = time.perf_counter() - started
            rows.append((text, seconds, scores.primary.value))
            print(f"{text}: {seconds:.1f} s", file=sys.stderr)
            del model
        load_after = os.getloadavg()[0]

    print(
        f"embedded model, lm-eval {args.task} limit {args.limit}, via quantlab's run_tasks (task index built before the first row)"
    )
    print(
        f"machine: {cpu_model_name()}, {visible_cores()} cores visible; 1-minute load average {load_before:.2f} before, {load_after:.2f} after"
    )
    print()
    print("| dtype / batch / threads | seconds | vs first | primary score |")
    print("|---|---:|---:|---:|")
    first = rows[0][1]
    for text, seconds, value in rows:
        print(f"| {text} | {seconds:.1f} | {seconds / first:.2f} | {value:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
