"""A sweep's plan (quantlab.plan), made once: the source resolved and a GGUF file hashed once per sweep, what happens
to each variant (copied, logged from the cache, computed), and the cache bytes the computed ones write."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from tiny import EMBEDDED_GGUF

from quantlab import cache, disk, kept_results, models
from quantlab import plan as planning
from quantlab.checks import validate
from quantlab.errors import BadInput
from quantlab.kept_results import KeptResult
from quantlab.plan import Action, make_plan, results_version
from quantlab.recipe import load_recipe
from quantlab.serving.engines.base import ScoringProtocol
from quantlab.serving.engines.vllm import VLLM
from quantlab.serving.environments import installed_version
from quantlab.tracking import RESULTS_VERSION, RUN_KEY, SETTINGS_KEY, RunRecord
from recipes import tiny_recipe, write


def _no_runs(experiment, keys, tag):
    return {}


def _finished(run_key: str) -> RunRecord:
    return RunRecord("run-1", "0", "fp8", "FINISHED", 0, {}, {}, {"quantlab.run_key": run_key})


def test_a_gguf_source_is_hashed_once_per_sweep(tmp_path, monkeypatch):
    """What a sweep does before any variant runs: check the recipe, plan it, make every job. The GGUF file is hashed
    once (it was hashed 3 times here, then once more in each variant's process); every job carries its identity."""
    hashed: list[Path] = []
    real = cache.file_sha256

    def counted(path, *args, **kwargs):
        hashed.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(cache, "file_sha256", counted)
    models._hashed_gguf.cache_clear()  # an earlier test in this process may have hashed the same file
    recipe = tiny_recipe(Path("unused"), model={"source": EMBEDDED_GGUF}, evals={"tasks": []})
    recipe["variants"] = [{"name": "bf16", "method": "bf16"}, {"name": "fp8", "method": "fp8"}]
    loaded = validate(write(tmp_path / "recipe.yaml", recipe), tmp_path / "cache")
    plan = make_plan(loaded, tmp_path / "cache", (), False, _no_runs)
    jobs = [plan.job(variant, None, tmp_path) for variant in plan.variants]

    assert [path.name for path in hashed] == ["SmolLM2-135M-Instruct.Q4_1.gguf"]
    assert plan.source.kind == "gguf" and plan.source.identity.startswith(
        "gguf:SmolLM2-135M-Instruct.Q4_1.gguf:sha256="
    )
    assert all(job.source == plan.source for job in jobs)
    # The cache lacks the model's float32 conversion: 4 bytes for each of SmolLM2-135M's 134,515,008 parameters
    # (tied embeddings 49,152 x 576; 30 blocks of q, o 576 x 576, k, v 576 x 192, MLP 3 x 576 x 1,536 and two
    # norms; a final norm), with the margin. Then the two checkpoints.
    conversion, checkpoints = plan.space_needs
    assert (conversion.directory, conversion.bytes, conversion.what) == (
        tmp_path / "cache",
        disk.with_margin(4 * 134_515_008),
        "the float32 conversion of SmolLM2-135M-Instruct.Q4_1.gguf",
    )
    assert checkpoints.what == "2 checkpoints to build (bf16, fp8)"


def test_each_variant_is_copied_logged_from_the_cache_or_computed(tmp_path, tiny_llama):
    loaded = load_recipe(write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path)))
    first = make_plan(loaded, tmp_path / "cache", (), False, _no_runs)
    keys = {variant.name: variant.run_key for variant in first.variants}
    kept_results.keep(tmp_path / "cache", KeptResult("awq", keys["awq"], {}, {}, {}))
    asked: list[set[str]] = []

    def finished(experiment, run_keys, tag):
        asked.append((experiment, set(run_keys), tag))
        return {keys["fp8"]: _finished(keys["fp8"])} if tag == RUN_KEY else {}

    plan = make_plan(loaded, tmp_path / "cache", (), False, finished)

    # the store is asked once by run key, then once by settings key for the variant computed
    assert asked == [("tiny", set(keys.values()), RUN_KEY), ("tiny", {plan.variant("bf16").settings_key}, SETTINGS_KEY)]
    assert plan.variant("bf16").recomputed_because == ""  # no run of its settings: nothing to say
    assert [(variant.name, variant.action) for variant in plan.variants] == [
        ("bf16", Action.COMPUTE),
        ("fp8", Action.COPY),
        ("awq", Action.LOG_KEPT),
    ]
    assert plan.variant("fp8").finished_run.run_id == "run-1" and plan.variant("awq").kept.run_key == keys["awq"]
    assert plan.variant("bf16").checkpoint_dir == cache.checkpoint_dir(
        tmp_path / "cache", "bf16", plan.variant("bf16").checkpoint_key
    )
    forced = make_plan(loaded, tmp_path / "cache", (), True, lambda *asked: pytest.fail("--force asks no store"))
    assert {variant.action for variant in forced.variants} == {Action.COMPUTE}
    assert [variant.run_key for variant in forced.variants] == list(keys.values())  # the keys do not move


