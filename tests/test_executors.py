"""The in-process executor: the same outcomes and MLflow layout as the local (process per variant) one, in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from quantlab.checks import validate
from quantlab.executors import InProcessExecutor, VariantFailed, failure_reason
from quantlab.host_share import seats_dir
from quantlab.jobs import VariantResult
from quantlab.recipe import load_recipe
from quantlab.sweep import SweepOptions, run_sweep
from recipes import REPO, tiny_recipe, write


class RecordingDisplay:
    """A SweepDisplay that keeps what the sweep told it."""

    def __init__(self):
        self.stages: list[tuple[str, str, int]] = []  # variant, stage, pid of the process that reported it
        self.finished: dict[str, str | None] = {}

    def sweep_started(self, experiment, run_id, plan):
        pass

    def stage(self, variant, stage):
        self.stages.append((variant, stage, os.getpid()))

    def variant_finished(self, variant, result, failure, reused=""):
        self.finished[variant] = failure

    def note(self, variant, text):
        pass


@pytest.fixture(scope="module")
def two_sweeps(tmp_path_factory, tiny_llama):
    """One recipe swept by the local executor, the in-process one and the local one with two variants at a time
    (`parallel`), each into its own store and cache.

    bf16 and fp8 finish; `awq` calibrates on a text far too short, a real failure found only at
    run time (a BadInput raised inside run_variant), so it must fail alone under both executors.
    """
    work = tmp_path_factory.mktemp("executors")
    (work / "short.txt").write_text("Far too short to calibrate on.\n")
    recipe = tiny_recipe(
        tiny_llama.path,
        variants=[
            {"name": "bf16", "method": "bf16"},
            {"name": "fp8", "method": "fp8"},
            {"name": "awq", "method": "awq_int4", "params": {"group_size": 32}},
        ],
        calibration={"source": "short.txt", "num_samples": 4, "seq_len": 32},
        evals={
            "include_path": str(Path(__file__).resolve().parents[1] / "evals"),
            "batch_size": 4,
            "tasks": [{"name": "pydoc_cloze", "limit": 4}],
        },
        quality={"max_tokens": 64, "window": 32, "generate": {"enabled": False}},
        measure={
            "prompt_tokens": 8,
            "output_tokens": 2,
            "repeats": 1,
            "warmup": 0,
            "bandwidth_probe_bytes": 1 << 20,
            "bandwidth_probe_repeats": 1,
        },
    )
    loaded = validate(write(work / "recipe.yaml", recipe), work / "cache-check")
    swept = {}
    for label, executor, parallel in (("local", "local", 1), ("inprocess", "inprocess", 1), ("parallel", "local", 2)):
        uri = f"sqlite:///{work / label}.db"
        display = RecordingDisplay()
        options = SweepOptions(uri, work / f"cache-{label}", executor, parallel=parallel)
        swept[label] = (uri, run_sweep(loaded, options, display), display)
    return swept


def _layout(uri: str, parent_run_id: str) -> dict:
    """What the sweep logged, by variant: status, tag / metric / param keys, artifact paths."""
    client = MlflowClient(uri)
    experiment = client.get_run(parent_run_id).info.experiment_id
    runs = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    return {
        run.data.tags["quantlab.variant"]: {
            "status": run.info.status,
            "tags": {key for key in run.data.tags if key not in {"mlflow.runName"}},
            "metrics": set(run.data.metrics),
            "params": set(run.data.params),
            "artifacts": _artifact_paths(client, run.info.run_id),
        }
        for run in runs
    }


def _artifact_paths(client: MlflowClient, run_id: str, path: str = "") -> set[str]:
    found = set()
    for item in client.list_artifacts(run_id, path):
        found |= _artifact_paths(client, run_id, item.path) if item.is_dir else {item.path}
    return found


def test_in_process_sweep_logs_the_same_layout_as_the_local_executor(two_sweeps):
    (local_uri, local, _), (inproc_uri, inproc, _) = two_sweeps["local"], two_sweeps["inprocess"]
    assert local.failures.keys() == inproc.failures.keys() == {"awq"}
    assert local.exit_code == inproc.exit_code == 1
    expected = _layout(local_uri, local.parent_run_id)
    got = _layout(inproc_uri, inproc.parent_run_id)
    assert {name: run["status"] for name, run in got.items()} == {
        "bf16": "FINISHED",
        "fp8": "FINISHED",
        "awq": "FAILED",
    }
    for name, run in expected.items():
        assert got[name]["tags"] == run["tags"], name
        assert got[name]["metrics"] == run["metrics"], name
        assert got[name]["params"] == run["params"], name
        # The one documented difference: no variant log file in process.
        assert run["artifacts"] - got[name]["artifacts"] == {"logs/variant.log"}, name
        assert got[name]["artifacts"] <= run["artifacts"], name
    assert _artifact_paths(MlflowClient(inproc_uri), inproc.parent_run_id) == _artifact_paths(
        MlflowClient(local_uri), local.parent_run_id
    )


def _metrics(uri: str, parent_run_id: str) -> dict[str, dict[str, float]]:
    client = MlflowClient(uri)
    experiment = client.get_run(parent_run_id).info.experiment_id
    runs = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent_run_id}'")
    return {run.data.tags["quantlab.variant"]: run.data.metrics for run in runs}


def test_in_process_figures_match_the_local_ones(two_sweeps):
    """Same checkpoints, same data: the figures that do not depend on timing agree."""
    (local_uri, local, _), (inproc_uri, inproc, _) = two_sweeps["local"], two_sweeps["inprocess"]
    expected, got = _metrics(local_uri, local.parent_run_id), _metrics(inproc_uri, inproc.parent_run_id)
    for name in ("bf16", "fp8"):
        for key in ("cost/weight_bytes", "cost/bits_per_weight", "eval/pydoc_cloze/acc"):
            assert got[name][key] == expected[name][key], (name, key)
    assert got["fp8"]["quality/ppl"] == pytest.approx(expected["fp8"]["quality/ppl"], rel=1e-4)
    assert got["fp8"]["cost/weight_bytes"] < got["bf16"]["cost/weight_bytes"]


def test_in_process_variant_that_raises_fails_alone_with_its_traceback(two_sweeps):
    uri, outcome, display = two_sweeps["inprocess"]
    assert outcome.finished == ["bf16", "fp8"]
    assert display.finished == {"bf16": None, "fp8": None, "awq": outcome.failures["awq"]}
    assert "calibration.num_samples" in outcome.failures["awq"]
    client = MlflowClient(uri)
    runs = client.search_runs([outcome.experiment_id], "tags.`quantlab.variant` = 'awq'")
    assert runs[0].data.tags["quantlab.failure"] == outcome.failures["awq"]
    text = Path(client.download_artifacts(runs[0].info.run_id, "failure/traceback.txt")).read_text()
    assert "Traceback" in text and "calibration_dataset" in text


def test_an_in_process_sweep_holds_a_seat_on_the_host_only_while_a_variant_runs(two_sweeps):
    """Its variants shared the host's cores like any local variant; the sweep's process lives on afterwards
    (here: pytest), and must not keep counting as a variant for the others."""
    uri, outcome, _ = two_sweeps["inprocess"]
    run = MlflowClient(uri).search_runs([outcome.experiment_id], "tags.`quantlab.variant` = 'bf16'")[0]
    assert run.data.params["runtime.threads_from"].endswith("on this host")
    assert not list(seats_dir().glob(f"*-{os.getpid()}.seat"))


def test_parallel_local_variants_run_side_by_side_with_the_same_outcomes(two_sweeps):
    """After the baseline, fp8 and awq start together: awq starts before fp8 reaches its last stage, fails
    alone as it does one at a time, and fp8's deterministic figures equal the one-at-a-time sweep's."""
    (uri, outcome, display), (local_uri, local, _) = two_sweeps["parallel"], two_sweeps["local"]
    assert outcome.finished == ["bf16", "fp8"]
    assert outcome.failures.keys() == {"awq"} and "calibration.num_samples" in outcome.failures["awq"]
    stages = [(variant, stage) for variant, stage, _ in display.stages]
    assert stages.index(("awq", "prepare model")) < stages.index(("fp8", "measure"))
    assert max(i for i, (variant, _) in enumerate(stages) if variant == "bf16") < stages.index(("fp8", "prepare model"))
    got, expected = (_metrics(u, o.parent_run_id) for u, o in ((uri, outcome), (local_uri, local)))
    for key in ("cost/weight_bytes", "cost/bits_per_weight", "eval/pydoc_cloze/acc"):
        assert got["fp8"][key] == expected["fp8"][key], key
    # One torch thread each side by side, two one at a time: float sums in another order.
    assert got["fp8"]["quality/ppl"] == pytest.approx(expected["fp8"]["quality/ppl"], rel=1e-4)


def test_in_process_stages_are_reported_from_this_process(two_sweeps):
    _, _, display = two_sweeps["inprocess"]
    assert {pid for _, _, pid in display.stages} == {os.getpid()}
    stages = [(variant, stage) for variant, stage, _ in display.stages]
    for name in ("bf16", "fp8"):
        assert [stage for variant, stage in stages if variant == name][:3] == ["prepare model", "quantize", "load"]
    assert ("awq", "quantize") in stages  # where it failed


class _Job:
    def __init__(self, variant):
        self.variant = variant


def test_a_keyboard_interrupt_is_not_a_variant_failure(monkeypatch, tmp_path):
    """An exception fails its variant; Ctrl-C ends the sweep (which marks its runs KILLED)."""

    def run_variant(job, report, host):
        report("quantize")
        if job.variant == "interrupted":
            raise KeyboardInterrupt
        raise RuntimeError(f"{job.variant} broke")

    monkeypatch.setattr("quantlab.executors.run_variant", run_variant)
    seen = []
    outcomes = InProcessExecutor().run(
        [_Job("broken"), _Job("interrupted"), _Job("never")],
        tmp_path,
        lambda variant, stage: seen.append((variant, stage)),
    )
    _, failed, log_path = next(outcomes)
    assert isinstance(failed, VariantFailed) and not isinstance(failed, VariantResult)
    assert failed.reason == "RuntimeError: broken broke" and "Traceback" in failed.details
    assert log_path == tmp_path / "broken.log" and not log_path.exists()
    with pytest.raises(KeyboardInterrupt):
        next(outcomes)
    assert seen == [("broken", "quantize"), ("interrupted", "quantize")]


def _refuse_to_load() -> None:
    raise RuntimeError("this job cannot be rebuilt in the variant's process")


class _UnloadableJob:
    """A job the variant process cannot unpickle, with a payload larger than a pipe's buffer: a real
    unpickling failure in a real spawned child (the kind a half-upgraded install produces)."""

    variant = "unloadable"

    def __init__(self) -> None:
        self.loaded = load_recipe(REPO / "recipes" / "smollm2-135m.yaml")  # what the executor preloads for
        self.payload = os.urandom(1 << 20)

    def __reduce__(self):
        # Loading fails before the payload (pickled after it, as state) has been read.
        return (_refuse_to_load, (), self.payload)


def test_a_variant_process_that_cannot_read_its_job_fails_alone_instead_of_hanging(tmp_path):
    """Passed to the child as a spawn argument, this hangs the sweep for good (Process.start()
    blocks writing into a pipe nobody reads any more): the job travels through a file instead."""
    import signal

    from quantlab.executors import run_local

    def hung(signum, frame):
        raise TimeoutError("run_local hung on a variant process that died reading its job")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        with pytest.raises(VariantFailed) as failed:
            run_local(_UnloadableJob(), tmp_path / "unloadable.log", lambda variant, stage: None)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert "this job cannot be rebuilt" in failed.value.reason


_ORPHAN_SCRIPT = """
import multiprocessing, sys, time
from quantlab import executors

