"""GPTQ W4A16 and SmoothQuant W8A8 INT8 through the quantize stage on the tiny Llama: each checkpoint says what its
params asked for, reloads on CPU, scores under lm-eval, and moves the outputs measurably off the BF16 baseline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from pydantic import ValidationError
from safetensors import safe_open
from test_quantize import CALIBRATION, _variant
from test_recipe import _problems
from test_recipe import _variant as recipe_entry

from quantlab import corpora
from quantlab.evaluate import reference
from quantlab.evaluate.lm_eval_runner import TaskRequest, run_tasks
from quantlab.models import load_checkpoint, resolve_source
from quantlab.quantize import METHODS
from quantlab.recipe import ModelSpec
from quantlab.stages.quantize import quantize_variant
from recipes import REPO, tiny_recipe, write

W4 = {"num_bits": 4, "type": "int", "strategy": "group"}
W8A8 = {  # llm-compressor's W8A8 preset: static per-channel weights, dynamic per-token activations
    "weights": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True, "dynamic": False},
    "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True},
}
# variant: method, params, the checkpoint's storage format, what its scheme must hold, the modifiers that ran
# (by recipe.yaml) with the arguments the params set
CASES = {
    "gptq": (
        "gptq_int4",
        {"group_size": 32},
        "pack-quantized",
        {"weights": W4 | {"group_size": 32, "symmetric": True, "actorder": "weight"}, "input_activations": None},
        {"GPTQModifier": {"dampening_frac": 0.01}},
    ),
    "gptq-asym": (
        "gptq_int4",
        {"group_size": 64, "symmetric": False, "actorder": None, "dampening_frac": 0.05},
        "pack-quantized",
        {"weights": W4 | {"group_size": 64, "symmetric": False, "actorder": None}, "input_activations": None},
        {"GPTQModifier": {"dampening_frac": 0.05}},
    ),
    "int8": (  # GPTQModifier's own default ordering, which W8A8's per-channel weights take too
        "int8",
        {},
        "int-quantized",
        W8A8 | {"weights": W8A8["weights"] | {"actorder": "static"}},
        {"SmoothQuantModifier": {"smoothing_strength": 0.8}, "GPTQModifier": {}},
    ),
    "int8-rtn": (
        "int8",
        {"rtn": True, "smoothing_strength": 0.5},
        "int-quantized",
        W8A8 | {"weights": W8A8["weights"] | {"actorder": None}},
        {"SmoothQuantModifier": {"smoothing_strength": 0.5}, "QuantizationModifier": {}},
    ),
}
LIMIT = 8  # lm-eval documents per variant


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    """Every case's checkpoint and the BF16 baseline's, made by the quantize stage."""
    cache_root = tmp_path_factory.mktemp("cache")
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    variants = {name: (method, params) for name, (method, params, *_) in CASES.items()} | {"bf16": ("bf16", {})}
    return {
        name: quantize_variant(
            source, _variant(name=name, method=method, params=params), CALIBRATION, Path.cwd(), cache_root, "cpu"
        ).path
        for name, (method, params) in variants.items()
    }


@pytest.fixture(scope="module")
def baseline_pass(made, tmp_path_factory) -> Path:
    model, tokenizer = load_checkpoint(made["bf16"], torch.float32, "cpu")
    token_ids = reference.corpus_token_ids(tokenizer, corpora.text("perplexity"), 96)
    target = tmp_path_factory.mktemp("reference") / "bf16"
    reference.write_reference(model, token_ids, target, window=32)
    return target


def _modifiers(checkpoint: Path) -> dict[str, dict]:
    """Each modifier llm-compressor ran, by class name, with its arguments (from the recipe.yaml it saved)."""
    found: dict[str, dict] = {}

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key.endswith("Modifier") and isinstance(value, dict):
                    found[key] = value
                else:
                    walk(value)

    # FullLoader: SmoothQuant's mappings are written as Python tuples (`!!python/tuple`).
    walk(yaml.load((checkpoint / "recipe.yaml").read_text(), Loader=yaml.FullLoader))
    return found


@pytest.mark.parametrize("name", CASES)
def test_the_checkpoint_says_what_the_params_asked_for(made, name):
    _, _, format_name, scheme, modifiers = CASES[name]
    quantization = json.loads((made[name] / "config.json").read_text())["quantization_config"]
    assert (quantization["quant_method"], quantization["format"]) == ("compressed-tensors", format_name)
    assert quantization["ignore"] == ["lm_head"]
    (group,) = quantization["config_groups"].values()
    for role, expected in scheme.items():
        if expected is None:
            assert group[role] is None, role
        else:
            assert {key: group[role][key] for key in expected} == expected, role
    ran = _modifiers(made[name])
    assert set(ran) == set(modifiers)
    for modifier, arguments in modifiers.items():
        assert {key: ran[modifier][key] for key in arguments} == arguments, modifier


@pytest.mark.parametrize("name", CASES)
def test_smoothquant_rescales_the_norms_only_for_int8(made, name):
    """SmoothQuant divides each norm's weight by its smoothing scales (and multiplies the next layers' by them):
    the norms of an INT8 checkpoint differ from the baseline's, GPTQ's alone leaves them as they were."""

    def norm(checkpoint: Path) -> torch.Tensor:
        with safe_open(checkpoint / "model.safetensors", "pt") as tensors:
            return tensors.get_tensor("model.layers.0.input_layernorm.weight")

    assert torch.equal(norm(made[name]), norm(made["bf16"])) == (CASES[name][0] != "int8")


@pytest.mark.parametrize("name", CASES)
def test_reloads_on_cpu_scores_under_lm_eval_and_differs_from_the_baseline(made, baseline_pass, name):
    model, tokenizer = load_checkpoint(made[name], torch.float32, "cpu")
    (scores,) = run_tasks(model, tokenizer, [TaskRequest("pydoc_cloze", limit=LIMIT)], REPO / "evals", batch_size=4)
    accuracy = scores.primary
    assert sorted(accuracy.documents.values) == list(range(LIMIT))
    assert accuracy.value == pytest.approx(sum(accuracy.documents.values.values()) / LIMIT)
    damage = reference.compare_tokens(model, baseline_pass).metrics()
    assert math.isfinite(damage["quality/kld_mean"]) and damage["quality/kld_mean"] > 0
    assert math.isfinite(damage["quality/ppl"])


@pytest.mark.parametrize(("given", "stored"), [("weight", "weight"), ("static", "weight"), (None, None)])
def test_gptq_actorder_has_one_spelling_per_checkpoint(given, stored):
    assert METHODS["gptq_int4"].Params(actorder=given).actorder == stored


def test_gptq_actorder_group_is_refused():
    """compressed-tensors 0.19 removed it; the recipe says so before a model is loaded."""
    with pytest.raises(ValidationError, match="actorder"):
        METHODS["gptq_int4"].Params(actorder="group")


def test_a_gptq_group_size_that_does_not_divide_the_widths_is_bad_input(tmp_path, tiny_llama):
    variants = [recipe_entry("bf16", "bf16"), recipe_entry("w4", "gptq_int4", group_size=48)]
    path = write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path, variants=variants))
    problems = _problems(path)
    assert any(p.startswith(f"{path}: variants[1] (w4).params.group_size: 48 does not divide") for p in problems)
