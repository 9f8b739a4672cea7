"""Each quantizer makes a real llm-compressor checkpoint that reloads and stays close to the baseline."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pydantic import TypeAdapter

from quantlab import cache
from quantlab.models import load_checkpoint, resolve_source
from quantlab.quantize import METHODS
from quantlab.recipe import CalibrationSettings, ModelSpec, VariantSpec
from quantlab.stages.quantize import quantize_variant

CALIBRATION = CalibrationSettings(num_samples=4, seq_len=32)
PARAMS = {"bf16": {}, "fp8": {}, "awq_int4": {"group_size": 32}}


def _variant(**fields) -> VariantSpec:
    """A recipe's variant as the recipe parses it: `params` becomes the method's own model."""
    return TypeAdapter(VariantSpec).validate_python(fields)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, tiny_llama):
    cache_root = tmp_path_factory.mktemp("cache")
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    made = {
        method: quantize_variant(
            source, _variant(name=method, method=method, params=params), CALIBRATION, Path.cwd(), cache_root, "cpu"
        )
        for method, params in PARAMS.items()
    }
    return source, cache_root, made


def _logits(path: Path) -> torch.Tensor:
    model, tokenizer = load_checkpoint(path, torch.float32, "cpu")
    ids = tokenizer("The quick brown fox jumps over the lazy dog. " * 4, return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        return model(ids).logits.float()


def test_registry_has_the_eleven_methods():
    formats = {"fp8_block", "mxfp8", "nvfp4", "nvfp4a16", "mxfp4", "w4a8_fp8"}  # issue 29: tests/test_formats.py
    # mixed: a format per group of layers (issue 29 part B, tests/test_sensitivity.py)
    assert set(METHODS) - {"mixed"} == {"bf16", "fp8", "awq_int4", "gptq_int4", "int8"} | formats


@pytest.mark.parametrize("method", ["fp8", "awq_int4"])
def test_quantized_outputs_are_close_to_but_not_the_baseline(quantized, method):
    _, _, made = quantized
    baseline = _logits(made["bf16"].path)
    variant = _logits(made[method].path)
    relative = ((variant - baseline).norm() / baseline.norm()).item()
    assert 0.0 < relative < 0.5, relative
    agreement = (variant.argmax(-1) == baseline.argmax(-1)).float().mean().item()
    assert agreement > 0.5, agreement


@pytest.mark.parametrize(("method", "format_name"), [("fp8", "float-quantized"), ("awq_int4", "pack-quantized")])
def test_checkpoints_are_compressed_tensors(quantized, method, format_name):
    _, _, made = quantized
    config = json.loads((made[method].path / "config.json").read_text())
    quantization = config["quantization_config"]
    assert quantization["quant_method"] == "compressed-tensors"
    assert quantization["format"] == format_name


def test_awq_uses_the_requested_group_size(quantized):
    _, _, made = quantized
    config = json.loads((made["awq_int4"].path / "config.json").read_text())
    weights = config["quantization_config"]["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 32, True)


def test_weight_bytes_shrink_with_precision(quantized):
    _, _, made = quantized
    size = {m: sum(f.stat().st_size for f in q.path.glob("*.safetensors")) for m, q in made.items()}
    assert size["awq_int4"] < size["fp8"] < size["bf16"]


def test_cached_checkpoint_is_reused_and_keyed_by_content(quantized):
    source, cache_root, made = quantized
    again = quantize_variant(source, _variant(name="fp8", method="fp8"), CALIBRATION, Path.cwd(), cache_root, "cpu")
    assert again.reused and again.path == made["fp8"].path
    other = _variant(name="fp8", method="fp8", params={"ignore": ["lm_head", "re:.*down_proj"]})
    assert cache.cache_key({"x": 1}) != cache.cache_key({"x": 2})
    from quantlab.models import checkpoint_identity

    assert checkpoint_identity(source, other, CALIBRATION) != checkpoint_identity(
        source, _variant(name="fp8", method="fp8"), CALIBRATION
    )
    # Calibration settings only matter to methods that calibrate.
    more = CalibrationSettings(num_samples=8, seq_len=32)
    assert checkpoint_identity(source, _variant(name="b", method="bf16"), more) == checkpoint_identity(
        source, _variant(name="b", method="bf16"), CALIBRATION
    )
    # The calibration batch moves AWQ's float sums, so its scales: another checkpoint.
    awq, batched = _variant(name="w4", method="awq_int4"), CALIBRATION.model_copy(update={"batch_size": 4})
    assert checkpoint_identity(source, awq, batched) != checkpoint_identity(source, awq, CALIBRATION)


def _awq_on_tiny_llama(tiny_llama, calibration: CalibrationSettings, rows_per_mlp_call: list[int] | None = None):
    """A fresh tiny Llama quantized by AWQ; with `rows_per_mlp_call`, the batch rows of each call of layer 0's MLP."""
    from quantlab.stages.calibration import calibration_dataset

    model, tokenizer = tiny_llama.load()
    samples = calibration_dataset(calibration, tokenizer, Path.cwd())
    assert samples.batch_size == calibration.batch_size and len(samples.samples) == calibration.num_samples
    if rows_per_mlp_call is not None:
        rows = rows_per_mlp_call
        model.model.layers[0].mlp.register_forward_hook(lambda module, args, output: rows.append(len(output)))
    METHODS["awq_int4"].apply(model, METHODS["awq_int4"].Params(group_size=32), samples)
    return model


