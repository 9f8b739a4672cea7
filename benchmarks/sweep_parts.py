"""The sweep against the sum of its parts run directly (issue 31: the whole process at most 1.05x the parts).

A first, untimed `quantlab sweep` of the recipe fills a shared `--cache-dir`: checkpoints quantized, a GGUF model
converted, the recipe's checks remembered. Then each repetition times, from this process, both sides on those same
cached checkpoints, each a fresh Python process (interpreter start and imports count everywhere):

(a) the parts, per variant (the baseline first), as a user would write them without quantlab:
    - lm-eval: `lm_eval.simple_evaluate` on `HFLM(pretrained=<checkpoint dir>)` with the recipe's tasks, limits,
      shots and batch size, one call per distinct (limit, shots) as quantlab batches them, on quantlab's runtime
      default device and dtype (bfloat16 on CUDA and on CPUs with BF16 instructions, else float32). Task index: `TaskManager(include_path=evals,
      include_defaults=False)` when every task is defined there (as quantlab builds it; lm-eval's own ~10k YAMLs
      cost 10-30 s per process on 2 cores), `--task-index full` for `TaskManager(include_path=evals)`.
      Excludes: the per-document pairing, flips and recovery quantlab derives from the samples (pure, cheap).
    - server + guidellm: the variant's server started with the command the untimed sweep logged for it
      (`served.command`, its variables included, on a free port), polled until GET /health answers, one warm-up
      completion (quantlab sends it too), `python -m guidellm run --scenario` with the scenario quantlab builds
      (`quantlab.serving.load.scenario`, same warm-up, levels, request counts and SLOs) under the variables
      quantlab sets (`guidellm_environment`: one worker process on CPU, a fork server), then the server's process
      group stopped (SIGTERM). Excludes: summarizing the report (goodput, modeled ceiling, chart).
    - damage: the checkpoint loaded with `AutoModelForCausalLM.from_pretrained(dir, dtype=...)`, the recipe's
      quality corpus (`quantlab.corpora.load_texts`, the one quantlab import: it only reads CPython's pydoc text)
      tokenized without special tokens and cut to `quality.max_tokens`, scored in non-overlapping windows of
      `quality.window` (each window's first token unscored, as quantlab's windows do). The baseline's part saves
      its log-probabilities (fp16, as quantlab stores them); a variant's part computes per token
      KL(baseline || variant) from them, perplexity and top-1 agreement. Excludes: quantlab's KL error bound,
      percentiles, paired statistics; recipes with `quality.stride` or `quality.contexts` are refused.
(b) `quantlab sweep RECIPE` into a fresh MLflow store (its tables created beforehand, untimed: a user's store
    exists), so nothing is copied from a finished run. Before each timed sweep the cache's `references/` (the
    baseline's stored pass) and `drawn-figures/` are removed, so the sweep computes the baseline's pass and draws
    its figures as the parts do their work; checkpoints, the converted model and remembered checks stay
    (`--keep-cache` keeps everything). The script checks that every variant reused its cached checkpoint.

Repetitions interleave (a) and (b), alternating which goes first. Printed: each part's seconds per variant, the sum
of the parts, the sweep's wall time, the ratio sweep / sum, the parts' own phases, the sweep's stage times from its
MLflow runs (`time/<stage>_seconds`, summed over variants) and, as a check that both sides did the same work, the
scores, KL and served throughput of both. Stages with no part here (measure: the batch loop, memory, bandwidth)
count in the sweep's time; the ratio without them is printed too.

    .venv/bin/python benchmarks/sweep_parts.py                                   # tiny random Llama: bf16, fp8
    .venv/bin/python benchmarks/sweep_parts.py --recipe recipes/smollm2-135m.yaml --repeats 3   # minutes; quiet machine
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from sweep_overhead import (
    EVALS_DIR,
    OFFLINE_ENV,
    phase_lines,
    run_benchmark,
    save_tiny_llama,
    summary_line,
    timed_process,
)

PART_FLAG = "--part"  # internal: this script, run as one part in its own process
PARTS = ("lm-eval", "damage", "serve")
CLEARED = ("references", "drawn-figures")  # what a timed sweep must compute again (see the docstring)
VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


@dataclass(frozen=True)
class Repetition:
    parts: dict[str, float]  # "<part> <variant>" -> whole-process seconds
    phases: dict[str, dict[str, float]]  # part -> phase -> seconds, summed over variants
    results: dict[str, dict[str, Any]]  # "<part> <variant>" -> what the part found
    sweep_seconds: float
    sweep_stages: dict[str, float]  # stage -> seconds, summed over variants
    sweep_runs: dict[str, Any]  # variant -> its MLflow run


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", type=Path, default=None, help="default: a tiny random Llama's bf16 + fp8 recipe")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of each side (default 3)")
    parser.add_argument(
        "--task-index",
        choices=("included", "full"),
        default="included",
        help="the lm-eval part's TaskManager: include_path's tasks alone when they suffice (default), or all",
    )
    parser.add_argument("--keep-cache", action="store_true", help="leave the baseline's pass and figures cached")
    parser.add_argument("--work-dir", type=Path, default=None, help="keep everything here (default: a temp dir)")
    parser.add_argument(PART_FLAG, nargs=2, metavar=("PART", "SPEC"), default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


# --- (a) the parts, each run as its own process ----------------------------------------------------


def part_lm_eval(spec: Mapping[str, Any]) -> dict[str, Any]:
    phases: dict[str, float] = {}
    mark = time.perf_counter()
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    phases["import"], mark = time.perf_counter() - mark, time.perf_counter()
    model = HFLM(
        pretrained=spec["checkpoint"], device=spec["device"], dtype=spec["dtype"], batch_size=spec["batch_size"]
    )
    phases["load"], mark = time.perf_counter() - mark, time.perf_counter()
    names = {task for call in spec["calls"] for task in call["tasks"]}
    manager = None
    if spec["task_index"] == "included":
        manager = TaskManager(include_path=spec["include_path"], include_defaults=False)
        manager = manager if names <= set(manager.all_subtasks) else None
    manager = manager or TaskManager(include_path=spec["include_path"])
    phases["task index"], mark = time.perf_counter() - mark, time.perf_counter()
    scores: dict[str, dict[str, float]] = {}
    for call in spec["calls"]:
        results = lm_eval.simple_evaluate(
            model=model, tasks=call["tasks"], limit=call["limit"], num_fewshot=call["num_fewshot"], task_manager=manager
        )
        scores |= {task: {k: v for k, v in m.items() if isinstance(v, float)} for task, m in results["results"].items()}
    phases["evaluate"] = time.perf_counter() - mark
    return {"phases": phases, "scores": scores}


def part_damage(spec: Mapping[str, Any]) -> dict[str, Any]:
    phases: dict[str, float] = {}
    mark = time.perf_counter()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from quantlab.corpora import load_texts

    phases["import"], mark = time.perf_counter() - mark, time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(spec["checkpoint"])
    dtype = getattr(torch, spec["dtype"])
    model = AutoModelForCausalLM.from_pretrained(spec["checkpoint"], dtype=dtype).to(spec["device"]).eval()
    phases["load"], mark = time.perf_counter() - mark, time.perf_counter()
    text = "\n\n".join(load_texts(spec["corpus"], Path(spec["recipe_dir"])))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: spec["max_tokens"]]
    window = spec["window"]
    windows = [ids[start : start + window] for start in range(0, len(ids), window)]
    windows = [w for w in windows if len(w) > 1]
    phases["corpus"], mark = time.perf_counter() - mark, time.perf_counter()
    baseline = None if spec["is_baseline"] else torch.load(spec["baseline_file"])
    stored, nll, kld, top1, row = [], [], [], [], 0
    with torch.inference_mode():
        for w in windows:
            tokens = torch.tensor([w], device=spec["device"])
            logprobs = model(input_ids=tokens).logits[0, :-1].float().log_softmax(-1)  # position i predicts i + 1
            nll.append(-logprobs.gather(-1, tokens[0, 1:, None])[:, 0])
            if baseline is None:
                stored.append(logprobs.to(torch.float16).cpu())
            else:
                base = baseline[row : row + len(logprobs)].to(logprobs.device).float().log_softmax(-1)
                kld.append((base.exp() * (base - logprobs)).sum(-1))
                top1.append(base.argmax(-1) == logprobs.argmax(-1))
                row += len(logprobs)
    if baseline is None:
        torch.save(torch.cat(stored), spec["baseline_file"])
    phases["forward + KL"] = time.perf_counter() - mark
    found = {"ppl": float(torch.cat(nll).mean().exp()), "tokens": int(sum(len(w) - 1 for w in windows))}
    if kld:
        found |= {"kld_mean": float(torch.cat(kld).mean()), "top1_agreement": float(torch.cat(top1).float().mean())}
    return {"phases": phases, "scores": found}


def part_serve(spec: Mapping[str, Any]) -> dict[str, Any]:
    phases: dict[str, float] = {}
    mark = time.perf_counter()
    work = Path(spec["work_dir"])
    work.mkdir(parents=True, exist_ok=True)
    url = f"http://127.0.0.1:{spec['port']}"
    with open(work / "server.log", "wb") as log:
        server = subprocess.Popen(
            spec["server_command"],
            env={**os.environ, **spec["server_env"]},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped as a whole
        )
    try:
        deadline = time.monotonic() + spec["startup_timeout_s"]
        while not _healthy(url):
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not become healthy; see {work / 'server.log'}")
            time.sleep(0.25)
        phases["server start"], mark = time.perf_counter() - mark, time.perf_counter()
        warm_up = urllib.request.Request(
            f"{url}/v1/completions", json.dumps(spec["warm_up_body"]).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(warm_up, timeout=600) as answer:
            answer.read()
        phases["warm-up request"], mark = time.perf_counter() - mark, time.perf_counter()
        (work / "scenario.json").write_text(json.dumps(spec["scenario"]))
        command = [sys.executable, "-m", "guidellm", "run", "--scenario", "scenario.json"]
        # guidellm reads a .env from its working directory: `work` has none.
        subprocess.run(
            [*command, "--disable-console-interactive"],
            cwd=work,
            env={**os.environ, **spec["guidellm_env"]},
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        phases["guidellm"], mark = time.perf_counter() - mark, time.perf_counter()
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    phases["server stop"] = time.perf_counter() - mark
    return {"phases": phases, "scores": {"report": spec["scenario"]["spec"]["outputs"][0]["path"]}}


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as answer:
            return answer.status == 200
    except OSError:
        return False


RUNNERS = {"lm-eval": part_lm_eval, "damage": part_damage, "serve": part_serve}


# --- the benchmark ---------------------------------------------------------------------------------


def tiny_recipe(work: Path) -> Path:
    model = save_tiny_llama(work / "tiny-llama", max_position_embeddings=2048)
    recipe = {
        "name": "sweep-parts-tiny",
        "model": {"source": str(model)},
        "baseline": "bf16",
        "variants": [{"name": "bf16", "method": "bf16"}, {"name": "fp8", "method": "fp8"}],
        "evals": {
            "include_path": str(EVALS_DIR),
            "batch_size": 8,
            "tasks": [{"name": "mmlu_dev", "limit": 20}, {"name": "pydoc_cloze", "limit": 20}],
        },
        "quality": {"max_tokens": 512, "window": 128},
        "serving": {"prompt_tokens": 16, "output_tokens": 16, "concurrency": [1, 4], "requests_per_level": 8},
    }
    path = work / "sweep-parts-tiny.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def check_recipe(loaded) -> None:
    """What the direct parts implement; anything else is refused (exit 2, one line)."""
    recipe, problems = loaded.recipe, []
    if recipe.quality.enabled and (
        recipe.quality.stride not in (None, recipe.quality.window) or recipe.quality.contexts
    ):
        problems.append("quality.stride / quality.contexts: the direct damage part scores plain windows only")
    if recipe.evals.engine != "reference":
        problems.append(f"evals.engine: {recipe.evals.engine}: the direct lm-eval part scores the loaded model only")
    for task in recipe.evals.tasks:
        extra = task.model_dump(exclude_none=True, exclude={"name", "limit", "num_fewshot", "apply_chat_template"})
        if extra or task.apply_chat_template:
            problems.append(f"evals.tasks.{task.name}: the direct lm-eval part takes limit and num_fewshot only")
    if problems:
        print(f"{loaded.path}: {problems[0]}", file=sys.stderr)
        raise SystemExit(2)


def lm_eval_calls(recipe) -> list[dict[str, Any]]:
    """One simple_evaluate call per distinct (limit, shots), tasks in recipe order."""
    calls: dict[tuple, list[str]] = {}
    for task in recipe.evals.tasks:
        calls.setdefault((task.limit, task.num_fewshot), []).append(task.name)
    return [{"limit": limit, "num_fewshot": shots, "tasks": tasks} for (limit, shots), tasks in calls.items()]


def run_sweep(recipe: Path, store: Path, cache_dir: Path, cwd: Path, name: str) -> tuple[float, dict[str, Any]]:
    """Wall seconds of `quantlab sweep RECIPE` into `store`, and its variant runs by variant name."""
    from quantlab import tracking

    uri = f"sqlite:///{store}"
    list(tracking.open_store(uri).experiments())  # the store's tables, created before the clock starts
    command = [sys.executable, "-m", "quantlab", "sweep", str(recipe)]
    command += ["--tracking-uri", uri, "--cache-dir", str(cache_dir)]
    seconds, _ = timed_process(command, cwd)
    opened = tracking.open_store(uri)
    runs = tracking.child_runs(opened, tracking.latest_sweep(opened, name).run_id)
    return seconds, {run.tags["quantlab.variant"]: run for run in runs}


def run_part(part: str, spec: dict[str, Any], spec_path: Path, cwd: Path) -> tuple[float, dict[str, Any]]:
    spec_path.write_text(json.dumps(spec))
    seconds, result = timed_process(
        [sys.executable, str(Path(__file__).resolve()), PART_FLAG, part, str(spec_path)], cwd
    )
    return seconds, json.loads(result.stdout.strip().splitlines()[-1])


def server_command(shown: str, port: int | str) -> tuple[dict[str, str], list[str]]:
    """(variables, command line) of a logged `served.command` (NAME=value ... command), on `port`."""
    words = shlex.split(shown)
    count = next(i for i, word in enumerate(words) if not VARIABLE.match(word))
    env, command = dict(word.split("=", 1) for word in words[:count]), words[count:]
    command[command.index("--port") + 1] = str(port)
    return env, command


def serve_spec(loaded, run, checkpoint: Path, work: Path) -> dict[str, Any]:
    """The server's command as the untimed sweep logged it (on a free port), and quantlab's guidellm scenario."""
    from quantlab.host_share import visible_cores
    from quantlab.serving.launcher import free_port
    from quantlab.serving.load import guidellm_environment, request_body, scenario

    recipe, port = loaded.recipe, free_port()
    env, command = server_command(run.params["served.command"], port)
    if "OMP_NUM_THREADS" in env:
        # The untimed sweep may have run two variants at once (half the cores each); a variant alone on the host
        # gets them all, as the timed sweep's variants do (`same_work` compares the commands).
        env["OMP_NUM_THREADS"] = str(visible_cores())
    engine = run.params["served.engine"]
    prompts = (loaded.path.parent / recipe.serving.prompts).resolve() if recipe.serving.prompts else None
    report = work / "guidellm.json"
    body = {"model": str(checkpoint), "prompt": "Hello", **request_body(engine, recipe.serving.output_tokens)}
    device = run.params["runtime.device"]
    return {
        "port": port,
        "work_dir": str(work),
        "server_command": command,
        "server_env": env | {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
        "startup_timeout_s": recipe.serving.startup_timeout_s,
        "warm_up_body": {key: value for key, value in body.items() if value is not None},
        "scenario": scenario(recipe.serving, engine, f"http://127.0.0.1:{port}", checkpoint, prompts, report),
        "guidellm_env": guidellm_environment(1 if device == "cpu" else None),
    }


def run_parts(loaded, order: Sequence[str], first_runs: Mapping[str, Any], args, work: Path, index: int):
    recipe = loaded.recipe
    parts, results, phases = {}, {}, {}
    part_dir = work / f"parts-{index}"
    baseline_file = part_dir / "baseline-logprobs.pt"
    part_dir.mkdir(parents=True, exist_ok=True)
    for variant in order:
        run = first_runs[variant]
        checkpoint = Path(run.tags["quantlab.checkpoint"])
        # The device and dtype the sweep ran the variant on (quantlab's runtime default, `models.pick_dtype`).
        common = {"checkpoint": str(checkpoint), "device": run.params["runtime.device"]}
        common["dtype"] = run.params["runtime.compute_dtype"]
        specs: dict[str, dict[str, Any]] = {}
        if recipe.evals.tasks:
            specs["lm-eval"] = common | {
                "batch_size": recipe.evals.batch_size,
                "include_path": str(loaded.include_path) if loaded.include_path else None,
                "task_index": args.task_index,
                "calls": lm_eval_calls(recipe),
            }
        if recipe.quality.enabled:
            specs["damage"] = common | {
                "corpus": recipe.quality.corpus,
                "recipe_dir": str(loaded.path.parent),
                "max_tokens": recipe.quality.max_tokens,
                "window": recipe.quality.window,
                "is_baseline": variant == recipe.baseline,
                "baseline_file": str(baseline_file),
            }
        if recipe.serving.enabled:
            specs["serve"] = serve_spec(loaded, run, checkpoint, part_dir / f"serve-{variant}")
        for part, spec in specs.items():
            print(f"  part {part} {variant}", file=sys.stderr)
            seconds, found = run_part(part, spec, part_dir / f"{part}-{variant}.json", work)
            parts[f"{part} {variant}"], results[f"{part} {variant}"] = seconds, found["scores"]
            if part == "serve":
                results[f"{part} {variant}"]["command"] = [spec["server_env"], spec["server_command"]]
            summed = phases.setdefault(part, {})
            for name, value in found["phases"].items():
                summed[name] = summed.get(name, 0.0) + value
    return parts, phases, results


def stage_times(runs: Mapping[str, Any]) -> dict[str, float]:
    total: dict[str, float] = {}
    for run in runs.values():
        for key, value in run.metrics.items():
            if key.startswith("time/") and key.endswith("_seconds"):
                stage = key.removeprefix("time/").removesuffix("_seconds")
                total[stage] = total.get(stage, 0.0) + value
    return total


def same_work(repetition: Repetition) -> list[str]:
    """Both sides' figures from the last repetition: lm-eval accuracy, KL, served output tokens/s per level."""
    from quantlab.serving.levels import load_levels

    lines = []
    for variant, run in repetition.sweep_runs.items():
        shown = []
        for task, metrics in repetition.results.get(f"lm-eval {variant}", {}).items():
            if "acc,none" in metrics:
                sweep = run.metrics.get(f"eval/{task}/acc")
                shown.append(f"{task} acc {metrics['acc,none']:.3f} / {_f(sweep, '.3f')}")
        damage = repetition.results.get(f"damage {variant}", {})
        if "kld_mean" in damage:
            shown.append(f"KL {damage['kld_mean']:.4g} / {_f(run.metrics.get('quality/kld_mean'), '.4g')}")
        shown.append(f"ppl {_f(damage.get('ppl'), '.4g')} / {_f(run.metrics.get('quality/ppl'), '.4g')}")
        served = repetition.results.get(f"serve {variant}", {})
        if "command" in served:
            env, command = served["command"]
            command[command.index("--port") + 1] = "PORT"
            sweep_env, sweep_command = server_command(run.params["served.command"], "PORT")
            same = command == sweep_command and all(env.get(name) == value for name, value in sweep_env.items())
            shown.append("server command " + ("same" if same else f"DIFFERS: {run.params['served.command']}"))
        report = served.get("report")
        if report and Path(report).is_file():
            for level in load_levels(json.loads(Path(report).read_text())):
                sweep = run.metrics.get(f"cost/serving/{level.label}/output_tokens_per_s")
                shown.append(f"{level.label} {level.output_tokens_per_s:.1f} / {_f(sweep, '.1f')} tok/s")
        lines.append(f"  {variant}: " + ", ".join(shown))
    return lines