def test_a_run_of_the_same_settings_logged_by_another_results_version_is_recomputed_and_said(
    tmp_path, tiny_llama, monkeypatch
):
    """A figure added to the contract (or a review's bump) changes every run key: a run logged before is not copied
    without the figure, and the plan says why it computes again."""
    loaded = load_recipe(write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path)))
    before = make_plan(loaded, tmp_path / "cache", (), False, _no_runs)
    logged = {
        v.settings_key: RunRecord(
            f"run-{v.name}", "0", v.name, "FINISHED", 0, {}, {}, {RESULTS_VERSION: before.results_version}
        )
        for v in before.variants
    }
    monkeypatch.setattr(planning, "RESULTS_REVIEW", planning.RESULTS_REVIEW + 1)
    after = make_plan(loaded, tmp_path / "cache", (), False, lambda e, keys, tag: logged if tag == SETTINGS_KEY else {})

    assert after.results_version != before.results_version
    for old, new in zip(before.variants, after.variants):
        assert new.settings_key == old.settings_key and new.run_key != old.run_key and new.action is Action.COMPUTE
        assert new.recomputed_because == (
            f"recomputed: results changed since run run-{new.name} "
            f"(results version {before.results_version} -> {after.results_version})"
        )


@pytest.mark.parametrize(
    "change",
    [
        lambda monkeypatch: monkeypatch.setattr(planning, "RESULTS_REVIEW", planning.RESULTS_REVIEW + 1),
        lambda monkeypatch: monkeypatch.setattr(planning, "SAMPLES_FORMAT", planning.SAMPLES_FORMAT + 1),
        lambda monkeypatch: monkeypatch.setattr(planning, "contract_digest", lambda: "another contract"),
    ],
    ids=["a review's bump", "the per-document records' format", "the metric contract"],
)
def test_the_results_version_follows_the_contract_the_stored_format_and_reviews(monkeypatch, change):
    before = results_version()
    change(monkeypatch)
    assert results_version() != before


def test_the_bytes_a_plan_needs_are_the_checkpoints_it_builds(tmp_path, tiny_llama):
    """Only computed variants whose checkpoint the cache lacks write one; each as disk.py models it, with its margin."""
    loaded = load_recipe(write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path)))
    first = make_plan(loaded, tmp_path / "cache", (), False, _no_runs)
    fp8 = first.variant("fp8")
    cache.checkpoint_dir(tmp_path / "cache", "bf16", first.variant("bf16").checkpoint_key).mkdir(parents=True)
    (first.variant("bf16").checkpoint_dir / cache.COMPLETE_MARKER).write_text("{}")  # bf16's checkpoint is cached
    plan = make_plan(
        loaded,
        tmp_path / "cache",
        (),
        False,
        lambda experiment, keys, tag: {fp8.run_key: _finished(fp8.run_key)} if tag == RUN_KEY else {},
    )

    shape = disk.model_shape(plan.source)
    awq = disk.with_margin(disk.checkpoint_bytes(shape, "awq_int4", {"group_size": 32}))
    assert [(v.name, v.builds_checkpoint, v.cache_bytes) for v in plan.variants] == [
        ("bf16", False, 0),  # computed, its checkpoint reused
        ("fp8", False, 0),  # copied
        ("awq", True, awq),
    ]
    [need] = plan.space_needs
    assert (need.directory, need.bytes, need.what) == (
        tmp_path / "cache" / "checkpoints",
        awq,
        "1 checkpoint to build (awq)",
    )


def test_a_plan_that_computes_nothing_estimates_nothing(tmp_path, tiny_llama):
    loaded = load_recipe(write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path)))
    keys = [variant.run_key for variant in make_plan(loaded, tmp_path / "cache", (), False, _no_runs).variants]
    plan = make_plan(
        loaded, tmp_path / "cache", (), False, lambda experiment, asked, tag: {key: _finished(key) for key in keys}
    )
    assert not plan.computes and not plan.estimated and plan.space_needs == ()