def variant():
    executors._bind_to_sweep("quantlab-orphan")
    time.sleep(120)

if __name__ == "__main__":
    process = multiprocessing.get_context("forkserver").Process(target=variant)
    process.start()
    print(process.pid, flush=True)
    time.sleep(120)
"""


def test_a_forked_variant_process_dies_with_its_sweep(tmp_path):
    """A variant forked by the fork server is the server's child, not the sweep's, and keeps the server
    alive: neither the kernel's parent-death signal nor the server's own exit ends it when the sweep is
    SIGKILLed. Its watch on the sweep's end of a pipe must (a sleeping variant cannot end on its own)."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    script = write(tmp_path / "sweep.py", _ORPHAN_SCRIPT)
    sweep = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        variant = psutil.Process(int(sweep.stdout.readline()))
        time.sleep(1)  # past _bind_to_sweep
        assert variant.is_running()
        sweep.send_signal(signal.SIGKILL)
        sweep.wait(timeout=30)
        try:
            variant.wait(timeout=10)
        except psutil.TimeoutExpired:
            variant.kill()
            pytest.fail("the variant process outlived its SIGKILLed sweep")
    finally:
        sweep.kill()


def test_one_fork_server_per_sweep_replaced_when_the_environment_changes(tmp_path, monkeypatch):
    """The sweep starts its fork server while the recipe is checked and every variant forks from that
    one; a sweep under other variables (or other needs) gets a new one; bad input ends it at once."""
    from multiprocessing import forkserver

    import psutil

    from quantlab.executors import SET_BY_IMPORTS, start_variant_processes, stop_variant_processes

    def server() -> int | None:
        return forkserver._forkserver._forkserver_pid

    recipe = tiny_recipe(tmp_path, variants=[{"name": "bf16", "method": "bf16"}], evals={"tasks": []})
    loaded = load_recipe(write(tmp_path / "recipe.yaml", recipe))
    try:
        start_variant_processes(loaded)
        first = server()
        start_variant_processes(loaded)
        assert server() == first
        monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///elsewhere.db")  # the sweep's own: not the variant's
        start_variant_processes(loaded)
        assert server() == first
        monkeypatch.delenv("_MLFLOW_TELEMETRY_SESSION_ID", raising=False)  # as importing MLflow does, telemetry off
        start_variant_processes(loaded)
        assert server() == first
        for variable in SET_BY_IMPORTS:  # as checking the recipe sets them, importing transformers (and sklearn)
            monkeypatch.setenv(variable, "set by an import")
        start_variant_processes(loaded)
        assert server() == first
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        start_variant_processes(loaded)
        assert server() not in (None, first)
        assert not psutil.pid_exists(first)
    finally:
        replaced = server()
        stop_variant_processes()
    assert server() is None
    assert not psutil.pid_exists(replaced)


