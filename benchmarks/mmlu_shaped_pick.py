"""`quantlab pick` on an MMLU-shaped sweep: a real lm-eval group config over several subjects of different sizes.

Each subject's task YAML includes lm-eval's own `mmlu/default/mmlu_<subject>.yaml` (its prompt, choices and
metric) and points it at local data in MMLU's schema (cais/mmlu: question, subject, choices, answer); the
group YAML aggregates them as lm-eval's mmlu groups do (accuracy weighted by size). The questions are
synthetic (two-number sums with four numeric choices): a random model scores chance on real MMLU either way,
and what is measured here is the decision, not the model. Sizes default to 30, 60, 120 and 240 questions:
MMLU's spread (100 to 1,534) scaled down, so that the smallest subjects cannot settle a 1-point limit alone.

The sweep runs the tests' tiny random Llama (2 layers, SmolLM2's tokenizer) as bf16, fp8 and AWQ int4 with
`quantlab sweep`, then prints what `quantlab pick` (the recipe's default policy) says. It runs whichever
quantlab the interpreter imports: to compare two versions, run it twice with PYTHONPATH set to each checkout.

    .venv/bin/python benchmarks/mmlu_shaped_pick.py                         # about 2 minutes on 2 cores
    PYTHONPATH=/tmp/before .venv/bin/python benchmarks/mmlu_shaped_pick.py --work /tmp/pick-before
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tests' tiny random Llama and tiny recipe: one definition each
from tiny import save_tiny_llama  # noqa: E402

from recipes import tiny_recipe  # noqa: E402

SUBJECTS = ("abstract_algebra", "anatomy", "astronomy", "high_school_psychology")
GROUP = "ql_mmlu_shaped"
VARIANTS = [
    {"name": "bf16", "method": "bf16"},
    {"name": "fp8", "method": "fp8"},
    {"name": "awq-int4-g32", "method": "awq_int4", "params": {"group_size": 32}},
]
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def questions(subject: str, count: int, seed: int) -> list[dict]:
    """`count` questions in cais/mmlu's schema: "What is a + b?", the sum among four numeric choices."""
    rng = random.Random(f"{subject}-{seed}")
    rows = []
    for _ in range(count):
        a, b = rng.randint(2, 99), rng.randint(2, 99)
        wrong = rng.sample([n for n in range(a + b - 9, a + b + 10) if n != a + b], 3)
        choices = [a + b, *wrong]
        rng.shuffle(choices)
        rows.append(
            {
                "question": f"What is {a} + {b}?",
                "subject": subject,
                "choices": [str(n) for n in choices],
                "answer": choices.index(a + b),
            }
        )
    return rows


def write_tasks(target: Path, sizes: dict[str, int]) -> Path:
    """Task YAMLs over lm-eval's mmlu subject configs, their local data, and the size-weighted group."""
    import lm_eval

    lm_eval_tasks = Path(lm_eval.__file__).parent / "tasks"
    target.mkdir(parents=True, exist_ok=True)
    for subject, size in sizes.items():
        data = {split: target / f"mmlu_{subject}_{split}.jsonl" for split in ("test", "dev")}
        for split, rows in (("test", questions(subject, size, 0)), ("dev", questions(subject, 5, 1))):
            data[split].write_text("".join(json.dumps(row) + "\n" for row in rows))
        config = {
            "include": str(lm_eval_tasks / "mmlu" / "default" / f"mmlu_{subject}.yaml"),
            "task": f"ql_mmlu_{subject}",
            "tag": None,
            "dataset_path": "json",
            "dataset_name": None,
            "dataset_kwargs": {"data_files": {split: str(path) for split, path in data.items()}},
        }
        (target / f"ql_mmlu_{subject}.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    group = {
        "group": GROUP,
        "task": [f"ql_mmlu_{subject}" for subject in sizes],
        "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],  # as lm-eval's mmlu groups
        "metadata": {"version": 2},
    }
    (target / f"_{GROUP}.yaml").write_text(yaml.safe_dump(group, sort_keys=False))
    return target


def recipe(model: Path, tasks: Path) -> dict:
    """The tests' tiny recipe (calibration, quality, measure, no serving), with the MMLU-shaped group as its task."""
    evals = {"include_path": str(tasks), "batch_size": 16, "tasks": [{"name": GROUP}]}
    return tiny_recipe(model, name="mmlu-shaped", evals=evals, variants=VARIANTS)


def quantlab(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, **OFFLINE_ENV, "COLUMNS": "4000"}  # pick prints one line per verdict, unwrapped
    return subprocess.run([sys.executable, "-m", "quantlab", *args], cwd=cwd, env=env, capture_output=True, text=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="work directory (default: a fresh temporary one)")
    parser.add_argument(
        "--sizes", default="30,60,120,240", help="questions per subject, comma-separated (up to 4 subjects)"
    )
    parser.add_argument("--pick-only", action="store_true", help="pick again on the sweep already in --work")
    args = parser.parse_args(argv)
    counts = [int(n) for n in args.sizes.split(",")]
    sizes = dict(zip(SUBJECTS, counts))
    work = args.work or Path(tempfile.mkdtemp(prefix="mmlu-shaped-"))
    work.mkdir(parents=True, exist_ok=True)
    import quantlab as imported

    print(f"quantlab from {Path(imported.__file__).parent}; work in {work}; subjects {sizes}", flush=True)
    model = work / "tiny-llama"
    uri = f"sqlite:///{work / 'store.db'}"
    if not args.pick_only:
        if not (model / "config.json").is_file():
            save_tiny_llama(model)
        path = work / "recipe.yaml"
        path.write_text(yaml.safe_dump(recipe(model, write_tasks(work / "tasks", sizes)), sort_keys=False))
        started = time.monotonic()
        swept = quantlab("sweep", str(path), "--tracking-uri", uri, "--cache-dir", str(work / "cache"), cwd=work)
        print(f"quantlab sweep: exit {swept.returncode} in {time.monotonic() - started:.0f} s", flush=True)
        if swept.returncode != 0:
            print(swept.stdout[-3000:], swept.stderr[-3000:], sep="\n")
            return swept.returncode
    # The recipe's default policy, then every subject named at 1 point beside the group.
    named = [
        arg for subject in [GROUP, *(f"ql_mmlu_{s}" for s in sizes)] for arg in ("--max-drop", f"eval/{subject}/acc=1")
    ]
    for flags in ([], named):
        picked = quantlab("pick", "--experiment", "mmlu-shaped", "--tracking-uri", uri, *flags, cwd=work)
        print(f"\n$ quantlab pick --experiment mmlu-shaped {' '.join(flags)}  (exit {picked.returncode})")
        print(picked.stdout.rstrip(), picked.stderr.rstrip(), sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