def test_only_names_variants_and_keeps_the_baseline_first(tmp_path, tiny_llama):
    loaded = load_recipe(write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path)))
    assert make_plan(loaded, tmp_path / "cache", ("awq",), False, _no_runs).names == ["bf16", "awq"]
    with pytest.raises(BadInput, match="'fp9' is not a variant of recipe.yaml; variants: bf16, fp8, awq"):
        make_plan(loaded, tmp_path / "cache", ("fp9",), False, lambda *asked: pytest.fail("asked before --only"))


def _engine_installed(site: Path, version: str) -> None:
    """A vLLM distribution record of `version` on the Python path: what importlib.metadata reads an engine's
    version from (an upgrade replaces it)."""
    for old in site.glob("vllm-*.dist-info"):
        shutil.rmtree(old)
    record = site / f"vllm-{version}.dist-info"
    record.mkdir(parents=True)
    (record / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    installed_version.cache_clear()  # each sweep's process asks afresh; this one remembers its answers


@pytest.mark.parametrize(
    "serving, evals_engine, keyed",
    [
        ({"enabled": True}, "reference", True),  # its load goes through the engine
        ({"enabled": False}, "both", True),  # its scores do
        ({"enabled": False}, "reference", False),  # no server: the engine decides no figure
    ],
)
def test_the_run_key_follows_the_engines_installed_version(
    tmp_path, tiny_llama, monkeypatch, serving, evals_engine, keyed
):
    site = tmp_path / "site"
    monkeypatch.setenv("PYTHONPATH", str(site))  # read by the interpreter the engine's version is asked of
    recipe = tiny_recipe(tiny_llama.path, serving={"engine": "vllm", "python": sys.executable, **serving})
    recipe["evals"]["engine"] = evals_engine
    loaded = load_recipe(write(tmp_path / "recipe.yaml", recipe))
    keys = []
    for version in ("0.32.0", "0.33.0", "0.33.0"):
        _engine_installed(site, version)
        keys.append(
            [variant.run_key for variant in make_plan(loaded, tmp_path / "cache", (), False, _no_runs).variants]
        )
    assert keys[1] == keys[2]  # the same engine: the same runs
    assert (keys[0] != keys[1]) == keyed and all(a != b for a, b in zip(keys[0], keys[1])) == keyed


def test_the_run_key_follows_the_plugins_an_engine_loads(tmp_path, tiny_llama):
    """A recipe that opts in to quantlab's vLLM plugin serves other figures than stock vLLM: other runs."""
    keys = []
    for plugins in ([], ["fp8-upcast-gemm"]):
        serving = {"engine": "vllm", "python": sys.executable, "plugins": plugins}
        loaded = load_recipe(write(tmp_path / "recipe.yaml", tiny_recipe(tiny_llama.path, serving=serving)))
        keys.append(
            [variant.run_key for variant in make_plan(loaded, tmp_path / "cache", (), False, _no_runs).variants]
        )
    assert all(stock != plugged for stock, plugged in zip(*keys))


def test_an_adaptive_sweeps_run_key_follows_the_limits_its_tasks_stop_at(tmp_path, tiny_llama):
    keys = []
    for limit in (2.0, 5.0):
        recipe = tiny_recipe(tiny_llama.path, frontier={"default_policy": {"max_drop_any_task": limit}})
        recipe["evals"]["adaptive"] = True
        loaded = load_recipe(write(tmp_path / "recipe.yaml", recipe))
        keys.append(
            [variant.run_key for variant in make_plan(loaded, tmp_path / "cache", (), False, _no_runs).variants]
        )
    assert all(first != second for first, second in zip(*keys))


@pytest.mark.parametrize(("evals_engine", "keyed"), [("both", True), ("reference", False)])
def test_the_run_key_follows_the_engines_scoring_protocol(tmp_path, tiny_llama, monkeypatch, evals_engine, keyed):
    """Kept served scores came through the engine's own requests: another protocol (the engine's declaration, not a
    number bumped by hand) is other runs; a recipe scored in process only keeps its runs."""
    recipe = tiny_recipe(tiny_llama.path, serving={"engine": "vllm", "python": sys.executable})
    recipe["evals"]["engine"] = evals_engine
    loaded = load_recipe(write(tmp_path / "recipe.yaml", recipe))
    keys = []
    for completions in ("local-completions", "another-completions-client"):
        protocol = ScoringProtocol(completions, VLLM.scoring_protocol.prompt_logprobs)
        monkeypatch.setattr(VLLM, "scoring_protocol", protocol)
        keys.append(
            [variant.run_key for variant in make_plan(loaded, tmp_path / "cache", (), False, _no_runs).variants]
        )
    assert all(first != second for first, second in zip(*keys)) == keyed
    assert any(first != second for first, second in zip(*keys)) == keyed