def test_the_variables_the_preloaded_imports_set_are_the_ones_the_fork_server_ignores():
    """What importing the fork server's libraries adds to a fresh interpreter's environment, as checking a recipe
    does after the server started: a variable outside SET_BY_IMPORTS would start every such sweep's server twice."""
    from quantlab.executors import SET_BY_IMPORTS

    code = (
        "import importlib, json, os; before = dict(os.environ); from quantlab import preload; "
        "[importlib.import_module(name) for name in preload.EVERY_VARIANT + preload.FOR_TASKS + preload.FOR_QUANTIZING]; "
        "print(json.dumps(sorted(k for k, v in os.environ.items() if before.get(k) != v)))"
    )
    clean = {k: v for k, v in os.environ.items() if k not in SET_BY_IMPORTS}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=clean, check=True)
    added = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert added and added <= SET_BY_IMPORTS, added


def test_a_failed_baseline_leaves_the_variants_to_compute_not_run_saying_why(tmp_path, tiny_llama):
    """Nothing to compare against: fp8 is not run (a FAILED run that says why, which the next sweep computes), not
    compared against itself and logged as if quantizing had cost nothing."""
    (tmp_path / "short.txt").write_text("Far too short to calibrate on.\n")
    recipe = tiny_recipe(
        tiny_llama.path,
        baseline="awq",
        variants=[
            {"name": "awq", "method": "awq_int4", "params": {"group_size": 32}},
            {"name": "fp8", "method": "fp8"},
        ],
        calibration={"source": "short.txt", "num_samples": 4, "seq_len": 32},
        evals={"tasks": []},
        quality={"enabled": False},
    )
    loaded = validate(write(tmp_path / "recipe.yaml", recipe), tmp_path / "cache")
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    display = RecordingDisplay()
    outcome = run_sweep(loaded, SweepOptions(uri, tmp_path / "cache", "inprocess"), display)

    assert outcome.exit_code == 1 and outcome.finished == [] and not outcome.unlogged
    assert "calibration.num_samples" in outcome.failures["awq"]
    assert outcome.failures["fp8"].startswith("not run: the baseline awq failed, and every variant is compared against")
    assert display.finished["fp8"] == outcome.failures["fp8"]
    assert not [stage for variant, stage, _ in display.stages if variant == "fp8"]  # it never started
    run = MlflowClient(uri).search_runs([outcome.experiment_id], "tags.`quantlab.variant` = 'fp8'")[0]
    assert run.info.status == "FAILED" and run.data.tags["quantlab.failure"] == outcome.failures["fp8"]


