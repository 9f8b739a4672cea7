"""`quantlab sensitivity rank` and `mix`: groups, ranking and the written recipe (pure, table-driven); then the real
command on the tiny Llama (real llm-compressor rounding, real MLflow store): the block made hard to quantize ranks
first, a second run, or one resumed after an interruption, measures only what is missing, and the budget mix spends
its bits on the block INT4 damages."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from quantlab.sensitivity.groups import LayerGroup, layer_groups, rank_correlation, recipe_keeping
from quantlab.sensitivity.probe import DAMAGE_FILE
from recipes import tiny_recipe, write

LLAMA_BLOCK = [
    f"model.layers.{i}.{kind}" for i in (0, 1) for kind in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj")
]


@pytest.mark.parametrize(
    ("names", "by", "expected"),
    [
        (LLAMA_BLOCK, "block", {"model.layers.0": 3, "model.layers.1": 3}),
        (
            LLAMA_BLOCK,
            "module",
            {
                "model.layers.0.self_attn": 2,
                "model.layers.0.mlp": 1,
                "model.layers.1.self_attn": 2,
                "model.layers.1.mlp": 1,
            },
        ),
        # A module outside the blocks is a group of its own; block 10 is not block 1.
        (
            ["model.layers.1.mlp.up_proj", "model.layers.10.mlp.up_proj", "lm_head"],
            "block",
            {"model.layers.1": 1, "model.layers.10": 1, "lm_head": 1},
        ),
        # A linear directly in a block is its own group by module.
        (
            ["transformer.h.0.attn", "transformer.h.0.mlp.fc"],
            "module",
            {"transformer.h.0.attn": 1, "transformer.h.0.mlp": 1},
        ),
    ],
)
def test_layer_groups(names, by, expected):
    groups = layer_groups(names, by)
    assert {group.name: len(group.modules) for group in groups} == expected
    assert [m for group in groups for m in group.modules] == sorted(names, key=names.index)  # every module, in order


def test_ignore_patterns_match_exactly_the_group_under_llm_compressors_matcher(tiny_llama):
    from compressed_tensors.utils import match_named_modules

    model, _ = tiny_llama.load()
    linear = [name for name, module in model.named_modules() if type(module).__name__ == "Linear" and name != "lm_head"]
    for by in ("block", "module"):
        for group in layer_groups(linear, by):
            matched = {name for name, _ in match_named_modules(model, [group.ignore_pattern]) if name in linear}
            assert matched == set(group.modules), group


RECIPE_INDENTED = """\
name: r   # a comment kept
model:
  source: model-dir
variants:
  - name: bf16
    method: bf16
  - name: int4
    method: awq_int4
    params:
      group_size: 32   # why 32
quality:
  corpus: builtin:pydoc-perplexity
