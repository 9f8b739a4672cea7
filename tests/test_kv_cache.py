"""A quantized KV cache (a variant's `kv_cache:`) on the tiny Llama: it reaches the checkpoint and the cache key, the CPU
forward in transformers really rounds K and V to FP8, and the damage stage measures it by context length, paired
token by token with the same checkpoint's K/V unrounded (which is what its twin without a KV cache computes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_quantize import CALIBRATION, _variant

from quantlab.checks import validate
from quantlab.evaluate.contexts import KV_CACHE_TAG, LENGTHS_TAG, kv_quantization_off, kv_quantized_attention
from quantlab.jobs import BaselineOutputs, VariantJob
from quantlab.models import checkpoint_identity, load_checkpoint, resolve_source
from quantlab.recipe import ModelSpec
from quantlab.stages.evaluate import token_damage
from quantlab.stages.quantize import quantize_variant
from recipes import tiny_recipe, write

KV = {"format": "fp8", "granularity": "tensor"}
VARIANTS = {
    "bf16": {"method": "bf16"},
    "fp8": {"method": "fp8"},
    "fp8-kv": {"method": "fp8", "kv_cache": "fp8"},
    "bf16-kv-head": {"method": "bf16", "kv_cache": {"granularity": "head"}},
}
LENGTHS = [16, 64, 128]  # the tiny Llama takes 1024 positions: none clipped


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_llama):
    cache_root = tmp_path_factory.mktemp("cache")
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    return source, {
        name: quantize_variant(source, _variant(name=name, **fields), CALIBRATION, Path.cwd(), cache_root, "cpu").path
        for name, fields in VARIANTS.items()
    }


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize(("name", "strategy", "scales"), [("fp8-kv", "tensor", 1), ("bf16-kv-head", "attn_head", 2)])
def test_the_checkpoint_stores_the_kv_cache_scheme_and_its_scales(made, name, strategy, scales):
    _, paths = made
    scheme = _config(paths[name])["kv_cache_scheme"]
    assert (scheme["num_bits"], scheme["type"], scheme["strategy"], scheme["dynamic"]) == (8, "float", strategy, False)
    with safe_open(paths[name] / "model.safetensors", "pt") as tensors:
        for layer in (0, 1):
            for kind in ("k_scale", "v_scale"):
                scale = tensors.get_tensor(f"model.layers.{layer}.self_attn.{kind}")
                assert scale.numel() == scales and (scale > 0).all()  # per head: the tiny Llama's 2 KV heads


def test_the_method_is_kept_beside_the_kv_cache(made):
    _, paths = made
    assert _config(paths["fp8-kv"])["config_groups"] == _config(paths["fp8"])["config_groups"]
    assert _config(paths["bf16-kv-head"])["config_groups"] == {}  # bf16: nothing but the KV cache quantized
    assert "quantization_config" not in json.loads((paths["bf16"] / "config.json").read_text())


def test_the_kv_cache_is_part_of_the_checkpoints_identity(made):
    source, _ = made
    plain = checkpoint_identity(source, _variant(name="fp8", method="fp8"), CALIBRATION)
    assert "kv_cache" not in plain and plain["calibration"] is None  # a variant without one: its key as before
    kv = checkpoint_identity(source, _variant(name="x", method="fp8", kv_cache="fp8"), CALIBRATION)
    head = checkpoint_identity(source, _variant(name="x", method="fp8", kv_cache={"granularity": "head"}), CALIBRATION)
    assert kv["kv_cache"] == KV and kv["calibration"] == CALIBRATION.model_dump()  # its scales are calibrated
    assert len({json.dumps(i, sort_keys=True) for i in (plain, kv, head)}) == 3


def test_transformers_on_cpu_rounds_k_and_v_to_fp8(made):
    """What the cache receives is the scale times an FP8 E4M3 value, and switching the rounding off gives the twin's
    logits exactly (the same FP8 weights)."""
    from compressed_tensors.modeling.kvcache import QuantizedKVCache

    _, paths = made
    model, _ = load_checkpoint(paths["fp8-kv"], torch.float32, "cpu")
    twin, _ = load_checkpoint(paths["fp8"], torch.float32, "cpu")
    attention = kv_quantized_attention(model)
    assert len(attention) == 2 and not kv_quantized_attention(twin)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = QuantizedKVCache.forward

    def spy(self, key, value, *args, **kwargs):
        stored = original(self, key, value, *args, **kwargs)
        seen.append((key, stored[0]))
        return stored

    ids = torch.randint(0, 49152, (1, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        QuantizedKVCache.forward = spy
        try:
            rounded = model(ids, use_cache=False).logits
        finally:
            QuantizedKVCache.forward = original
        with kv_quantization_off(attention):
            unrounded = model(ids, use_cache=False).logits
        plain = twin(ids, use_cache=False).logits
    key, stored = seen[0]
    scaled = stored / attention[0].k_scale.detach().float()
    assert torch.equal(scaled.to(torch.float8_e4m3fn).float(), scaled)  # on the FP8 grid
    assert not torch.equal(stored, key) and stored.unique().numel() < key.unique().numel() // 4
    assert torch.equal(unrounded, plain)
    assert 0 < (rounded - plain).abs().max() < 1


def test_damage_by_context_and_the_kv_caches_own_cost(tmp_path, tiny_llama, made):
    """The damage stage over a 256-token corpus in windows of 128: figures per bucket for every variant, and for the
    KV-cache variant the paired cost of its rounding, which off reproduces its twin's figures."""
    source, paths = made
    variants = [{"name": name, **fields} for name, fields in VARIANTS.items()]
    quality = {
        "max_tokens": 64,
        "window": 32,
        "contexts": LENGTHS,
        "context_windows": 2,
        "generate": {"enabled": False},
    }
    loaded = validate(write(tmp_path / "r.yaml", tiny_recipe(tiny_llama.path, variants=variants, quality=quality)))
    settings = loaded.recipe.quality

    def damage(name: str, baseline: BaselineOutputs | None):
        model, tokenizer = load_checkpoint(paths[name], torch.float32, "cpu")
        job = VariantJob(loaded, name, tmp_path / "cache", baseline)
        return token_damage(model, tokenizer, settings, tmp_path, job, name)

    base = damage("bf16", None)
    assert base.tags[LENGTHS_TAG] == "16,64,128"
    assert base.metrics["quality/kld_mean/ctx128"] == 0 and base.metrics["quality/top1_agreement/ctx16"] == 1
    # targets 1-15 of each window, then 16-63, then 64-127
    assert [base.metrics[f"quality/ppl_tokens/ctx{n}"] for n in LENGTHS] == [30, 96, 128]
    outputs = BaselineOutputs(base.reference_dir, base.documents)
    plain, kv = damage("fp8", outputs), damage("fp8-kv", outputs)
    assert KV_CACHE_TAG not in plain.tags and "the recipe's fp8 computes" in kv.tags[KV_CACHE_TAG]
    for length in LENGTHS:
        key = f"quality/kld_mean/ctx{length}"
        assert plain.metrics[key] > 0 and f"quality/paired/{key}/diff" in plain.metrics
        added = kv.metrics[f"quality/kv_cache/{key}/diff"]
        assert added != 0 and kv.metrics[key] - added == pytest.approx(plain.metrics[key], rel=1e-6)
        assert not any(k.startswith("quality/kv_cache/") for k in plain.metrics)