@pytest.mark.parametrize("in_a_variant", [False, True])
def test_a_variant_starts_no_tqdm_monitor_thread(in_a_variant):
    """A progress bar starts tqdm's monitor thread, except in a variant process (each thread start there is a
    chance to hang on CPython 3.11 when memory runs out: quantlab.executors._no_progress_monitor). A fresh
    interpreter, so that no other test's tqdm settings count."""
    script = (
        "import threading, time\n"
        "from tqdm.auto import tqdm\n"
        "from quantlab.executors import _no_progress_monitor\n"
        f"if {in_a_variant}: _no_progress_monitor()\n"
        "bar = tqdm(total=2)\n"
        "bar.update(1)\n"
        "print(sorted(thread.name for thread in threading.enumerate()))\n"
        "bar.close()\n"
    )
    shown = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert ("tqdm_monitor" in shown.stdout) is not in_a_variant, shown.stdout


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (ValueError("bad shape"), "ValueError: bad shape"),
        (RuntimeError(), "RuntimeError"),  # no message: no dangling colon
        (MemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "MemoryError: CUDA out of memory. Tried to"),
        (MemoryError(), "MemoryError: the variant's process ran out of memory (see failure/traceback.txt for where)"),
    ],
)
def test_a_failure_reason_is_one_readable_line(error, reason):
    """What the sweep prints and tags for a failed variant. A bare MemoryError (CPython's own, where an allocation
    failed: the starved variant of tests/test_resilience.py) says what happened, not just its type."""
    assert failure_reason(error).startswith(reason)
