"""Each variant a logged model (MLflow 3's Models tab) and the release card on the registered version (issue 49).

The card's building is pure (quantlab.release_card), checked here on a decision taken over test_tracking_door's
logged sweep, with the chosen run given what a served sweep logs. The logged models are checked on the in-memory
fake and on a real MLflow store in SQLite, as test_tracking_door checks the rest of the door.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest
from memory_store import MemoryStore
from test_tracking_door import MMLU, MMLU_DATA, _logged_sweep

from quantlab import publish, release_card, tracking

WORKLOAD = "cost/serving/workload/"
RECIPE = "name: tiny\n"
RECIPE_HASH = hashlib.sha256(RECIPE.encode()).hexdigest()


@pytest.fixture(params=["memory", "mlflow"])
def store(request, tmp_path) -> tracking.TrackingStore:
    if request.param == "memory":
        return MemoryStore()
    return tracking.open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")


@pytest.mark.parametrize(
    ("key", "dataset"),
    [
        ("eval/mmlu_dev/acc", "mmlu_dev"),
        ("eval/mmlu_dev/acc_stderr", "mmlu_dev"),
        ("quality/flips/mmlu_dev", "mmlu_dev"),
        ("quality/flips/mmlu_dev/correct_to_wrong", "mmlu_dev"),
        ("quality/paired/eval/mmlu_dev/acc/diff", "mmlu_dev"),
        ("quality/engine_floor/eval/mmlu_dev/acc/diff", "mmlu_dev"),
        ("eval/mmlu/acc", None),  # a group: scored on its leaves' data sets, not one of them
        ("quality/kld_mean", None),
        ("cost/weight_bytes", None),
        ("cost/serving/workload/mmlu_dev/goodput_tokens_per_s", None),  # a workload that shares a task's name
    ],
)
def test_a_metric_is_linked_to_the_data_set_its_key_names_as_a_task(key, dataset):
    assert tracking.metric_dataset(key, ["mmlu_dev", "pydoc_cloze"]) == dataset


GOODPUT, USD = f"{WORKLOAD}chat/goodput_tokens_per_s", f"{WORKLOAD}chat/usd_per_mtok"


@pytest.mark.parametrize(
    ("metrics", "expected"),
    [
        ({}, {}),
        (  # no workloads named: the one shape served, under the plain keys (not per load level)
            {"cost/serving/goodput_tokens_per_s": 5.0, "cost/serving/c1/output_tokens_per_s": 6.0},
            {release_card.DEFAULT_WORKLOAD: (("cost/serving/goodput_tokens_per_s", 5.0, None, None),)},
        ),
        (  # named: the plain keys are the first workload's, not listed twice
            {"cost/serving/goodput_tokens_per_s": 5.0, f"{WORKLOAD}chat/goodput_tokens_per_s": 5.0},
            {"chat": ((f"{WORKLOAD}chat/goodput_tokens_per_s", 5.0, None, None),)},
        ),
        (
            {GOODPUT: 120.0, f"{GOODPUT}/ci95_low": 110.0, f"{GOODPUT}/ci95_high": 130.0, USD: 0.5},
            {"chat": ((GOODPUT, 120.0, 110.0, 130.0), (USD, 0.5, None, None))},
        ),
        (  # a load level's figures are the level's, not the workload's
            {f"{WORKLOAD}long/c4/output_tokens_per_s": 9.0, f"{WORKLOAD}long/usd_per_mtok": 2.0},
            {"long": ((f"{WORKLOAD}long/usd_per_mtok", 2.0, None, None),)},
        ),
    ],
)
def test_the_cost_of_each_workload_with_its_interval(metrics, expected):
    found = release_card.workload_figures(metrics)
    assert {name: tuple((f.key, f.value, f.low, f.high) for f in shown) for name, shown in found.items()} == expected


@pytest.fixture(scope="module")
def decided(tmp_path_factory):
    """test_tracking_door's sweep (fp8 chosen among four, w8 and int4 rejected), in memory: (decision, its runs)."""
    store = MemoryStore()
    parent = _logged_sweep(store, tmp_path_factory.mktemp("card"))
    view = publish.read_sweep(store, parent)
    return publish.decide(view), {run.variant: run for run in tracking.child_runs(store, parent)}


