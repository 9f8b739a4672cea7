"""Mixed precision: a variant's `params.ignore` (modules kept in BF16) is checked against the model's modules before
any work, and the quantize stage's checkpoint keeps exactly those modules unquantized."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.utils.match import is_match
from safetensors import safe_open
from test_quantize import CALIBRATION, _variant
from test_recipe import _problems
from test_sweep import quantlab
from tiny import tiny_llama_config
from transformers import AutoModelForCausalLM

from quantlab.checks import QUANTIZED_CLASS, matching_modules, validate
from quantlab.measure.cost import measure_cost
from quantlab.measure.settings import MeasureSettings
from quantlab.models import load_checkpoint, module_classes, module_classes_identity, resolve_source
from quantlab.recipe import ModelSpec
from quantlab.stages.quantize import quantize_variant
from recipes import REPO, tiny_recipe, write

# The second block's MLP and the (tied) lm_head kept in BF16; the rest of the blocks quantized.
MIXED = ["lm_head", r"re:model\.layers\.1\.mlp\..*"]
KEPT_IN_BLOCKS = {f"model.layers.1.mlp.{name}" for name in ("gate_proj", "up_proj", "down_proj")}

# ignore lists that keep some Linear layers in BF16 on the tiny Llama (a tied lm_head is a module of its own)
VALID = {
    "lm_head alone (tied embeddings)": ["lm_head"],
    "an exact module name": ["lm_head", "model.layers.0.self_attn.q_proj"],
    "re: over a block": ["lm_head", r"re:model\.layers\.1\..*"],
    "re: over one kind of layer": [r"re:.*down_proj$"],
}
# ignore list -> the pattern that is wrong (None: the list as a whole), what its one-line message says
INVALID = {
    "typo'd name": (
        ["lm_head", "model.layers.1.mlp.gate_prj"],
        1,
        "'model.layers.1.mlp.gate_prj' matches no module of the model (closest: 'model.layers.1.mlp.gate_proj', ",
    ),
    "typo'd regex": (
        [r"re:model\.layer\.1\..*"],
        0,
        r"'re:model\.layer\.1\..*' matches no module of the model (closest: 'model.layers.1', ",
    ),
    "invalid regex": ([r"re:model\.layers\.(1"], 0, r"'re:model\.layers\.(1' is not a valid regular expression ("),
    "re.match from the name's start": ([r"re:layers\.1\..*"], 0, r"did you mean 're:.*layers\.1\..*'?"),
    "a block's own name": (
        ["model.layers.1"],
        0,
        r"matches no Linear layer, only 'model.layers.1' (LlamaDecoderLayer): a layer is kept in BF16 by its own "
        r"name, so keep everything under 'model.layers.1' with 're:model\.layers\.1\..*'",
    ),
    "every Linear layer": (["Linear"], None, "keeps every Linear layer in BF16: the variant would quantize nothing"),
}


def _mixed_recipe(model_dir: Path, ignore: list[str], method: str = "fp8") -> dict:
    params = {"ignore": ignore} | ({"group_size": 32} if method.endswith("int4") else {})  # 32 divides 64 and 128
    variants = [{"name": "bf16", "method": "bf16"}, {"name": "mixed", "method": method, "params": params}]
    return tiny_recipe(model_dir, variants=variants)


def _field(index: int | None) -> str:
    return "variants[1] (mixed).params.ignore" + ("" if index is None else f"[{index}]")


@pytest.mark.parametrize("ignore", VALID.values(), ids=VALID)
def test_patterns_that_keep_some_linear_layers_pass(tmp_path, tiny_llama, ignore):
    loaded = validate(write(tmp_path / "recipe.yaml", _mixed_recipe(tiny_llama.path, ignore)))
    assert loaded.recipe.variant("mixed").params.ignore == ignore


@pytest.mark.parametrize("method", ["fp8", "awq_int4", "gptq_int4", "int8"])
@pytest.mark.parametrize("case", INVALID, ids=INVALID)
def test_each_wrong_pattern_is_one_problem_naming_its_field(tmp_path, tiny_llama, case, method):
    ignore, index, message = INVALID[case]
    path = write(tmp_path / "recipe.yaml", _mixed_recipe(tiny_llama.path, ignore, method))
    (problem,) = _problems(path)
    assert problem.startswith(f"{path}: {_field(index)}: ") and message in problem, problem
    assert "\n" not in problem


@pytest.mark.parametrize("case", INVALID, ids=INVALID)
def test_quantlab_validate_exits_2_with_one_line_and_writes_nothing(tmp_path, tiny_llama, case):
    ignore, index, message = INVALID[case]
    path = write(tmp_path / "recipe.yaml", _mixed_recipe(tiny_llama.path, ignore))
    result = quantlab("validate", str(path), cwd=tmp_path, env={"QUANTLAB_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 2, result.stdout + result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {path}: {_field(index)}: ") and message in line, line
    assert "Traceback" not in result.stdout + result.stderr
    assert not (tmp_path / "cache").exists()  # the lookups are remembered only for a recipe that passed


@pytest.mark.parametrize("pattern", [p for ignore in VALID.values() for p in ignore] + ["model.layers.1", "Linear"])
def test_matching_is_compressed_tensors_own(pattern):
    """The check's matching over remembered names and class names agrees with compressed-tensors' `is_match` over
    the model's modules, which llm-compressor's `ignore` uses."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_llama_config(tie_word_embeddings=True))
    by_is_match = [name for name, module in model.named_modules() if is_match(name, module, pattern)]
    modules = {
        name: [cls.__name__ for cls in type(module).__mro__ if issubclass(cls, torch.nn.Module)]
        for name, module in model.named_modules()
    }
    assert matching_modules(pattern, modules) == by_is_match