def test_awq_calibrates_in_batches_of_the_recipes_size(tiny_llama):
    """Four samples in one batch run each layer's calibration forward passes once, not four times."""
    rows_per_call: dict[int, list[int]] = {1: [], 4: []}
    for batch_size, rows in rows_per_call.items():
        _awq_on_tiny_llama(tiny_llama, CalibrationSettings(num_samples=4, seq_len=32, batch_size=batch_size), rows)
    assert set(rows_per_call[1]) == {1} and set(rows_per_call[4]) == {4}
    assert len(rows_per_call[1]) == 4 * len(rows_per_call[4])


def test_awq_gives_the_same_weights_whatever_torchs_random_state(tiny_llama):
    """The calibration samples are drawn from the recipe's seed alone; nothing reshuffles them."""
    weights = []
    for torch_seed in (1, 2):
        torch.manual_seed(torch_seed)
        weights.append(_awq_on_tiny_llama(tiny_llama, CalibrationSettings(num_samples=8, seq_len=32)).state_dict())
    first, second = weights
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_partial_checkpoint_is_never_taken_as_complete(tmp_path):
    target = tmp_path / "checkpoints" / "x-123"
    with pytest.raises(RuntimeError), cache.writing(target, {"k": 1}) as scratch:
        (scratch / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-write")
    assert not target.exists() and not cache.is_complete(target)
    assert list((tmp_path / "checkpoints").iterdir()) == []
    # A crash that leaves a scratch directory behind (SIGKILL) is not a cache hit either.
    (tmp_path / "checkpoints" / "x-123.partial-999").mkdir()
    assert not cache.is_complete(target)


def test_next_writer_removes_scratch_of_dead_writers_on_this_host_only(tmp_path):
    target = tmp_path / "checkpoints" / "x-123"
    target.parent.mkdir(parents=True)
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    host = socket.gethostname()
    dead = target.with_name(f"x-123.partial-{host}-{finished.stdout.strip()}")
    alive = target.with_name(f"x-123.partial-{host}-{os.getppid()}")
    elsewhere = target.with_name(f"x-123.partial-other-node-{finished.stdout.strip()}")
    for scratch in (dead, alive, elsewhere):
        (scratch / "model.safetensors").parent.mkdir()
        (scratch / "model.safetensors").write_bytes(b"half")
    with cache.writing(target, {"k": 1}) as scratch:
        (scratch / "weights.bin").write_bytes(b"whole")
    assert cache.is_complete(target)
    assert not dead.exists() and alive.exists() and elsewhere.exists()


def test_losing_the_race_to_an_equal_checkpoint_keeps_the_winner(tmp_path):
    target = tmp_path / "checkpoints" / "x-123"
    other_writer = (
        "import sys; from pathlib import Path; from quantlab import cache\n"
        "with cache.writing(Path(sys.argv[1]), {'k': 1}) as scratch:\n"
        "    (scratch / 'weights.bin').write_bytes(b'theirs')\n"
    )
    with cache.writing(target, {"k": 1}) as ours:
        (ours / "weights.bin").write_bytes(b"ours")
        subprocess.run([sys.executable, "-c", other_writer, str(target)], check=True)  # finishes the same key first
    assert (target / "weights.bin").read_bytes() == b"theirs" and cache.is_complete(target)
    assert [path.name for path in target.parent.iterdir()] == ["x-123"]


def test_force_recomputes(quantized):
    source, cache_root, made = quantized
    forced = quantize_variant(
        source, _variant(name="bf16", method="bf16"), CALIBRATION, Path.cwd(), cache_root, "cpu", force=True
    )
    assert not forced.reused and cache.is_complete(forced.path)