SERVED = {
    "params": {
        "served.engine": "vllm",
        "served.engine_version": "vllm==0.11.0",
        "served.kernel.model.layers.0.mlp.down_proj": "CutlassFP8ScaledMMLinearKernel",
    },
    "tags": {"quantlab.serving.served_as": "FP8 W8A8", "quantlab.serving.kernel": "CutlassFP8ScaledMMLinearKernel"},
    "metrics": {GOODPUT: 120.0, f"{GOODPUT}/ci95_low": 110.0, f"{GOODPUT}/ci95_high": 130.0},
}
FLOOR = {
    "metrics": {
        "quality/engine_floor/eval/mmlu_dev/acc/diff": 0.004,
        "quality/engine_floor/eval/mmlu_dev/acc/ci95_low": -0.01,
        "quality/engine_floor/eval/mmlu_dev/acc/ci95_high": 0.02,
        "quality/engine_floor/eval/mmlu_dev/acc/n": 40,  # the comparison's other statistics stay in the run
        "quality/engine_floor/served/top1_agreement": 0.99,
        "quality/engine_floor/served/kld_topk_p99": 0.5,
    },
    "tags": {release_card.ENGINE_FLOOR_TAG: "bf16 served twice by vLLM: tasks at concurrency 4, then 1"},
}


@pytest.mark.parametrize(
    ("chosen", "floor", "shown", "absent"),
    [
        (  # what the memory sweep logged: no engine, no serving
            {},
            {},
            [
                "# tiny v3 (@production): fp8\n",
                "| checkpoint hash (content key) | `content-fp8` |",
                f"| recipe | `recipe.yaml` sha256 `{RECIPE_HASH}` |",
                "| mmlu_dev | `4935ca6785085dfa` |",
                "**Error rate of the choice.** The chance of shipping a variant truly over a drop limit is at most 2.5%",
                "| **w8** | rejected | 1 check: 1 drop limit | eval/mmlu_dev/acc at most 1 pt worse than the baseline: failed",
                "Not measured (no second served pass of the baseline).",
                "No serving workloads measured.",
                "Not served by an engine in this sweep.",
                "```\nquantlab sweep recipe.yaml\nquantlab pick --register\n```",
            ],
            ["served as"],
        ),
        (  # served by an engine, its cost per workload with its interval, and the engine's floor from the baseline
            SERVED,
            FLOOR,
            [
                "| served.engine | vllm |",
                "| served.engine_version | vllm==0.11.0 |",
                "| served as | FP8 W8A8 |",
                "| kernel: model.layers.0.mlp.down_proj | CutlassFP8ScaledMMLinearKernel |",
                "| chat | goodput_tokens_per_s | 120 tok/s [110 tok/s, 130 tok/s] |",
                "bf16 served twice by vLLM: tasks at concurrency 4, then 1",
                "| eval/mmlu_dev/acc | 0.004 [-0.01, 0.02] |",
                "| served/top1_agreement | 99.0% |",
            ],
            ["No serving workloads measured.", "Not served by an engine", "Not measured", "/n |", "kld_topk_p99"],
        ),
    ],
)
def test_the_card_says_what_ships_why_and_how_to_get_it_again(decided, chosen, floor, shown, absent):
    decision, runs = decided

    def logged(run, extra):
        return replace(
            run,
            metrics=run.metrics | extra.get("metrics", {}),
            params=run.params | extra.get("params", {}),
            tags=run.tags | extra.get("tags", {}),
        )

    card = release_card.build_card(
        decision,
        logged(runs["fp8"], chosen),
        model="tiny",
        version="3",
        alias="production",
        recipe_path="recipe.yaml",
        recipe_text=RECIPE,
        floor=logged(runs["bf16"], floor),
        commands=["quantlab sweep recipe.yaml", "quantlab pick --register"],
    )
    markdown = release_card.render_markdown(card)
    for line in shown:
        assert line in markdown, line
    for words in absent:
        assert words not in markdown, words
    assert markdown.index("Chosen: fp8") < markdown.index("## Identity") < markdown.index("## Verdicts")
    as_json = json.loads(card.to_json())
    assert as_json["checkpoint_hash"] == "content-fp8" and as_json["datasets"] == {"mmlu_dev": MMLU_DATA.digest}
    assert as_json["recipe_hash"] == RECIPE_HASH
    assert [v["variant"] for v in as_json["verdicts"]] == [v.name for v in decision.verdicts]