def test_module_names_are_looked_up_only_for_a_written_ignore_and_remembered(tmp_path, tiny_llama):
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    identity = module_classes_identity(source)
    default = validate(write(tmp_path / "default.yaml", tiny_recipe(tiny_llama.path)), tmp_path / "cache")
    assert identity not in [found for found, _ in default.lookups]
    mixed = validate(write(tmp_path / "mixed.yaml", _mixed_recipe(tiny_llama.path, MIXED)), tmp_path / "cache")
    (modules,) = [fact for found, fact in mixed.lookups if found == identity]
    assert modules == module_classes(source) and "lm_head" in modules


@pytest.fixture(scope="module")
def made(tmp_path_factory, tiny_llama) -> dict[str, Path]:
    """The quantize stage's checkpoints: BF16, FP8 whole and mixed, GPTQ W4A16 mixed (a calibrating method)."""
    cache_root = tmp_path_factory.mktemp("cache")
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    variants = {
        "bf16": ("bf16", {}),
        "fp8": ("fp8", {}),
        "fp8-mixed": ("fp8", {"ignore": MIXED}),
        "gptq-mixed": ("gptq_int4", {"group_size": 32, "ignore": MIXED}),
    }
    return {
        name: quantize_variant(
            source, _variant(name=name, method=method, params=params), CALIBRATION, Path.cwd(), cache_root, "cpu"
        ).path
        for name, (method, params) in variants.items()
    }


def _tensors(checkpoint: Path) -> dict[str, torch.Tensor]:
    with safe_open(checkpoint / "model.safetensors", "pt") as tensors:
        return {name: tensors.get_tensor(name) for name in tensors.keys()}  # noqa: SIM118 - safe_open has no iterator


def _block_linears(tiny_llama) -> list[str]:
    modules = module_classes(resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd()))
    return [name for name, classes in modules.items() if QUANTIZED_CLASS in classes and name.startswith("model.")]


@pytest.mark.parametrize(
    ("name", "quantized_attributes"),
    [("fp8-mixed", {"weight", "weight_scale"}), ("gptq-mixed", {"weight_packed", "weight_scale", "weight_shape"})],
)
def test_the_checkpoint_keeps_exactly_the_ignored_modules_in_bf16(made, tiny_llama, name, quantized_attributes):
    config = json.loads((made[name] / "config.json").read_text())["quantization_config"]
    # compressed-tensors writes the Linear layers it left alone, by name
    assert set(config["ignore"]) == KEPT_IN_BLOCKS | {"lm_head"}, config["ignore"]
    tensors, baseline = _tensors(made[name]), _tensors(made["bf16"])
    for module in _block_linears(tiny_llama):
        attributes = {key.removeprefix(f"{module}.") for key in tensors if key.startswith(f"{module}.")}
        if module in KEPT_IN_BLOCKS:
            assert attributes == {"weight"}, module
            weight = tensors[f"{module}.weight"]
            # untouched: the baseline's BF16 tensor, bit for bit
            assert weight.dtype == torch.bfloat16 and torch.equal(weight, baseline[f"{module}.weight"]), module
        else:
            assert attributes == quantized_attributes, module
    # tied: lm_head stores nothing of its own, neither a weight nor a scale
    assert not any(key.startswith("lm_head.") for key in tensors)


@pytest.mark.parametrize("name", ["fp8-mixed", "gptq-mixed"])
def test_a_mixed_checkpoint_reloads_with_the_kept_layers_as_they_were(made, name):
    model, tokenizer = load_checkpoint(made[name], torch.float32, "cpu")
    baseline, _ = load_checkpoint(made["bf16"], torch.float32, "cpu")
    for module in KEPT_IN_BLOCKS:
        assert torch.equal(model.get_submodule(module).weight, baseline.get_submodule(module).weight), module
    ids = tokenizer("The quick brown fox jumps over the lazy dog.", return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        assert torch.isfinite(model(ids).logits).all()


def test_the_mixed_variants_weight_bytes_lie_between_the_quantized_and_bf16(made):
    """`cost/weight_bytes` as the measure stage logs it (its modeled figures, read off the checkpoint's files)."""
    settings = MeasureSettings(enabled=False)

    def weight_bytes(name: str) -> float:
        return measure_cost(None, None, settings, made[name]).to_metrics()["cost/weight_bytes"]

    assert weight_bytes("fp8") < weight_bytes("fp8-mixed") < weight_bytes("bf16")
    assert weight_bytes("gptq-mixed") < weight_bytes("fp8-mixed")


def test_the_schemes_recipe_is_valid():
    """`quantlab validate recipes/smollm2-135m-schemes.yaml` (what it runs), offline: its mixed variant's patterns
    match the embedded model's modules."""
    loaded = validate(REPO / "recipes" / "smollm2-135m-schemes.yaml")
    assert [(variant.name, variant.method) for variant in loaded.recipe.variants] == [
        ("bf16", "bf16"),
        ("fp8", "fp8"),
        ("awq-int4-g64", "awq_int4"),
        ("gptq-int4-g64", "gptq_int4"),
        ("int8", "int8"),
        ("awq-int4-g64-keep2", "awq_int4"),
    ]
    mixed = loaded.recipe.variant("awq-int4-g64-keep2").params
    assert (mixed.group_size, mixed.ignore[0]) == (64, "lm_head")
    (modules,) = [fact for identity, fact in loaded.lookups if "module_classes_of" in identity]
    for pattern, block in zip(mixed.ignore[1:], ("29", "0")):
        kept = [name for name in matching_modules(pattern, modules) if QUANTIZED_CLASS in modules[name]]
        # q, k, v, o, gate, up and down of that block
        assert len(kept) == 7 and all(name.startswith(f"model.layers.{block}.") for name in kept)
