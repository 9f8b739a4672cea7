"""Recipe files for tests: a valid base over the tiny Llama, and edits that break one thing."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
# What every sweep's parent run carries (serving.png and damage.png besides, where the sweep has their figures)
SWEEP_ARTIFACTS = frozenset({"recipe.yaml", "frontier.json", "frontier.png", "frontier.html", "report.md"})


def tiny_recipe(model_dir: Path, **overrides: Any) -> dict[str, Any]:
    """A fast, valid recipe over the tiny Llama: three methods, small eval, small quality pass."""
    recipe: dict[str, Any] = {
        "name": "tiny",
        "model": {"source": str(model_dir)},
        "baseline": "bf16",
        "variants": [
            {"name": "bf16", "method": "bf16"},
            {"name": "fp8", "method": "fp8"},
            {"name": "awq", "method": "awq_int4", "params": {"group_size": 32}},
        ],
        "calibration": {"num_samples": 4, "seq_len": 32},
        "evals": {
            "include_path": str(REPO / "evals"),
            "batch_size": 4,
            "tasks": [{"name": "mmlu_dev", "limit": 4}, {"name": "pydoc_cloze", "limit": 6}],
        },
        # on-policy damage is off: tests/test_sweep.py and tests/test_on_policy.py turn it on (ON_POLICY)
        "quality": {"max_tokens": 96, "window": 32, "generate": {"enabled": False}},
        "measure": {"prompt_tokens": 8, "output_tokens": 4, "repeats": 1, "warmup": 0},
        "serving": {"enabled": False},  # a server per variant costs ~30 s: tests/test_serving.py turns it on
    }
    recipe.update(copy.deepcopy(overrides))
    return recipe


# On-policy damage on 2 short continuations: the keys and their pairing, at little cost per sweep
ON_POLICY = {"max_tokens": 96, "window": 32, "generate": {"prompts": 2, "prompt_tokens": 8, "max_new_tokens": 8}}


def write(path: Path, recipe: dict[str, Any] | str) -> Path:
    path.write_text(recipe if isinstance(recipe, str) else yaml.safe_dump(recipe, sort_keys=False))
    return path