"""
RECIPE_FLUSH = RECIPE_INDENTED.replace("  - ", "- ").replace("\n    ", "\n  ").replace("      group", "    group")


@pytest.mark.parametrize("text", [RECIPE_INDENTED, RECIPE_FLUSH], ids=["dash-indented", "dash-flush"])
@pytest.mark.parametrize("target", ["same", "sub"])
def test_recipe_keeping_adds_one_variant_and_keeps_the_rest(tmp_path, text, target):
    (tmp_path / "model-dir").mkdir()
    out_dir = tmp_path if target == "same" else tmp_path / "sub"
    out_dir.mkdir(exist_ok=True)
    raw = yaml.safe_load(text)["variants"][1]
    kept = [LayerGroup("model.layers.3", ("model.layers.3.mlp.up_proj",)), LayerGroup("lm_head", ("lm_head",))]
    written = recipe_keeping(text, tmp_path, out_dir, raw, "int4-keep2", kept)
    data = yaml.safe_load(written)
    assert [v["name"] for v in data["variants"]] == ["bf16", "int4", "int4-keep2"]
    assert data["variants"][2] == {
        "name": "int4-keep2",
        "method": "awq_int4",
        "params": {"group_size": 32, "ignore": ["lm_head", r"re:model\.layers\.3\..*"]},
    }
    assert data["variants"][1] == raw and "# a comment kept" in written and "# why 32" in written
    assert (out_dir / data["model"]["source"]).resolve() == (tmp_path / "model-dir").resolve()
    assert data["quality"]["corpus"] == "builtin:pydoc-perplexity"


def test_recipe_keeping_refuses_a_flow_style_variant_list(tmp_path):
    text = "name: r\nvariants: [{name: a, method: fp8}]\n"
    with pytest.raises(ValueError, match="block list"):
        recipe_keeping(text, tmp_path, tmp_path, {"name": "a", "method": "fp8"}, "a-keep1", [])


def _sensitivity(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "quantlab", "sensitivity", *args]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)


def _with_outliers(tiny_llama, block: int, target: Path) -> Path:
    """The tiny Llama computing the same function, but with one weight 200x larger per 32 inputs in the linear layers
    of `block` (AWQ's rescaling run backwards: each scaled input channel is scaled down where it is made, in the norm
    or the up projection before it). Round-to-nearest INT4 in groups of 32 then sets each group's scale by its
    outlier and flushes the other 31 weights to zero; the other block's damage stays as it was."""
    import torch

    model, tokenizer = tiny_llama.load()
    layer, every_32nd = model.model.layers[block], slice(None, None, 32)
    with torch.no_grad():
        for norm, linears in [
            (layer.input_layernorm.weight, [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
            (layer.post_attention_layernorm.weight, [layer.mlp.gate_proj, layer.mlp.up_proj]),
            (layer.mlp.up_proj.weight, [layer.mlp.down_proj]),  # up's output rows feed down's input columns
        ]:
            norm[every_32nd] /= 200.0
            for linear in linears:
                linear.weight[:, every_32nd] *= 200.0
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target


@pytest.mark.parametrize("block", [0, 1])
def test_the_block_made_hard_to_quantize_ranks_first_and_is_kept_in_bf16(tmp_path, tiny_llama, block):
    from quantlab import tracking

    model = _with_outliers(tiny_llama, block, tmp_path / "model")
    recipe = write(tmp_path / "tiny.yaml", tiny_recipe(model))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    common = ["--tracking-uri", uri, "--cache-dir", str(tmp_path / "cache")]
    result = _sensitivity(
        "rank",
        str(recipe),
        "--variant",
        "awq",
        "--rounded",  # AWQ's own calibration exists to rescue exactly such outlier channels
        "--write-recipe",
        str(tmp_path / "kept.yaml"),
        "--keep",
        "1",
        *common,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
    assert "round-to-nearest in awq_int4's format" in result.stdout  # says it is not AWQ's own calibration

    store = tracking.open_store(uri)
    experiment = store.experiment_id("tiny", create=False)
    [run] = store.search([experiment], {tracking.ROLE: "sensitivity"})
    [parent] = store.search([experiment], {tracking.ROLE: tracking.SENSITIVITY_PARENT_ROLE})
    assert run.tags[tracking.PARENT] == parent.run_id and run.status == parent.status == "FINISHED"
    assert not store.search([experiment], {tracking.ROLE: "sweep"})  # never taken for a sweep
    ranking = json.loads(store.read_artifact(run.run_id, "sensitivity.json"))
    names = [item["group"] for item in ranking["ranking"]]
    assert names[0] == f"model.layers.{block}" and sorted(names) == ["model.layers.0", "model.layers.1"]
    kld = [item["metrics"]["quality/kld_mean"] for item in ranking["ranking"]]
    assert kld[0] > 10 * kld[1] > 0
    assert run.metrics[f"sensitivity/group/model.layers.{block}/kld_mean"] == kld[0]
    assert run.metrics[f"sensitivity/rank/model.layers.{block}"] == 1.0
    assert store.read_artifact(run.run_id, "sensitivity.png").startswith(b"\x89PNG")

    written = yaml.safe_load((tmp_path / "kept.yaml").read_text())
    added = written["variants"][-1]
    assert added["name"] == "awq-keep1" and added["params"]["ignore"] == ["lm_head", rf"re:model\.layers\.{block}\..*"]


def test_a_second_run_measures_nothing_and_an_interrupted_one_only_what_is_missing(tmp_path, tiny_llama):
    from quantlab import tracking

    recipe = write(tmp_path / "tiny.yaml", tiny_recipe(tiny_llama.path))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    args = [
        "rank",
        str(recipe),
        "--variant",
        "fp8",
        "--by",
        "module",
        "--tracking-uri",
        uri,
        "--cache-dir",
        str(tmp_path / "cache"),
    ]

    def run_once() -> dict:
        result = _sensitivity(*args, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:] + result.stdout[-3000:]
        store = tracking.open_store(uri)
        newest = store.search([store.experiment_id("tiny", create=False)], {tracking.ROLE: "sensitivity"})[0]
        return {"computed": newest.tags["quantlab.groups_computed"], "metrics": newest.metrics, "out": result.stdout}

    first = run_once()
    assert first["computed"] == "4"
    again = run_once()
    assert again["computed"] == "0" and again["metrics"] == first["metrics"]
    assert "4 groups were measured before and kept" in again["out"]
    [damage] = (tmp_path / "cache" / "sensitivity").glob(f"*/{DAMAGE_FILE}")
    lines = damage.read_text().splitlines()
    damage.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:20])  # the last group torn mid-write
    resumed = run_once()
    assert resumed["computed"] == "1" and resumed["metrics"] == first["metrics"]


def test_by_module_refuses_a_method_that_rescaled_norms_outside_the_groups(tmp_path, tiny_llama):
    """AWQ moves scales into the norms before each block's attention and MLP: those modules alone are not what AWQ
    made, so --by module would measure something else. By block (norms inside) it works."""
    recipe = write(tmp_path / "tiny.yaml", tiny_recipe(tiny_llama.path))
    common = ["--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--cache-dir", str(tmp_path / "cache")]
    by_module = _sensitivity("rank", str(recipe), "--variant", "awq", "--by", "module", *common, cwd=tmp_path)
    assert by_module.returncode == 2, by_module.stdout[-3000:] + by_module.stderr[-3000:]
    [line] = by_module.stderr.strip().splitlines()
    assert "--by: awq's method also changed model.layers.0.input_layernorm" in line and "use --by block" in line
    by_block = _sensitivity("rank", str(recipe), "--variant", "awq", *common, cwd=tmp_path)
    assert by_block.returncode == 0, by_block.stdout[-3000:] + by_block.stderr[-3000:]
    assert "awq_int4 itself, from the variant's own checkpoint" in by_block.stdout


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        ({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 2, "c": 3}, 1.0),
        ({"a": 1, "b": 2, "c": 3}, {"a": 3, "b": 2, "c": 1}, -1.0),
        ({"a": 1, "b": 2, "c": 3, "d": 4}, {"a": 2, "b": 1, "c": 3, "d": 4}, 0.8),
    ],
)
def test_rank_correlation(first, second, expected):
    assert rank_correlation(first, second) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("job", "args", "message"),
    [
        ("rank", ["--variant", "fp9"], "--variant: 'fp9' is not a variant of"),
        ("rank", ["--variant", "bf16"], "'bf16' (bf16) quantizes nothing"),
        ("rank", ["--variant", "fp8", "--write-recipe", "/no/such/dir/x.yaml"], "--write-recipe: no such directory"),
        # both jobs check --by alike (test_a_wrong_budget_request_... checks the rest of a mix's input)
        ("mix", ["--budget-bits", "5", "--formats", "fp8,bf16", "--by", "layer"], "--by: 'layer' is not one of"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_no_run(tmp_path, tiny_llama, job, args, message):
    recipe = write(tmp_path / "tiny.yaml", tiny_recipe(tiny_llama.path))
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    result = _sensitivity(
        job, str(recipe), *args, "--tracking-uri", uri, "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert message in line
    assert not (tmp_path / "cache" / "sensitivity").exists()


@pytest.mark.parametrize(
    "args",
    [["recipe.yaml", "--variant", "fp8"], ["--budget-bits", "5", "--formats", "fp8,bf16", "recipe.yaml"]],
    ids=["recipe-first", "option-first"],
)
def test_without_a_job_it_is_one_line_naming_both_jobs(tmp_path, args):
    result = _sensitivity(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    [line] = result.stderr.strip().splitlines()
    assert "`quantlab sensitivity rank RECIPE --variant V`" in line, line
    assert "`quantlab sensitivity mix RECIPE --budget-bits B --formats F1,F2,...`" in line, line


@pytest.mark.parametrize(
    ("job", "own", "others"),
    [
        ("rank", {"--variant", "--rounded", "--keep", "--by", "--write-recipe"}, {"--budget-bits", "--formats"}),
        ("mix", {"--budget-bits", "--formats", "--by", "--write-recipe"}, {"--variant", "--rounded", "--keep"}),
    ],
)
def test_each_job_takes_only_its_own_options(tmp_path, job, own, others):
    result = _sensitivity(job, "--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    named = set(re.findall(r"--[a-z][a-z-]*", result.stdout))
    assert own <= named and not others & named, named


def test_the_budget_mix_spends_its_bits_on_the_block_int4_damages(tmp_path, tiny_llama):
    """`--budget-bits 6.5 --formats fp8,gptq_int4,bf16` on the tiny Llama whose block 1 INT4 flushes to zero: room
    for one block in FP8 (8.25 bits a weight) and one in INT4 g32 (4.5): block 1 takes FP8. The written `mixed`
    variant validates, quantizes each block in its format, and stores exactly the bits the choice counted; a budget
    below 4.5 bits is refused naming what the formats can store."""
    from safetensors import safe_open

    from quantlab import tracking
    from quantlab.checks import validate
    from quantlab.models import resolve_source
    from quantlab.recipe import ModelSpec
    from quantlab.sensitivity.budget import InfeasibleBudget
    from quantlab.sensitivity.command import SensitivityOptions, run_budget_mix
    from quantlab.stages.quantize import quantize_variant

    model = _with_outliers(tiny_llama, 1, tmp_path / "model")
    variants = [{"name": "bf16", "method": "bf16"}, {"name": "w4", "method": "gptq_int4", "params": {"group_size": 32}}]
    recipe = write(tmp_path / "tiny.yaml", tiny_recipe(model, variants=variants))
    uri, cache_root = f"sqlite:///{tmp_path}/mlflow.db", tmp_path / "cache"
    options = SensitivityOptions(tracking.open_store(uri).uri, cache_root, write_recipe=tmp_path / "mix.yaml")
    formats = ["fp8", "gptq_int4", "bf16"]
    outcome = run_budget_mix(validate(recipe, cache_root), formats, 6.5, options, lambda *_: None)
    assert outcome.mix.chosen == {"model.layers.0": "gptq_int4", "model.layers.1": "fp8"}
    assert 6.3 < outcome.mix.bits_per_weight <= 6.5 and outcome.formats == {"fp8": "fp8", "gptq_int4": "w4"}

    loaded = validate(tmp_path / "mix.yaml", cache_root)
    added = loaded.recipe.variants[-1]
    assert outcome.written == (tmp_path / "mix.yaml", added.name) and added.name.startswith("mix-budget6p3")
    assert added.method == "mixed" and [part.method for part in added.params.formats] == ["fp8", "gptq_int4"]
    tails = "|".join(
        rf"{kind}\.{name}_proj"
        for kind, names in (("self_attn", "qkvo"), ("mlp", ("gate", "up", "down")))
        for name in names
    )
    assert added.params.formats[0].modules == [rf"re:model\.layers\.(?:1)\.(?:{tails})$"]  # the outlier block in FP8
    assert added.params.formats[1].params == {"group_size": 32}  # the recipe's own INT4 variant's params
    source = resolve_source(ModelSpec(source=str(model)), tmp_path)
    made = quantize_variant(source, added, loaded.recipe.calibration, tmp_path, cache_root, "cpu").path
    config = json.loads((made / "config.json").read_text())["quantization_config"]
    formats_stored = sorted(group["format"] for group in config["config_groups"].values())
    assert config["format"] == "mixed-precision" and formats_stored == ["float-quantized", "pack-quantized"]
    with safe_open(made / "model.safetensors", "pt") as tensors:
        names = [name for name in tensors.keys() if name.startswith("model.layers.")]  # noqa: SIM118
        assert {"model.layers.1.mlp.up_proj.weight_scale", "model.layers.0.mlp.up_proj.weight_packed"} <= set(names)
        stored = sum(_bits(tensors.get_slice(name)) for name in names)
    linear = 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128)  # q, o 64x64; k, v 32x64; gate, up, down 64x128
    norms = 2 * 2 * 64 * 16  # two BF16 norms per block: not linear weights, not counted by the mix
    assert outcome.mix.weights == linear and outcome.mix.bits == stored - norms

    with pytest.raises(InfeasibleBudget, match="4 bits per weight is below the least these formats can store: 4.5"):
        run_budget_mix(validate(recipe, cache_root), formats, 4, options, lambda *_: None)  # measured already: quick


def _bits(tensor) -> int:
    import math

    return math.prod(tensor.get_shape()) * {"BF16": 16, "F8_E4M3": 8, "I32": 32, "I64": 64}[tensor.get_dtype()]


@pytest.mark.parametrize(
    ("formats", "budget", "field", "message"),
    [
        (["fp8", "nvfp5"], 4.5, "--formats", "unknown format 'nvfp5'"),
        (["fp8"], 4.5, "--formats", "name two formats or more"),
        (["fp8", "bf16"], 0, "--budget-bits", "0 is not a number of bits per weight"),
        # the tiny Llama's 64-wide layers: no group of 128 (the recipe's own awq variant takes 32)
        (["fp8", "gptq_int4"], 4.5, "--formats", "'gptq_int4': its default params.group_size does not fit the model"),
    ],
)
def test_a_wrong_budget_request_is_bad_input_before_any_work(tmp_path, tiny_llama, formats, budget, field, message):
    from quantlab.checks import validate
    from quantlab.errors import BadInput
    from quantlab.sensitivity.command import SensitivityOptions, check_formats

    loaded = validate(write(tmp_path / "tiny.yaml", tiny_recipe(tiny_llama.path)))
    with pytest.raises(BadInput) as caught:
        check_formats(loaded, formats, budget, SensitivityOptions("sqlite:///unused.db", tmp_path))
    (problem,) = caught.value.problems
    assert (problem.file, message in problem.message) == (field, True), problem


_BLOCK_MODULES = ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj")
# the groups chosen for one format -> compressed-tensors' matcher takes exactly their modules among every name below
TARGETS = {
    "one block": ["model.layers.1"],
    "blocks merged into one pattern": ["model.layers.0", "model.layers.11"],
    "a module group of its own": ["model.layers.2", "lm_head"],
}


@pytest.mark.parametrize("case", TARGETS, ids=TARGETS)
def test_target_patterns_take_exactly_the_groups_linear_layers(case):
    """Not the attention module (which a pattern over the whole block would give a scheme), nor block 1 for 11."""
    from compressed_tensors.utils.match import match_name

    from quantlab.sensitivity.groups import target_patterns

    blocks = [f"model.layers.{i}" for i in (0, 1, 2, 11)]
    every = [*blocks, *(f"{b}.self_attn" for b in blocks), *(f"{b}.{m}" for b in blocks for m in _BLOCK_MODULES)]
    every.append("lm_head")
    names = TARGETS[case]
    groups = [
        LayerGroup(name, (name,) if name == "lm_head" else tuple(f"{name}.{m}" for m in _BLOCK_MODULES))
        for name in names
    ]
    patterns = target_patterns(groups)
    taken = {module for module in every if any(match_name(module, pattern) for pattern in patterns)}
    assert taken == {module for group in groups for module in group.modules}, patterns
    assert len(patterns) == len({name.rpartition(".")[0] for name in names})  # one per stem