def test_each_finished_variant_is_a_logged_model_of_its_checkpoint_metrics_and_data_sets(store, tmp_path):
    parent = _logged_sweep(store, tmp_path)
    tracking.log_decision(store, parent, tags={}, verdicts={"fp8": "chosen"}, metrics={}, columns=[])
    runs = {run.variant: run for run in tracking.child_runs(store, parent)}
    models = {model["source_run_id"]: model for model in store.logged_models(runs["fp8"].experiment_id)}
    assert set(models) == {run.run_id for run in runs.values()}  # one each, made from its own run
    fp8 = models[runs["fp8"].run_id]
    assert fp8["model_id"] == runs["fp8"].tags[tracking.MODEL_ID]
    assert fp8["name"] == "fp8"
    assert fp8["tags"]["mlflow.model.isExternal"] == "true"  # its weights stay where the checkpoint lies
    assert fp8["tags"][tracking.CHECKPOINT] == str(tmp_path / "fp8")
    assert fp8["tags"][tracking.CONTENT_KEY] == "content-fp8"
    assert fp8["tags"][tracking.VERDICT] == "chosen"  # the Models tab compares the verdicts too
    linked = {key: (value, name, digest) for key, value, name, digest in fp8["metrics"]}
    assert linked[MMLU] == (runs["fp8"].metrics[MMLU], MMLU_DATA.name, MMLU_DATA.digest)
    assert linked["cost/weight_bytes"] == (170e6, None, None)


def test_a_copied_run_is_a_logged_model_of_its_own(store, tmp_path):
    parent = _logged_sweep(store, tmp_path)
    original = next(run for run in tracking.child_runs(store, parent) if run.variant == "fp8")
    experiment = original.experiment_id
    again = tracking.start_sweep(store, experiment, "sweep tiny", {})
    copy = tracking.start_variant(store, experiment, again, "fp8", "fp8", baseline=False, run_key="fp8")
    assert tracking.copy_run(store, original, copy) is None
    copied = store.run(copy)
    assert copied.tags[tracking.MODEL_ID] != original.tags[tracking.MODEL_ID]
    (model,) = [m for m in store.logged_models(experiment) if m["source_run_id"] == copy]
    assert model["tags"][tracking.CHECKPOINT] == original.tags[tracking.CHECKPOINT]
    assert (MMLU, original.metrics[MMLU], MMLU_DATA.name, MMLU_DATA.digest) in model["metrics"]


class NoModelsStore(MemoryStore):
    """A store whose server predates logged models: MLflow's client gets a 404 for the models API."""

    def create_external_model(self, *args, **kwargs) -> str:
        from mlflow.exceptions import MlflowException

        raise MlflowException("API request to endpoint /api/2.0/mlflow/logged-models failed with error code 404")


def test_a_store_without_logged_models_logs_the_variant_and_says_why_it_has_none(tmp_path):
    store = NoModelsStore()
    experiment = store.experiment_id("tiny")
    parent = tracking.start_sweep(store, experiment, "sweep tiny", {})
    run_id = tracking.start_variant(store, experiment, parent, "fp8", "fp8", baseline=False, run_key="k")
    why = tracking.log_variant(store, run_id, metrics={MMLU: 0.5}, params={}, tags={}, datasets=[MMLU_DATA], files={})
    assert why is not None and why.startswith("no logged model in the Models tab: the store refused one (API")
    run = store.run(run_id)
    assert run.status == "FINISHED" and run.metrics == {MMLU: 0.5} and tracking.MODEL_ID not in run.tags


@pytest.mark.parametrize("lines", [10, 400])
def test_a_long_card_is_cut_to_what_a_registry_keeps_with_its_json_link_whole(lines):
    markdown = "# tiny v1 (@production): fp8\n" + "".join(f"| row {n} | {'x' * 20} |\n" for n in range(lines))
    tail = "\nThe card as JSON: [release-cards/tiny-v1.json](#/experiments/1/runs/r/artifacts/x), on the sweep's run.\n"
    shown = tracking.run_description(markdown, "release-cards/tiny-v1.md", tail, limit=tracking.VERSION_DESCRIPTION)
    assert len(shown) <= tracking.VERSION_DESCRIPTION and shown.endswith(tail)
    assert shown.startswith("# tiny v1 (@production): fp8\n")
    cut = len(markdown) + len(tail) > tracking.VERSION_DESCRIPTION
    assert ("all of it is the artifact `release-cards/tiny-v1.md`" in shown) == cut