def _f(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def report(repetitions: Sequence[Repetition], context: Mapping[str, str]) -> str:
    sums = [sum(rep.parts.values()) for rep in repetitions]
    sweeps = [rep.sweep_seconds for rep in repetitions]
    unmatched = [rep.sweep_stages.get("measure", 0.0) for rep in repetitions]
    ratios = [b / a for a, b in zip(sums, sweeps)]
    ratios_without = [(b - m) / a for a, b, m in zip(sums, sweeps, unmatched)]
    outside = [rep.sweep_seconds - sum(rep.sweep_stages.values()) for rep in repetitions]
    lines = [f"{key}: {value}" for key, value in context.items()]
    lines += ["", f"{'':<34} {'median':>10} {'min':>10} {'max':>10}", "(a) parts, each a whole process:"]
    for name in repetitions[0].parts:
        lines.append(summary_line(f"  {name}", [rep.parts[name] for rep in repetitions]))
    lines += [
        summary_line("(a) sum of the parts", sums),
        summary_line("(b) quantlab sweep, whole process", sweeps),
        f"{'ratio (b)/(a)':<34} {statistics.median(sweeps) / statistics.median(sums):>10.2f} "
        f"{min(ratios):>10.2f} {max(ratios):>10.2f}   (medians' ratio; min/max over repetitions)",
        f"{'ratio without measure (no part)':<34} {statistics.median(ratios_without):>10.2f} "
        f"{min(ratios_without):>10.2f} {max(ratios_without):>10.2f}   ((b) less its measure stages, over (a))",
        "",
    ]
    for part in PARTS:
        per_rep = [rep.phases[part] for rep in repetitions if part in rep.phases]
        if per_rep:
            lines += phase_lines(f"(a) {part} phases, summed over variants:", per_rep)
    lines += phase_lines(
        "(b) stages from the sweep's MLflow runs, summed over variants:", [r.sweep_stages for r in repetitions]
    )
    lines.append(summary_line("  outside the stages", outside))
    return "\n".join(lines)


def benchmark(args: argparse.Namespace, work: Path) -> str:
    from quantlab.errors import BadInput
    from quantlab.measure.provenance import cpu_model_name, visible_cores
    from quantlab.recipe import load_recipe

    recipe_path = args.recipe.resolve() if args.recipe else tiny_recipe(work)
    try:
        loaded = load_recipe(recipe_path)
    except BadInput as error:
        print(str(error).splitlines()[0], file=sys.stderr)
        raise SystemExit(2) from None
    check_recipe(loaded)
    recipe = loaded.recipe
    order = [recipe.baseline] + [v.name for v in recipe.variants if v.name != recipe.baseline]
    cache_dir = work / "cache"
    print("first sweep: quantizes and converts into the shared cache (untimed)", file=sys.stderr)
    first_seconds, first_runs = run_sweep(recipe_path, work / "store-first.db", cache_dir, work, recipe.name)

    repetitions: list[Repetition] = []
    load_before = os.getloadavg()[0]
    for index in range(args.repeats):
        print(f"repetition {index + 1}/{args.repeats}", file=sys.stderr)
        measured: dict[str, Any] = {}
        for side in ("parts", "sweep") if index % 2 == 0 else ("sweep", "parts"):
            if side == "parts":
                measured["parts"] = run_parts(loaded, order, first_runs, args, work, index)
                continue
            if not args.keep_cache:
                for name in CLEARED:
                    shutil.rmtree(cache_dir / name, ignore_errors=True)
            print("  quantlab sweep", file=sys.stderr)
            measured["sweep"] = run_sweep(recipe_path, work / f"store-{index}.db", cache_dir, work, recipe.name)
        (parts, phases, results), (sweep_seconds, runs) = measured["parts"], measured["sweep"]
        if not_reused := [name for name, run in runs.items() if run.tags.get("quantlab.checkpoint_reused") != "true"]:
            raise SystemExit(f"the timed sweep quantized {', '.join(not_reused)} again instead of reusing the cache")
        repetitions.append(Repetition(parts, phases, results, sweep_seconds, stage_times(runs), runs))

    run = first_runs[recipe.baseline]
    context = {
        "recipe": f"{recipe_path} ({', '.join(order)}; baseline {recipe.baseline})",
        "runtime": f"{run.params['runtime.device']}, {run.params['runtime.compute_dtype']}; "
        f"server: {run.params.get('served.engine', 'none')}",
        "work": f"{args.repeats} repetitions, interleaved (parts first, then sweep first, ...); lm-eval task index "
        f"{args.task_index}; cache {'kept whole' if args.keep_cache else 'without ' + ' and '.join(CLEARED)} "
        "before each timed sweep",
        "machine": f"{cpu_model_name()}, {visible_cores()} cores visible",
        "load": f"1-minute load average {load_before:.2f} before the timed runs, {os.getloadavg()[0]:.2f} after",
        "first sweep (untimed)": f"{first_seconds:.1f} s",
    }
    lines = ["same work, direct / sweep (last repetition):", *same_work(repetitions[-1])]
    return report(repetitions, context) + "\n\n" + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)
    if args.part is not None:
        part, spec_path = args.part
        print(json.dumps(RUNNERS[part](json.loads(Path(spec_path).read_text()))))
        return 0
    return run_benchmark(benchmark, args, "quantlab-sweep-parts-")


if __name__ == "__main__":
    sys.exit(main())
