"""Recipes for hub models on a machine without the hub: validate says what it could not check,
a sweep refuses before any work. (No machine here reaches a hub: the offline case is real.)"""

from __future__ import annotations

from pathlib import Path

from test_sweep import quantlab

from recipes import REPO, write

GPU_RECIPE = REPO / "recipes" / "llama-3.1-8b-instruct.yaml"


def test_validate_checks_the_gpu_recipe_offline_and_names_what_needs_the_hub(tmp_path: Path) -> None:
    done = quantlab("validate", str(GPU_RECIPE), cwd=tmp_path, env={"QUANTLAB_CACHE_DIR": str(tmp_path / "cache")})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].endswith("OK offline - 3 variants: bf16 (bf16), fp8-dynamic (fp8), awq-int4-g128 (awq_int4)")
    needs = [line for line in lines if "needs the hub" in line]
    assert len(needs) == 2
    assert "model.source: the config of meta-llama/Llama-3.1-8B-Instruct" in needs[0]
    for task in ("mmlu", "gsm8k", "arc_challenge", "hellaswag", "winogrande", "truthfulqa_mc2", "wikitext"):
        assert task in needs[1]


def test_validate_still_finds_mistakes_in_a_hub_recipe_offline(tmp_path: Path) -> None:
    broken = GPU_RECIPE.read_text().replace("name: gsm8k", "name: gsm8kk")
    done = quantlab(
        "validate",
        str(write(tmp_path / "r.yaml", broken)),
        cwd=tmp_path,
        env={"QUANTLAB_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert done.returncode == 2
    assert "evals.tasks[1].name: lm-eval cannot resolve task 'gsm8kk' (did you mean 'gsm8k'?)" in done.stderr


def test_a_sweep_of_an_unreachable_hub_model_is_bad_input(tmp_path: Path) -> None:
    recipe = write(
        tmp_path / "r.yaml",
        {
            "name": "hub",
            "model": {"source": "meta-llama/Llama-3.1-8B-Instruct"},
            "baseline": "bf16",
            "variants": [{"name": "bf16", "method": "bf16"}],
        },
    )
    done = quantlab("sweep", str(recipe), "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {recipe}: model.source: meta-llama/Llama-3.1-8B-Instruct is a hub model, this machine cannot "
        "reach the hub, and the local Hugging Face cache has no copy"
    ]
    assert not (tmp_path / "cache").exists() and not (tmp_path / "mlruns").exists()
