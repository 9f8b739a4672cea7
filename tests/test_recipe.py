"""Recipe validation: every error path names the file and the field, and all are reported at once."""

from __future__ import annotations

import json
import pickle

import pytest

from quantlab import cache
from quantlab.checks import remember_lookups, validate
from quantlab.errors import BadInput
from quantlab.evaluate.lm_eval_runner import task_index_identity
from quantlab.recipe import load_recipe
from recipes import REPO, tiny_recipe, write


def _problems(path, cache_root=None) -> list[str]:
    with pytest.raises(BadInput) as caught:
        validate(path, cache_root)
    return [str(problem) for problem in caught.value.problems]


def _variant(name, method, **params):
    return {"name": name, "method": method, **({"params": params} if params else {})}


@pytest.mark.parametrize(
    ("edit", "field", "message"),
    [
        ({"colour": "red"}, "colour", "unknown key"),
        ({"name": None}, "name", "string"),
        ({"name": "../escape"}, "name", "must be 1-64 letters"),
        ({"variants": []}, "variants", "at least 1"),
        ({"baseline": "bf17"}, "baseline", "did you mean 'bf16'"),
        (
            {"variants": [_variant("bf16", "bf16"), _variant("bf16", "fp8")]},
            "variants[1] (bf16).name",
            "duplicate variant name",
        ),
        (
            {"variants": [_variant("bf16", "bf16"), _variant("w4", "awq_int5")]},
            "variants[1] (w4).method",
            "did you mean 'awq_int4'",
        ),
        (
            {"variants": [_variant("bf16", "bf16"), _variant("w4", "awq_int4", bits=3)]},
            "variants[1] (w4).params.bits",
            "unknown parameter",
        ),
        (
            {"variants": [_variant("bf16", "bf16"), _variant("w4", "awq_int4", group_size=0)]},
            "variants[1] (w4).params.group_size",
            "greater than 0",
        ),
        (
            {"variants": [_variant("bf16", "bf16"), _variant("w4", "awq_int4", n_grid=3)]},
            "variants[1] (w4).params.n_grid",
            "greater than or equal to 4",
        ),
        (
            {"variants": [_variant("bf16", "bf16"), _variant("w4", "awq_int4", group_size=48)]},
            "variants[1] (w4).params.group_size",
            "does not divide",
        ),
        (
            {"variants": [_variant("bf16", "bf16"), _variant("../../x", "fp8")]},
            "variants[1] (../../x).name",
            "must be 1-64 letters",
        ),
        ({"calibration": {"num_samples": -4}}, "calibration.num_samples", "greater than 0"),
        ({"calibration": {"num_samples": "many"}}, "calibration.num_samples", "valid integer"),
        ({"calibration": {"num_samples": 4, "batch_size": 8}}, "calibration.batch_size", "more than num_samples (4)"),
        ({"calibration": {"batch_size": 0}}, "calibration.batch_size", "greater than 0"),
        ({"calibration": {"source": "missing.txt"}}, "calibration.source", "no such file"),
        ({"calibration": {"source": "builtin:nope"}}, "calibration.source", "unknown builtin text"),
        ({"evals": {"batch_size": 0}}, "evals.batch_size", "greater than 0"),
        ({"evals": {"include_path": "no-such-dir"}}, "evals.include_path", "no such directory"),
        (
            {"evals": {"include_path": str(REPO / "evals"), "tasks": [{"name": "mmlu_dve"}]}},
            "evals.tasks[0].name",
            "did you mean 'mmlu_dev'",
        ),
        ({"model": {"source": "missing.gguf"}}, "model.source", "no such GGUF file"),
        ({"model": {"source": "not a model"}}, "model.source", "not a local path"),
        ({"model": {"source": "pkg://no_such_package/model.gguf"}}, "model.source", "not installed"),
        ({"quality": {"window": 1}}, "quality.window", "greater than 1"),
        (
            {"frontier": {"default_policy": {"sequence": ["awq", "fp9"]}}},
            "frontier.default_policy.sequence[1]",
            "'fp9': not a variant name (did you mean 'fp8'?)",
        ),
        (
            {"frontier": {"default_policy": {"sequence": ["bf16"]}}},
            "frontier.default_policy.sequence[0]",
            "'bf16': the baseline is no candidate",
        ),
        ({"frontier": {"default_policy": {"candidates": "holm"}}}, "frontier.default_policy.candidates", "'none'"),
        ({"quality": {"contexts": [1024, 256]}}, "quality.contexts", "not strictly increasing"),
        ({"quality": {"contexts": [1, 256]}}, "quality.contexts[0]", "greater than 1"),
        ({"quality": {"context_windows": 0}}, "quality.context_windows", "greater than 0"),
        (
            {"variants": [_variant("bf16", "bf16"), {"name": "kv", "method": "fp8", "kv_cache": "fp4"}]},
            "variants[1] (kv).kv_cache.format",
            "'fp8'",
        ),
        (
            {
                "variants": [
                    _variant("bf16", "bf16"),
                    {"name": "kv", "method": "fp8", "kv_cache": {"granularity": "row"}},
                ]
            },
            "variants[1] (kv).kv_cache.granularity",
            "'tensor' or 'head'",
        ),
        (
            {"variants": [_variant("bf16", "bf16"), {"name": "kv", "method": "fp8", "kv_cache": {"bits": 8}}]},
            "variants[1] (kv).kv_cache.bits",
            "unknown key",
        ),
        (
            {
                "variants": [
                    _variant("bf16", "bf16"),
                    _variant("mix", "mixed", formats=[{"method": "fp9", "modules": ["x"]}]),
                ]
            },
            "variants[1] (mix).params.formats[0]",
            "unknown method 'fp9' for a part",
        ),
        (
            {
                "variants": [
                    _variant("bf16", "bf16"),
                    _variant("mix", "mixed", formats=[{"method": "bf16", "modules": ["x"]}]),
                ]
            },
            "variants[1] (mix).params.formats[0]",
            "'bf16' quantizes nothing",
        ),
        (
            {
                "variants": [
                    _variant("bf16", "bf16"),
                    _variant("mix", "mixed", formats=[{"method": "fp8", "modules": [r"re:model\.layer\.0\..*"]}]),
                ]
            },
            "variants[1] (mix).params.formats[0].modules[0]",
            "matches no linear layer",
        ),
        (
            {
                "variants": [
                    _variant("bf16", "bf16"),
                    _variant(
                        "mix",
                        "mixed",
                        formats=[{"method": "gptq_int4", "params": {"group_size": 48}, "modules": ["re:.*mlp.*"]}],
                    ),
                ]
            },
            "variants[1] (mix).params.formats[0].params.group_size",
            "48 does not divide",
        ),
    ],
)
def test_each_broken_field_is_named(tmp_path, tiny_llama, edit, field, message):
    path = write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path, **edit))
    problems = _problems(path)
    assert any(p.startswith(f"{path}: {field}: ") and message in p for p in problems), problems


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = write(tmp_path / "recipe.yaml", "name: x\nvariants: [\n  - a\nbaseline: x\n")
    (problem,) = _problems(path)
    assert problem.startswith(f"{path}: line 3") and "YAML syntax error" in problem


