"""The variants' load runs, round by round (serving.interleave): on CPU, with the local executor, each variant's server
waits, up and idle, until every variant of the sweep has scored; then each round runs every level once for each
variant in turn, the baseline first, and no variant's runs overlap another's; a variant done serving finishes once
every variant is. Set false, each variant's runs go back
to back in its own serve stage. Real sweeps: the tiny Llama as bf16 and fp8 behind transformers serve under guidellm's
real load, 2 levels x 2 repeats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from test_sweep import quantlab

from quantlab.serving.levels import load_levels
from quantlab.stages.serve import REPORT_ARTIFACT
from recipes import tiny_recipe, write

SERVING = {
    "prompt_tokens": 16,
    "output_tokens": 8,
    "concurrency": [1, 2],
    "requests_per_level": 2,
    "repeats": 2,
    "contention_retries": 0,  # a re-run would add runs this test does not expect; tests/test_serving_contended.py
    "slo": {"ttft_ms": 60_000, "itl_ms": 10_000},
}
ROUND_BY_ROUND = [("bf16", 1), ("bf16", 2), ("fp8", 1), ("fp8", 2)] * 2
BACK_TO_BACK = [("bf16", 1), ("bf16", 1), ("bf16", 2), ("bf16", 2), ("fp8", 1), ("fp8", 1), ("fp8", 2), ("fp8", 2)]


@pytest.mark.parametrize(("interleave", "order"), [(True, ROUND_BY_ROUND), (False, BACK_TO_BACK)])
def test_the_variants_serve_round_by_round_unless_told_otherwise(tmp_path, tiny_llama, interleave, order):
    recipe = tiny_recipe(
        tiny_llama.path,
        variants=[{"name": "bf16", "method": "bf16"}, {"name": "fp8", "method": "fp8"}],
        evals={"tasks": []},
        serving=SERVING | {"interleave": interleave},
    )
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    path = write(tmp_path / "recipe.yaml", recipe)
    done = quantlab("sweep", str(path), "--tracking-uri", uri, "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    client = MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "tiny"]
    runs = {
        r.data.tags["quantlab.variant"]: r
        for r in client.search_runs([experiment.experiment_id], "tags.`quantlab.role` = 'variant'")
    }
    windows = []  # every load run of the sweep: (start, end, variant, streams)
    for variant, run in runs.items():
        report = _report(client, run, tmp_path)
        for benchmark in report["benchmarks"]:
            streams = benchmark["config"]["strategy"]["streams"]
            windows.append((benchmark["start_time"], benchmark["end_time"], variant, streams))
        for level in ("c1", "c2"):  # every run logged, pooled per level
            assert run.data.metrics[f"cost/serving/{level}/runs"] == 2
        waited = run.data.metrics.get("time/wait to serve_seconds")
        assert (waited is not None and waited > 0) if interleave else waited is None
        # Interleaved, the decision's figures are logged round by round, in the order the runs went: the batch-1
        # decode rate is 1000 / each c1 run's ITL p50, the frontier pairs round n with another variant's round n
        rounds = {key: value for key, value in run.data.metrics.items() if "/round_" in key}
        single = [level for level in load_levels(report) if level.label == "c1"]
        decode = {f"cost/decode_tokens_per_s/round_{n}": 1000 / level.itl_ms_p50 for n, level in enumerate(single, 1)}
        assert {key: rounds[key] for key in decode if key in rounds} == (pytest.approx(decode) if interleave else {})
        goodput = {f"cost/serving/goodput_tokens_per_s/round_{n}" for n in (1, 2)}
        assert goodput <= rounds.keys() if interleave else not rounds
    windows.sort()
    assert [(variant, streams) for _, _, variant, streams in windows] == order
    assert all(later[0] >= earlier[1] for earlier, later in zip(windows, windows[1:]))  # one run at a time
    if interleave:  # the baseline waited while fp8 was quantized and scored: fp8's quality stages end before it serves
        fp8 = runs["fp8"].data.metrics
        assert runs["bf16"].data.metrics["time/wait to serve_seconds"] > fp8["time/quantize_seconds"]
        # bf16's last round came first, and it finished (figures, charts, server stopped, its run logged and ended)
        # only after fp8's last round: nothing of its finishing ran beside a timed round
        assert runs["bf16"].info.end_time / 1000 > windows[-1][1]


def _report(client: MlflowClient, run, tmp_path) -> dict:
    folder = tmp_path / "artifacts" / run.info.run_id
    folder.mkdir(parents=True)
    return json.loads(Path(client.download_artifacts(run.info.run_id, REPORT_ARTIFACT, str(folder))).read_text())
