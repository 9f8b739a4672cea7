"""The embedded sweep on transformers alone against the same sweep scored and served on vLLM, side by side in one run.

Runs `quantlab sweep --force` on recipes/smollm2-135m.yaml (transformers serve, reference scores; `--only` the
vLLM recipe's variants) and then on recipes/smollm2-135m-vllm.yaml (serving.engine: vllm, evals.engine: both), each
into a store and a cold cache of its own (the GGUF's conversion, every checkpoint and reference pass built in both),
and prints:

1. each sweep's wall time and their ratio (the engine issue's goal: vLLM + both within 1.5x);
2. per variant: the kernel vLLM chose, served output tokens/s and TTFT p50 at each level on each engine and their
   ratio (vLLM / transformers serve), and the accuracy served against the reference with the paired 95% interval;
3. the engine's floor (the baseline served twice) beside them, and the plugins each vLLM server loaded.

Needs `quantlab engine install vllm --cpu` first. Run it alone on the machine:

    .venv/bin/python benchmarks/engine_sweeps.py --work-dir /tmp/engine-sweeps
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from serving_vs_loop import _n, _r  # one way to print a figure and a ratio in the benchmarks' tables

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"transformers": REPO / "recipes" / "smollm2-135m.yaml", "vllm": REPO / "recipes" / "smollm2-135m-vllm.yaml"}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work-dir", type=Path, required=True, help="stores, logs and the shared cache go here")
    parser.add_argument("--reuse", action="store_true", help="print the table from the stores already there")
    return parser.parse_args(argv)


def vllm_variants() -> list[str]:
    import yaml

    return [variant["name"] for variant in yaml.safe_load(RECIPES["vllm"].read_text())["variants"]]


def sweep(engine: str, work: Path) -> float:
    store = f"sqlite:///{work / engine / 'mlflow.db'}"
    (work / engine).mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "quantlab", "sweep", str(RECIPES[engine]), "--tracking-uri", store, "--force"]
    if engine == "transformers":  # the same variants on both
        command += [argument for name in vllm_variants() for argument in ("--only", name)]
    command += ["--cache-dir", str(work / engine / "cache")]  # each cold: GGUF conversion and checkpoints built
    started = time.perf_counter()
    with open(work / engine / "sweep.log", "w") as log:
        done = subprocess.run(command, cwd=work / engine, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{engine} sweep exited {done.returncode}: see {work / engine / 'sweep.log'}")
    (work / engine / "seconds").write_text(f"{seconds:.1f}")
    return seconds


def variant_runs(engine: str, work: Path) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{work / engine / 'mlflow.db'}")
    experiment = client.get_experiment_by_name({"transformers": "smollm2-135m", "vllm": "smollm2-135m-vllm"}[engine])
    runs = client.search_runs([experiment.experiment_id], "tags.`quantlab.role` = 'variant'")
    newest: dict = {}
    for run in sorted(runs, key=lambda r: r.info.start_time):
        newest[run.data.tags["quantlab.variant"]] = run
    return newest


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    work = args.work_dir.resolve()
    seconds = {}
    for engine in RECIPES:
        if args.reuse and (work / engine / "seconds").is_file():
            seconds[engine] = float((work / engine / "seconds").read_text())
        else:
            print(f"sweeping on {engine} ...", flush=True)
            seconds[engine] = sweep(engine, work)
    ratio = seconds["vllm"] / seconds["transformers"]
    print(
        f"\nembedded sweep, --force: transformers {seconds['transformers']:.0f} s, vLLM + both "
        f"{seconds['vllm']:.0f} s: {ratio:.2f}x\n"
    )
    hf, vllm = variant_runs("transformers", work), variant_runs("vllm", work)
    levels = sorted(
        {
            key.split("/")[2]
            for run in vllm.values()
            for key in run.data.metrics
            if key.endswith("/output_tokens_per_s") and key.count("/") == 3
        }
    )
    header = f"{'variant':<14}{'kernel (vLLM)':<44}" + "".join(
        f"{f'{level} tok/s hf':>14}{f'{level} vllm':>10}{'ratio':>7}{f'{level} ttft hf':>13}{'vllm':>8}"
        for level in levels
    )
    print(header + "\n" + "-" * len(header))
    for name, run in vllm.items():
        kernel = run.data.tags.get("quantlab.serving.kernel", "?")[:42]
        cells = ""
        for level in levels:
            tok_hf = hf[name].data.metrics.get(f"cost/serving/{level}/output_tokens_per_s") if name in hf else None
            tok_vllm = run.data.metrics.get(f"cost/serving/{level}/output_tokens_per_s")
            ttft_hf = hf[name].data.metrics.get(f"cost/serving/{level}/ttft_ms_p50") if name in hf else None
            ttft_vllm = run.data.metrics.get(f"cost/serving/{level}/ttft_ms_p50")
            cells += f"{_n(tok_hf):>14}{_n(tok_vllm):>10}{_r(tok_vllm, tok_hf):>7}{_n(ttft_hf):>13}{_n(ttft_vllm):>8}"
        print(f"{name:<14}{kernel:<44}{cells}")
    print("\naccuracy served (vLLM) vs reference (transformers), same variant, paired per document:")
    for name, run in vllm.items():
        for key, value in sorted(run.data.metrics.items()):
            if key.startswith("quality/engine_vs_reference/") and key.endswith("/diff"):
                score = key.removeprefix("quality/engine_vs_reference/").removesuffix("/diff")
                low = run.data.metrics[key.replace("/diff", "/ci95_low")]
                high = run.data.metrics[key.replace("/diff", "/ci95_high")]
                print(
                    f"  {name:<14}{score:<28} served {run.data.metrics.get(score, float('nan')):.3f}  diff "
                    f"{value:+.3f} [{low:+.3f}, {high:+.3f}]"
                )
        served = {
            k.removeprefix("quality/served/"): v for k, v in run.data.metrics.items() if k.startswith("quality/served/")
        }
        print(
            f"  {name:<14}tokens: served ppl {served.get('ppl', float('nan')):.3f} (reference "
            f"{run.data.metrics.get('quality/ppl', float('nan')):.3f}), top-1 {served.get('top1_agreement', float('nan')):.3f}, "
            f"top-k KL {served.get('kld_topk_mean', float('nan')):.4f} (exact reference KL "
            f"{run.data.metrics.get('quality/kld_mean', float('nan')):.4f}), tail mass {served.get('kld_topk_tail_mass', float('nan')):.3f}"
        )
    print("\nthe engine's floor (the baseline served twice, otherwise batched):")
    for name, run in vllm.items():
        for key, value in sorted(run.data.metrics.items()):
            if key.startswith("quality/engine_floor/") and key.endswith(("/diff", "top1_agreement", "kld_topk_mean")):
                print(f"  {name:<14}{key.removeprefix('quality/engine_floor/'):<40} {value:+.4f}")
        print(f"  {name:<14}plugins: {run.data.params.get('served.plugins', 'none (stock vLLM)')}")
    stages = {
        engine: {n: r.data.metrics for n, r in runs.items()} for engine, runs in (("transformers", hf), ("vllm", vllm))
    }
    print("\nstage seconds (time/<stage>_seconds):")
    for engine, runs in stages.items():
        for name, metrics in runs.items():
            found = {
                k.removeprefix("time/").removesuffix("_seconds"): v for k, v in metrics.items() if k.startswith("time/")
            }
            print(f"  {engine:<13}{name:<14}" + ", ".join(f"{stage} {value:.0f}" for stage, value in found.items()))


if __name__ == "__main__":
    main()