@pytest.mark.parametrize("text", ["just a string", "- a\n- list\n", ""])
def test_recipe_must_be_a_mapping(tmp_path, text):
    path = write(tmp_path / "recipe.yaml", text)
    assert "a recipe is a YAML mapping" in _problems(path)[0]


def test_missing_recipe_file(tmp_path):
    assert _problems(tmp_path / "nope.yaml") == [f"{tmp_path / 'nope.yaml'}: no such recipe file"]


def test_every_problem_is_reported_at_once(tmp_path, tiny_llama):
    recipe = tiny_recipe(tiny_llama.path, baseline="nope", variants=[_variant("a", "fp9"), _variant("a", "bf16")])
    problems = _problems(write(tmp_path / "recipe.yaml", recipe))
    assert len(problems) == 3, problems


def test_yaml_is_loaded_safely(tmp_path):
    path = write(tmp_path / "recipe.yaml", "name: !!python/object/apply:os.system ['echo pwned']\n")
    assert "YAML syntax error" in _problems(path)[0]


def test_valid_recipe_resolves_defaults(tmp_path, tiny_llama):
    loaded = validate(write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path)))
    assert [v.name for v in loaded.recipe.variants] == ["bf16", "fp8", "awq"]
    assert loaded.recipe.model.trust_remote_code is False
    assert loaded.include_path == REPO / "evals"


def test_bundled_recipe_is_valid():
    loaded = validate(REPO / "recipes" / "smollm2-135m.yaml")
    assert loaded.recipe.variant("awq-int4-g64").params.group_size == 64


def test_group_128_does_not_fit_smollm2(tmp_path):
    text = (REPO / "recipes" / "smollm2-135m.yaml").read_text().replace("group_size: 64", "group_size: 128")
    path = write(tmp_path / "recipe.yaml", text.replace("../evals", str(REPO / "evals")))
    (problem,) = _problems(path)
    assert "variants[2] (awq-int4-g64).params.group_size: 128 does not divide" in problem and "576" in problem


