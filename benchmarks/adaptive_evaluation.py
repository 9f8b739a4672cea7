"""Adaptive against full evaluation, side by side in one run: documents and seconds each variant's tasks take, and
whether `pick`'s verdict on every drop check is the same wherever full evaluation decided it.

The model is the tests' tiny random Llama (2 layers, SmolLM2's tokenizer). A random model scores chance on any real
task, so a drop could only be noise; one task here is made one the baseline can do: the bundled pydoc_cloze questions
with each answer set to the choice the baseline itself scores highest (real lm-eval scoring, read from its logged
samples). The baseline then scores 100% on it, and a variant's drop is the share of answers it changes: what is
measured is the decision, not the model. The second task is the bundled mmlu_dev, at chance for every variant.

Variants are round-to-nearest copies of the baseline's linear weights (symmetric, per output channel, or per group of
32 inputs): a copy with no change, INT8, INT4 and INT2, from no damage to a great deal; and a broken one, the copy
with its final norm's sign inverted (a kernel bug's kind of damage). A random model's choice among continuations
follows their lengths more than its weights, so even large damage changes fewer answers than on a trained model. Each is scored twice by the
evaluate stage itself, in full and with `evals.adaptive`, and paired with the baseline as a sweep pairs it; `pick`
judges both sets of figures under one policy (`max_drop_any_task`, every candidate at the policy's level).

    .venv/bin/python benchmarks/adaptive_evaluation.py            # 400 + 200 documents, a few minutes on 2 cores
    .venv/bin/python benchmarks/adaptive_evaluation.py --quick    # 60 + 40 documents, three variants, a 25-pt limit
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tests' tiny random Llama: one definition
from tiny import save_tiny_llama  # noqa: E402

CLOZE = "cloze_by_baseline"
ALPHA = 0.025


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer documents and variants: a check that it runs")
    parser.add_argument("--cloze-docs", type=int, default=None, help="documents of the cloze task (default 400)")
    parser.add_argument("--mmlu-docs", type=int, default=None, help="documents of mmlu_dev (default 200)")
    parser.add_argument("--limit", type=float, default=None, help="max_drop_any_task, points (default 10; quick 25)")
    parser.add_argument("--work", type=Path, default=None, help="where the model and tasks go (default: a temp dir)")
    return parser.parse_args(argv)


def rounded_copy(model, bits: int | None, group: int | None = None):
    """A copy of `model` whose decoder linear weights are rounded to `bits` (symmetric, per output channel, or per
    `group` inputs); None: an unchanged copy."""
    import torch

    found = copy.deepcopy(model)
    if bits is None:
        return found
    top = 2 ** (bits - 1) - 1
    with torch.no_grad():
        for name, module in found.named_modules():
            if isinstance(module, torch.nn.Linear) and "lm_head" not in name:
                weight = module.weight
                shaped = weight.reshape(weight.shape[0], -1, group) if group else weight[:, None, :]
                scale = shaped.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / max(top, 1)
                module.weight.copy_((torch.round(shaped / scale).clamp(-top - 1, top) * scale).reshape(weight.shape))
    return found


def cloze_task(model, tokenizer, documents: int, target: Path) -> Path:
    """An include directory holding the cloze task whose answers are the baseline's own choices."""
    from lm_eval.evaluator import simple_evaluate

    from quantlab.evaluate.lm_eval_runner import SEEDS, hf_language_model, task_manager

    results = simple_evaluate(
        model=hf_language_model(model, tokenizer, 8),
        tasks=["pydoc_cloze"],
        limit=documents,
        task_manager=task_manager(REPO / "evals", False),
        log_samples=True,
        **SEEDS,
    )
    choices = {}
    for sample in results["samples"]["pydoc_cloze"]:
        loglikelihoods = [float(resp[0]) for resp in sample["filtered_resps"]]
        choices[sample["doc_id"]] = max(range(len(loglikelihoods)), key=loglikelihoods.__getitem__)
    rows = [json.loads(line) for line in (REPO / "evals/data/pydoc_cloze.jsonl").read_text().splitlines() if line]
    (target / "data").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "evals/jsonl_dataset.py", target / "jsonl_dataset.py")
    lines = [json.dumps(row | {"answer": choices[i]}) for i, row in enumerate(rows[:documents])]
    (target / "data" / f"{CLOZE}.jsonl").write_text("\n".join(lines) + "\n")
    shutil.copy(REPO / "evals/mmlu_dev.yaml", target / "mmlu_dev.yaml")
    shutil.copy(REPO / "evals/data/mmlu_dev.jsonl", target / "data/mmlu_dev.jsonl")
    yaml = (REPO / "evals/pydoc_cloze.yaml").read_text()
    yaml = yaml.replace("task: pydoc_cloze", f"task: {CLOZE}").replace("data/pydoc_cloze.jsonl", f"data/{CLOZE}.jsonl")
    (target / f"{CLOZE}.yaml").write_text(yaml.replace("tag: quantlab_bundled\n", ""))
    return target


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from quantlab.decision import pick
    from quantlab.frontier import Axis, VariantSummary
    from quantlab.jobs import BaselineOutputs
    from quantlab.metrics import adaptive_key, declared_from_tags
    from quantlab.policy import CandidateControl, Policy
    from quantlab.recipe import EvalSettings, EvalTaskSpec
    from quantlab.stages.evaluate import AdaptivePlan, answer_damage, evaluate_tasks

    torch.manual_seed(0)
    cloze_docs = args.cloze_docs or (60 if args.quick else 400)
    mmlu_docs = args.mmlu_docs or (40 if args.quick else 200)
    limit = args.limit or (25.0 if args.quick else 10.0)  # a limit the documents can show
    variants = {"copy": (None, None), "int8": (8, None), "int4-g32": (4, 32), "int2-g32": (2, 32), "sign-bug": None}
    if args.quick:
        variants.pop("int4-g32")
    work = args.work or Path(tempfile.mkdtemp(prefix="quantlab-adaptive-bench-"))
    model_dir = work / "tiny-llama"
    if not (model_dir / "config.json").is_file():
        save_tiny_llama(model_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    include = cloze_task(model, tokenizer, cloze_docs, work / "tasks")
    tasks = [EvalTaskSpec(name=CLOZE, limit=cloze_docs), EvalTaskSpec(name="mmlu_dev", limit=mmlu_docs)]
    full_settings = EvalSettings(tasks=tasks, batch_size=8)
    adaptive_settings = full_settings.model_copy(update={"adaptive": True})
    quiet = lambda step: None  # noqa: E731
    policy = Policy(max_drop_any_task=limit, candidates=CandidateControl.NONE)

    baseline_scores = evaluate_tasks(model, tokenizer, full_settings, include, quiet, None)
    baseline = BaselineOutputs(
        None, baseline_scores.documents, baseline_scores.groups, baseline_scores.scores, baseline_scores.primary
    )
    plan = AdaptivePlan(baseline, policy, ALPHA)

    def summary(name: str, outcome, damage=None) -> VariantSummary:
        metrics = outcome.metrics | (damage.metrics if damage else {}) | {"cost/weight_bytes": 1.0}
        return VariantSummary(
            name, "bench", True, metrics, outcome.tags, name == "bf16", declared_from_tags(outcome.tags)
        )

    rows, full_runs, adaptive_runs = [], [summary("bf16", baseline_scores)], [summary("bf16", baseline_scores)]
    for name, rounding in variants.items():
        variant = rounded_copy(model, *(rounding or (None, None)))
        if rounding is None:
            with torch.no_grad():
                variant.model.norm.weight.neg_()
        started = time.perf_counter()
        full = evaluate_tasks(variant, tokenizer, full_settings, include, quiet, None)
        full_seconds = time.perf_counter() - started
        started = time.perf_counter()
        staged = evaluate_tasks(variant, tokenizer, adaptive_settings, include, quiet, None, plan)
        adaptive_seconds = time.perf_counter() - started
        full_runs.append(summary(name, full, answer_damage(full, baseline)))
        adaptive_runs.append(summary(name, staged, answer_damage(staged, baseline)))
        rows.append((name, full, staged, full_seconds, adaptive_seconds))
        del variant

    documents = {CLOZE: cloze_docs, "mmlu_dev": mmlu_docs}
    objective = Axis("cost/weight_bytes", False)
    decided = {
        kind: pick(runs, "bf16", policy, objective, documents=documents)
        for kind, runs in (("full", full_runs), ("adaptive", adaptive_runs))
    }
    print(f"policy: max_drop_any_task {limit:g} pts, one-sided {ALPHA}, stages {adaptive_settings.adaptive_stages}")
    header = f"{'variant':<10} {'task':<27} {'docs full':>9} {'adaptive':>8}  {'stopped':<44} {'full verdict':<14} {'adaptive':<14}"
    print(header)
    print("-" * len(header))
    same, differ, used, total = 0, 0, 0, 0
    for name, _, staged, full_seconds, adaptive_seconds in rows:
        checks = {
            kind: {check.metric: check.status.value for check in decided[kind].verdict(name).checks} for kind in decided
        }
        for task in documents:
            task_used = int(staged.metrics[adaptive_key(task, "documents_used")])
            task_total = int(staged.metrics[adaptive_key(task, "documents_total")])
            used, total = used + task_used, total + task_total
            reason = staged.tags.get(f"quantlab.adaptive/{task}", "").split(" (")[0][:44]
            keys = sorted(key for key in checks["full"] if f"/{task}/" in key)
            for key in keys:
                verdict_full, verdict_adaptive = checks["full"][key], checks["adaptive"].get(key, "missing")
                if verdict_full != "undecided":
                    same, differ = (same + 1, differ) if verdict_full == verdict_adaptive else (same, differ + 1)
                metric = key.rsplit("/", 1)[-1]
                print(
                    f"{name:<10} {task + '/' + metric:<27} {task_total:>9} {task_used:>8}  {reason:<44} "
                    f"{verdict_full:<14} {verdict_adaptive:<14}"
                )
        print(f"{name:<10} {'seconds':<27} {full_seconds:>9.1f} {adaptive_seconds:>8.1f}")
    print(
        f"documents: {used:,} of {total:,} ({used / total:.0%}); verdicts full evaluation decided: {same} the same, "
        f"{differ} different"
    )
    return 0 if differ == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