def test_a_valid_recipe_check_is_remembered_and_used_again(tmp_path, tiny_llama):
    cache_root = tmp_path / "cache"
    misfit = [_variant("bf16", "bf16"), _variant("w4", "awq_int4", group_size=48)]
    with pytest.raises(BadInput):
        validate(write(tmp_path / "bad.yaml", tiny_recipe(tiny_llama.path, variants=misfit)), cache_root)
    good = write(tmp_path / "good.yaml", tiny_recipe(tiny_llama.path))
    loaded = validate(good, cache_root)
    assert not cache_root.exists()  # a check alone leaves nothing behind; the sweep remembers it
    remember_lookups(loaded, cache_root)
    facts = {path: json.loads(path.read_text()) for path in (cache_root / "recipe-checks").glob("*.json")}
    (widths,) = [path for path, fact in facts.items() if isinstance(fact, dict)]
    (names,) = [path for path, fact in facts.items() if isinstance(fact, list)]
    # The recipe's tasks are defined under its include_path: only that small index was looked up.
    assert set(facts[widths].values()) == {64, 128}
    assert facts[names] == [
        "mmlu_dev",
        "pydoc_cloze",
        "pydoc_passkey",
        "pydoc_passkey_2k",
        "pydoc_passkey_512",
        "pydoc_passkey_8k",
        "pydoc_recall",
        "quantlab_bundled",
    ]
    # The next check reads what was remembered instead of asking transformers and lm-eval again.
    widths.write_text(json.dumps({"model.layers.0.mlp.down_proj": 48}))
    names.write_text(json.dumps(["pydoc_cloze"]))
    # (a name missing from the local index is looked up in lm-eval's whole index: remembered too)
    cache.remember(cache_root / "recipe-checks", task_index_identity(REPO / "evals"), ["pydoc_cloze", "hellaswag"])
    task_problem, width_problem = sorted(_problems(good, cache_root))
    assert task_problem.startswith(f"{good}: evals.tasks[0].name: lm-eval cannot resolve task 'mmlu_dev'")
    assert (
        width_problem.startswith(f"{good}: variants[2] (awq).params.group_size: 32 does not divide")
        and "[48]" in width_problem
    )


RECALL = "eval/pydoc_recall/exact_match:remove_whitespace"
PASSKEY_512 = "eval/pydoc_passkey_512/exact_match:remove_whitespace"


@pytest.mark.parametrize(
    ("tasks", "limits", "problem"),
    [
        (["mmlu_dev", "pydoc_cloze"], {"eval/pydoc_cloze/acc": 5}, None),
        (["mmlu_dev", "pydoc_cloze"], {"quality/ppl": "+2%"}, None),  # not an lm-eval score: no task to find
        (["pydoc_passkey"], {PASSKEY_512: 20}, None),  # a tag's task
        (["quantlab_bundled"], {RECALL: 20, "eval/mmlu_dev/acc": 10}, None),  # tasks below a requested name
        (["mmlu_dev", "pydoc_cloze"], {RECALL: 16}, f"max_drop.{RECALL}: the recipe scores no task 'pydoc_recall'"),
        (["pydoc_passkey"], {"eval/pydoc_cloze/acc": 5}, "no task 'pydoc_cloze' (evals.tasks: pydoc_passkey, and"),
        (["pydoc_cloze"], {"eval/pydoc_clozee/acc": 5}, "'pydoc_clozee' (evals.tasks: pydoc_cloze, and the tasks"),
        (["quantlab_bundled"], {"eval/pydoc_recal/exact_match": 5}, "(did you mean 'pydoc_recall'?)"),
        ([], {"eval/pydoc_cloze/acc": 5}, "the recipe scores no task 'pydoc_cloze' (evals.tasks: none)"),
    ],
)
def test_a_drop_limit_on_a_task_the_recipe_does_not_score_is_refused(tmp_path, tiny_llama, tasks, limits, problem):
    """Such a limit would let the whole sweep run, then fail every variant for a metric no run logged."""
    recipe = tiny_recipe(
        tiny_llama.path,
        evals={"include_path": str(REPO / "evals"), "tasks": [{"name": name, "limit": 2} for name in tasks]},
        frontier={"default_policy": {"max_drop": limits}},
    )
    path = write(tmp_path / "recipe.yaml", recipe)
    if problem is None:
        validate(path)
        return
    (found,) = _problems(path)
    assert found.startswith(f"{path}: frontier.default_policy.max_drop.") and problem in found, found


def test_load_recipe_does_not_touch_the_model(tmp_path):
    """The first pass needs only the file: a hub id that cannot be reached still parses."""
    loaded = load_recipe(write(tmp_path / "recipe.yaml", tiny_recipe("org/model", evals={})))
    assert loaded.recipe.model.source == "org/model"


def test_a_loaded_recipe_pickles_as_a_job_sent_to_its_process_does():
    """Each method's variant model is found by name, so a spawned variant process unpickles its job."""
    loaded = load_recipe(REPO / "recipes" / "smollm2-135m.yaml")
    again = pickle.loads(pickle.dumps(loaded))
    assert again == loaded and type(again.recipe.variant("awq-int4-g64")).__name__ == "AwqInt4Variant"


@pytest.mark.parametrize(
    ("written", "granularity", "strategy"),
    [
        ("fp8", "tensor", "tensor"),
        ({"format": "fp8"}, "tensor", "tensor"),
        ({"granularity": "head"}, "head", "attn_head"),
    ],
)
def test_kv_cache_on_any_method_and_its_calibration(tmp_path, tiny_llama, written, granularity, strategy):
    """`kv_cache: fp8` is short for per tensor; a KV cache is calibrated (its static scales), whatever the method."""
    variants = [_variant("bf16", "bf16"), {"name": "kv", "method": "fp8", "kv_cache": written}]
    recipe = validate(write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path, variants=variants))).recipe
    kv, plain = recipe.variant("kv"), recipe.variant("bf16")
    assert (kv.kv_cache.format, kv.kv_cache.granularity, kv.kv_cache.strategy) == ("fp8", granularity, strategy)
    assert kv.needs_calibration and plain.kv_cache is None and not plain.needs_calibration
