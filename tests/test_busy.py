"""Honest under load: each variant's thread share, the measure stage's contention verdict, and the warnings
the report and `quantlab pick` give when a variant's speed was timed while other work competed for its cores."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import yaml
from mlflow.tracking import MlflowClient
from test_sweep import quantlab

from quantlab import host_share, tracking
from quantlab.decision import cost_warnings, pick
from quantlab.errors import BadInput
from quantlab.executors import LocalExecutor
from quantlab.frontier import Axis, VariantSummary
from quantlab.host_share import SEATS_ENV, THREADS_ENV, HostShare, Seats, local_share, thread_share
from quantlab.measure.contention import (
    CONTENDED_TAG,
    CONTENTION_TAG,
    LoadMonitor,
    LoadReading,
    combined,
    judge_contention,
)
from quantlab.metrics import spec
from quantlab.policy import Policy
from recipes import tiny_recipe, write

# --- The thread share -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cores", "concurrent", "ray_cpus", "override", "threads", "source"),
    [
        pytest.param(8, 1, None, None, 8, "8 visible cores / 1 variant at a time", id="local-alone"),
        pytest.param(8, 3, None, None, 2, "8 visible cores / 3 variants at a time", id="local-three-at-once"),
        pytest.param(2, 3, None, None, 1, "2 visible cores / 3 variants at a time", id="never-below-one"),
        pytest.param(16, 1, 4.0, None, 4, "runtime.cpus=4", id="ray-reserved-cpus"),
        pytest.param(16, 1, 0.5, None, 1, "runtime.cpus=0.5", id="ray-fraction-of-a-cpu"),
        pytest.param(16, 1, 2.9, None, 2, "runtime.cpus=2.9", id="ray-whole-cpus-only"),
        pytest.param(8, 1, 4.0, "3", 3, "QUANTLAB_THREADS=3", id="override-beats-ray"),
        pytest.param(8, 3, None, " 6 ", 6, "QUANTLAB_THREADS=6", id="override-beats-local"),
        pytest.param(8, 1, None, "", 8, "8 visible cores", id="empty-override-is-unset"),
    ],
)
def test_thread_share(cores, concurrent, ray_cpus, override, threads, source):
    share = thread_share(cores, concurrent, ray_cpus, override)
    assert share.threads == threads
    assert share.source.startswith(source)


@pytest.mark.parametrize("override", ["0", "-2", "two", "1.5"])
def test_a_bad_thread_override_is_bad_input_before_any_variant_starts(monkeypatch, tmp_path, override):
    with pytest.raises(BadInput, match=THREADS_ENV):
        thread_share(4, override=override)
    monkeypatch.setenv(THREADS_ENV, override)
    with pytest.raises(BadInput, match="whole number"):
        next(LocalExecutor().run([], tmp_path, lambda variant, stage: None))


def test_local_share_reads_the_override(monkeypatch):
    monkeypatch.setenv(THREADS_ENV, "3")
    assert local_share().threads == 3
    monkeypatch.delenv(THREADS_ENV)
    assert local_share().threads == len(os.sched_getaffinity(0))


# --- Sharing the host with other sweeps: seats ----------------------------------------------------------------

# A process that takes a seat in the folder given, says so, and holds it until its stdin closes or it is killed.
SEAT_HOLDER = """
import sys
from pathlib import Path
from quantlab.host_share import Seats
Seats(Path(sys.argv[1])).take()
print("seated", flush=True)
sys.stdin.read()
"""


def hold_seat(directory):
    holder = subprocess.Popen(
        [sys.executable, "-c", SEAT_HOLDER, str(directory)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline().strip() == "seated"
    return holder


def test_seats_count_the_variant_processes_alive_on_the_host(tmp_path):
    """Real processes: each seat held counts, a killed holder's seat frees itself (and its file goes)."""
    seats = Seats(tmp_path)
    assert seats.live() == 1  # nobody yet: the caller counts as one
    holders = [hold_seat(tmp_path) for _ in range(2)]
    try:
        assert seats.live() == 2
        seats.take()
        assert seats.live() == 3
        holders[0].kill()
        holders[0].wait()
        assert seats.live() == 2
        assert len(list(tmp_path.glob("*.seat"))) == 2
        seats.leave()
        assert seats.live() == 1
        assert len(list(tmp_path.glob("*.seat"))) == 1  # its own file goes as it leaves
    finally:
        for holder in holders:
            holder.kill()
            holder.wait()


@pytest.mark.parametrize(
    ("others", "cores", "threads", "source"),
    [
        (0, 2, 2, "2 visible cores, no other quantlab variant on this host"),
        (1, 2, 1, "2 visible cores / 2 quantlab variants on this host"),
        (2, 2, 1, "2 visible cores / 3 quantlab variants on this host"),
    ],
)
def test_the_local_share_divides_the_cores_by_the_seats(tmp_path, monkeypatch, others, cores, threads, source):
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setattr(host_share, "visible_cores", lambda: cores)
    holders = [hold_seat(tmp_path) for _ in range(others)]
    seat = Seats(tmp_path).take()
    try:
        share = local_share(seats=seat)
    finally:
        seat.leave()
        for holder in holders:
            holder.kill()
            holder.wait()
    assert (share.threads, share.source) == (threads, source)


# A variant's process in miniature: its host share, the tiny model loaded and followed the way the runner loads and
# follows it, and a forward pass per line read, answering with torch's threads after it.
FOLLOWER = """
import contextlib, sys
from pathlib import Path
import torch
from quantlab.host_share import HostShare
from quantlab.models import load_checkpoint
host = HostShare.seated()
print(host.share.threads, flush=True)
model, _ = load_checkpoint(Path(sys.argv[1]), torch.float32, "cpu")
host.follow(model)
for line in sys.stdin:
    timed = line.strip() == "timed"  # "timed": the pass runs inside the variant's own timed stage
    with host.timing() if timed else contextlib.nullcontext():
        model(torch.tensor([[1, 2, 3]]))
        print(torch.get_num_threads(), flush=True)
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="dividing the cores needs at least two")
def test_a_running_variant_gives_cores_back_while_another_runs(tmp_path, monkeypatch, tiny_llama):
    """A variant alone takes every core; when another variant takes a seat it drops to its share at its next
    forward pass (but not inside its own timed stage: what is timed runs with one count), and takes them back once
    it has gone."""
    cores = len(os.sched_getaffinity(0))
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setenv(SEATS_ENV, str(tmp_path / "seats"))
    variant = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, str(tiny_llama.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def threads_after_a_forward_pass(line="forward") -> int:
        time.sleep(host_share.RECOUNT_SECONDS + 0.2)
        variant.stdin.write(line + "\n")
        variant.stdin.flush()
        return int(variant.stdout.readline())

    try:
        assert int(variant.stdout.readline()) == cores
        assert threads_after_a_forward_pass() == cores
        other = hold_seat(tmp_path / "seats")
        assert threads_after_a_forward_pass("timed") == cores
        assert threads_after_a_forward_pass() == cores // 2
        other.kill()
        other.wait()
        assert threads_after_a_forward_pass() == cores
    finally:
        variant.kill()
        variant.wait()


# A timed stage in miniature: a seat, then the host's timing lock held until stdin closes.
TIMER = """
import sys
from quantlab.host_share import HostShare
with HostShare.seated().timing():
    print("timing", flush=True)
    sys.stdin.read()
"""


def test_a_variant_pauses_at_its_forward_passes_while_another_times(tmp_path, monkeypatch, tiny_llama):
    """While one variant's measure stage holds the timing lock, another's forward pass waits; it goes on
    once the timing is done. Real processes, real flock."""
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setenv(SEATS_ENV, str(tmp_path / "seats"))
    variant = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, str(tiny_llama.path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    timer = None
    try:
        variant.stdout.readline()  # seated
        variant.stdin.write("forward\n")
        variant.stdin.flush()
        variant.stdout.readline()  # loaded, and one forward pass done: the next one can only wait for the lock
        timer = subprocess.Popen(
            [sys.executable, "-c", TIMER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert timer.stdout.readline().strip() == "timing"
        variant.stdin.write("forward\n")
        variant.stdin.flush()
        ready = select.select([variant.stdout], [], [], 3.0)[0]
        assert not ready, "the forward pass ran while another variant was timing"
        timer.stdin.close()  # the timing ends
        timer.wait(timeout=30)
        assert select.select([variant.stdout], [], [], 30.0)[0], "the forward pass never resumed"
        assert int(variant.stdout.readline()) >= 1
    finally:
        for process in (variant, timer):
            if process is not None:
                process.kill()
                process.wait()


def test_a_timer_stuck_on_the_lock_does_not_stop_the_others_for_ever(tmp_path, monkeypatch, caplog):
    """Past TIMING_WAIT_SECONDS a variant goes on, says so once, and stops waiting for that lock."""
    monkeypatch.delenv(THREADS_ENV, raising=False)
    monkeypatch.setenv(SEATS_ENV, str(tmp_path))
    monkeypatch.setattr(host_share, "TIMING_WAIT_SECONDS", 1.0)
    host = HostShare(seats=Seats(tmp_path))  # a variant of this host, seated beside the stuck timer
    timer = subprocess.Popen([sys.executable, "-c", TIMER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert timer.stdout.readline().strip() == "timing"
        started = time.monotonic()
        host._wait_while_another_variant_times()
        assert 1.0 <= time.monotonic() - started < 10
        assert "going on without it from now on" in caplog.text
        started = time.monotonic()
        host._wait_while_another_variant_times()
        assert time.monotonic() - started < 0.5
        # A timed stage of its own does not wait for the stuck one either.
        started = time.monotonic()
        with host.timing():
            pass
        assert time.monotonic() - started < 0.5
    finally:
        timer.kill()
        timer.wait()


# --- Contention: the verdict ------------------------------------------------------------------------------


def reading(**fields) -> LoadReading:
    """A quiet 2-core machine, 2 threads timed for 10 s, unless told otherwise."""
    quiet = dict(
        threads=2,
        cores=2,
        machine_cpus=2,
        load_before=2.1,
        load_after=2.0,
        wall_seconds=10.0,
        cpu_seconds=19.0,
        cores_busy_seconds=19.8,
    )
    return LoadReading(**(quiet | fields))


@pytest.mark.parametrize(
    ("fields", "contended", "words"),
    [
        pytest.param({}, False, "other processes kept 0.08 of its 2 cores", id="quiet"),
        # Two other sweeps on the same 2 cores: this one got under half of them.
        pytest.param(
            {"cpu_seconds": 7.0, "cores_busy_seconds": 20.0, "load_before": 6.2, "load_after": 6.5},
            True,
            "other processes kept 1.30 of its 2 cores",
            id="three-sweeps-on-two-cores",
        ),
        # Other work on the cores while the load average still remembers the quiet minute before.
        pytest.param(
            {"cpu_seconds": 12.0, "cores_busy_seconds": 20.0},
            True,
            "other processes kept 0.80",
            id="cpu-time-alone-suffices",
        ),
        pytest.param({"cpu_seconds": 14.0, "cores_busy_seconds": 19.0}, False, "kept 0.50", id="just-under-the-margin"),
        # The load average alone (no per-CPU times here): 3.2 others on 2 CPUs.
        pytest.param(
            {"cores_busy_seconds": None, "load_before": 5.2, "load_after": 4.0},
            True,
            "3.20 runnable threads besides its 2",
            id="load-alone-suffices",
        ),
        pytest.param(
            {"cores_busy_seconds": None, "load_before": 2.9, "load_after": 2.5},
            False,
            "0.90 runnable threads besides its 2 (limit 1.00)",
            id="load-within-the-margin",
        ),
        # 8 threads of 64 cores: 50 cores busy with other work still leave this one's alone.
        pytest.param(
            {
                "threads": 8,
                "cores": 64,
                "machine_cpus": 64,
                "cpu_seconds": 78.0,
                "cores_busy_seconds": 578.0,
                "load_before": 58.0,
                "load_after": 58.0,
            },
            False,
            "other processes kept 50.00 of its 64 cores",
            id="spare-cores-absorb-other-work",
        ),
        pytest.param(
            {
                "threads": 64,
                "cores": 64,
                "machine_cpus": 64,
                "cpu_seconds": 400.0,
                "cores_busy_seconds": 600.0,
                "load_before": 70.0,
                "load_after": 70.0,
            },
            True,
            "other processes kept 20.00 of its 64 cores",
            id="every-core-taken-on-a-big-machine",
        ),
        # Its own 8 threads on 2 cores (QUANTLAB_THREADS set too high) are not other work.
        pytest.param(
            {"threads": 8, "load_before": 8.1, "load_after": 8.3, "cpu_seconds": 19.5, "cores_busy_seconds": 19.9},
            False,
            "0.30 runnable threads besides its 8",
            id="own-oversubscription-is-not-contention",
        ),
        # A container pinned to 2 of a busy host's 64 CPUs: the host's load is not this variant's.
        pytest.param(
            {"machine_cpus": 64, "load_before": 40.0, "load_after": 40.0},
            False,
            "40.00 on 64 CPUs",
            id="busy-host-quiet-cores",
        ),
        # 0.1 s windows: the counters' 10 ms ticks cannot tell 0.6 cores of others from none.
        pytest.param(
            {"wall_seconds": 0.1, "cpu_seconds": 0.14, "cores_busy_seconds": 0.2},
            False,
            "(2 threads; limit 1.10)",
            id="too-short-to-tell",
        ),
    ],
)
def test_contention_verdict(fields, contended, words):
    verdict = judge_contention(reading(**fields))
    assert verdict.contended is contended, verdict.reason
    assert verdict.reason.startswith("contended: " if contended else "not contended: ")
    assert words in verdict.reason


def test_reading_metrics_are_the_logged_keys():
    metrics = reading(cpu_seconds=15.0, cores_busy_seconds=19.0, load_before=2.5).to_metrics()
    assert metrics == pytest.approx(
        {
            "measure/load_1m": 2.5,
            "measure/cpu_seconds_per_wall_second": 1.5,
            "measure/threads": 2.0,
            "measure/other_cores_busy": 0.4,
        }
    )
    assert "measure/other_cores_busy" not in reading(cores_busy_seconds=None).to_metrics()


def test_the_monitor_counts_this_process_within_its_cores():
    """Busy time on this process's cores includes this process's own CPU time (every process's counts)."""
    with LoadMonitor(threads=1) as monitor:
        deadline = time.perf_counter() + 0.5
        while time.perf_counter() < deadline:
            pass
    found = monitor.reading
    assert found.wall_seconds >= 0.5 and found.cores == len(os.sched_getaffinity(0))
    assert 0 < found.cpu_seconds <= found.wall_seconds + 0.05
    assert found.cores_busy_seconds is not None and found.cores_busy_seconds >= found.cpu_seconds - 0.05
    assert found.load_before >= 0 and found.load_after >= 0


def test_a_monitored_tree_counts_its_child_processes_as_its_own_work():
    """The serve stage's timing runs in the server and guidellm, children of the variant's process: as a tree their
    CPU time is the stage's own (while alive, and once reaped), not other work on its cores."""
    busy = [sys.executable, "-c", "import time\nwhile time.process_time() < 0.6: pass"]  # 0.6 CPU s, however busy
    with LoadMonitor(threads=1, tree=True) as tree, LoadMonitor(threads=1) as alone:
        alive = subprocess.Popen(busy)
        subprocess.run(busy, check=True)  # ends, and is reaped, inside the window
        alive.wait()
    assert tree.reading.cpu_seconds >= 1.0, tree.reading  # both children's ~0.6 s each
    assert alone.reading.cpu_seconds < 0.3, alone.reading  # this process only waited


@pytest.mark.parametrize(
    ("key", "timing"),
    [
        ("cost/decode_tokens_per_s", True),
        ("cost/ttft_ms_p99_bs8", True),
        ("cost/itl_ms_p50", True),
        ("cost/roofline_efficiency", True),
        ("time/evaluate_seconds", True),
        ("cost/weight_bytes", False),
        ("cost/peak_memory_bytes", False),
        ("cost/roofline_decode_tokens_per_s", False),  # modeled on the target, not timed here
        ("eval/mmlu_dev/acc", False),
        ("cost/load_seconds", True),
        ("cost/measured_bandwidth_bytes_per_s", True),
        # Served under load, against the clock (issue 28, item 11: the old pattern named none of them).
        ("cost/serving/usd_per_mtok", True),
        ("cost/serving/goodput_tokens_per_s", True),
        ("cost/serving/c4/ttft_ms_p99", True),
        ("cost/serving/sync/requests_per_s", True),
        ("measure/load_1m", False),  # a fact about the machine while timing, not a timing
        ("quality/ppl", False),
    ],
)
def test_which_figures_contention_distorts(key, timing):
    """A column of the metric contract: whether other work on the variant's cores distorts a figure."""
    assert spec(key).timed is timing


# --- A real variant process sizes its threads --------------------------------------------------------------


def test_a_variant_process_runs_with_the_threads_it_was_given(tmp_path, tiny_llama):
    """QUANTLAB_THREADS=1 reaches the forked variant's torch: logged as its param and as the threads it timed with."""
    recipe = tiny_recipe(
        tiny_llama.path,
        name="threads",
        variants=[{"name": "bf16", "method": "bf16"}],
        evals={"tasks": []},
        quality={"enabled": False},
        measure={
            "prompt_tokens": 8,
            "output_tokens": 4,
            "repeats": 2,
            "warmup": 0,
            "bandwidth_probe_bytes": 1 << 20,
            "bandwidth_probe_repeats": 1,
        },
    )
    path = write(tmp_path / "recipe.yaml", recipe)
    uri = f"sqlite:///{tmp_path / 'store.db'}"
    result = quantlab(
        "sweep", str(path), "--tracking-uri", uri, "--cache-dir", str(tmp_path / "cache"), cwd=tmp_path,
        env={THREADS_ENV: "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("threads")
    (run,) = client.search_runs([experiment.experiment_id], "tags.`quantlab.role` = 'variant'")
    assert run.data.params["runtime.threads"] == "1"
    assert run.data.params["runtime.threads_from"] == "QUANTLAB_THREADS=1"
    assert run.data.metrics["measure/threads"] == 1
    assert run.data.metrics["measure/load_1m"] >= 0 and run.data.metrics["measure/cpu_seconds_per_wall_second"] > 0
    assert run.data.tags[CONTENDED_TAG] in {"true", "false"}
    assert run.data.tags[CONTENTION_TAG].startswith(("contended: ", "not contended: "))
    assert "1 torch threads" in run.data.tags["quantlab.cost.host_load"]


# --- The report and `quantlab pick` warn ------------------------------------------------------------------


def _summary(name: str, tag: str | None, succeeded: bool = True) -> VariantSummary:
    tags = (
        {}
        if tag is None
        else {CONTENDED_TAG: tag, CONTENTION_TAG: f"{'contended' if tag == 'true' else 'not contended'}: load 5.00"}
    )
    return VariantSummary(name, "fp8", succeeded, {"cost/weight_bytes": 1.0}, tags)


@pytest.mark.parametrize(
    ("variants", "rests_on", "expected"),
    [
        pytest.param([_summary("a", "false"), _summary("b", None)], ["cost/ttft_ms_p99"], (), id="none-contended"),
        pytest.param([_summary("a", "true", succeeded=False)], [], (), id="a-failed-run-has-no-speed-figures"),
        pytest.param(
            [_summary("a", "true"), _summary("b", "false")],
            ["cost/weight_bytes", "quality/kld_mean"],
            (
                "a: speed figures measured while other work competed for its cores (load 5.00)",
                "rerun the sweep with --force on a quiet machine before a release rests on these speed figures",
            ),
            id="sizes-decide",
        ),
        pytest.param(
            [_summary("a", "true"), _summary("b", "true")],
            ["cost/weight_bytes", "cost/ttft_ms_p99", "cost/ttft_ms_p99"],
            (
                "the decision rests on cost/ttft_ms_p99, timed under contention for a, b: rerun the sweep with "
                "--force on a quiet machine before a release rests on this choice",
                "a: speed figures measured while other work competed for its cores (load 5.00)",
                "b: speed figures measured while other work competed for its cores (load 5.00)",
            ),
            id="a-timing-bound-decides",
        ),
        pytest.param(
            [_summary("a", "true"), _summary("b", "false")],
            ["cost/serving/usd_per_mtok"],
            (
                "the decision rests on cost/serving/usd_per_mtok, timed under contention for a: rerun the sweep with "
                "--force on a quiet machine before a release rests on this choice",
                "a: speed figures measured while other work competed for its cores (load 5.00)",
            ),
            id="a-served-figure-decides",
        ),
    ],
)
def test_cost_warnings(variants, rests_on, expected):
    assert cost_warnings(variants, rests_on) == expected


def test_pick_carries_a_warning_for_a_timing_bound():
    variants = [_summary("bf16", "false"), _summary("fp8", "true")]
    variants = [
        replace(v, metrics={**v.metrics, "cost/ttft_ms_p99": 50.0}, is_baseline=v.name == "bf16") for v in variants
    ]
    policy = Policy(max_drop_any_task=None, at_most={"cost/ttft_ms_p99": 100.0})
    decision = pick(variants, "bf16", policy, Axis.of("cost/weight_bytes"))
    assert decision.warnings[0].startswith("the decision rests on cost/ttft_ms_p99, timed under contention for fp8")
    assert decision.to_dict()["warnings"] == list(decision.warnings)


REASON = (
    "contended: other processes kept 1.30 of its 2 cores busy while it was timed (2 threads; limit 0.52); "
    "1-minute load average 6.50 on 2 CPUs, 4.50 runnable threads besides its 2 (limit 1.00)"
)


def _store(work, contended: dict[str, bool]) -> str:
    """A sweep of three variants in a real SQLite store, each logged with whether its timing was contended."""
    uri = f"sqlite:///{work / 'store.db'}"
    store = tracking.open_store(uri)
    experiment = store.experiment_id("busy")
    parent = store.start_run(experiment, "sweep busy", {tracking.ROLE: "sweep"})
    store.log_files(parent, {"recipe.yaml": yaml.safe_dump({"name": "busy", "baseline": "bf16"})})
    figures = {"bf16": (270e6, 30.0), "fp8": (170e6, 25.0), "int4": (90e6, 20.0)}
    for name, (size, speed) in figures.items():
        tags = {
            tracking.ROLE: "variant",
            tracking.VARIANT: name,
            tracking.METHOD: name,
            tracking.CHECKPOINT: str(work / name),
            "quantlab.baseline": str(name == "bf16").lower(),
        }
        if name in contended:
            verdict = REASON if contended[name] else "not contended: other processes kept 0.05 of its 2 cores"
            tags |= {CONTENDED_TAG: str(contended[name]).lower(), CONTENTION_TAG: verdict}
        run = store.start_run(experiment, name, tags, parent=parent)
        store.log_values(run, {"cost/weight_bytes": size, "cost/decode_tokens_per_s": speed, "quality/kld_mean": 0.1})
        store.finish(run, "FINISHED")
    store.finish(parent, "FINISHED")
    return uri


@pytest.fixture(scope="module")
def busy_store(tmp_path_factory):
    work = tmp_path_factory.mktemp("busy")
    return work, _store(work, {"bf16": False, "fp8": True, "int4": False})


def test_pick_warns_naming_the_contended_variant_and_its_load(busy_store):
    work, uri = busy_store
    result = quantlab("pick", "--experiment", "busy", "--tracking-uri", uri, cwd=work)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Chosen: int4")  # pick still decides
    warnings = [line for line in lines if line.startswith("warning:")]
    assert len(warnings) == 2, result.stdout
    assert warnings[0].startswith("warning: fp8: speed figures measured while other work competed for its cores")
    assert "1-minute load average 6.50 on 2 CPUs" in warnings[0]
    assert "int4" not in warnings[0] and "bf16" not in warnings[0]
    assert "rerun the sweep with --force on a quiet machine" in warnings[1]


def test_pick_json_carries_the_warnings_and_says_when_the_objective_is_a_timing(busy_store):
    work, uri = busy_store
    by_speed = quantlab(
        "pick", "--experiment", "busy", "--tracking-uri", uri, "--objective", "cost/decode_tokens_per_s", "--json",
        cwd=work,
    )  # fmt: skip
    assert by_speed.returncode == 0, by_speed.stdout + by_speed.stderr
    record = json.loads(by_speed.stdout)
    assert record["chosen"] == "bf16"
    first, second = record["warnings"]
    assert first.startswith("the decision rests on cost/decode_tokens_per_s, timed under contention for fp8")
    assert second.startswith("fp8: speed figures measured") and "6.50" in second


def test_the_report_warns_about_contended_timings(busy_store, tmp_path):
    from quantlab.publish import read_sweep, render_artifacts

    _, uri = busy_store
    store = tracking.open_store(uri)
    render_artifacts(read_sweep(store, tracking.latest_sweep(store, "busy").run_id), tmp_path)
    report = (tmp_path / "report.md").read_text()
    recommendation = report.split("## Recommendation", 1)[1].split("\n## ", 1)[0]
    assert "**Warning: speed measured under contention.**" in recommendation
    assert "> - fp8: speed figures measured while other work competed for its cores" in recommendation
    assert "load average 6.50 on 2 CPUs" in recommendation
    assert "> - int4" not in report and "> - bf16" not in report


def test_no_warning_without_contention(tmp_path):
    from quantlab.publish import read_sweep, render_artifacts

    # Measured on a quiet machine, or logged before contention was recorded (no tag): nothing to warn about.
    uri = _store(tmp_path, {"bf16": False, "fp8": False})
    result = quantlab("pick", "--experiment", "busy", "--tracking-uri", uri, "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads(result.stdout)["warnings"] == []
    store = tracking.open_store(uri)
    render_artifacts(read_sweep(store, tracking.latest_sweep(store, "busy").run_id), tmp_path / "out")
    assert "contention" not in (tmp_path / "out" / "report.md").read_text()


def test_a_loads_rounds_read_as_one_window():
    """A load run in rounds, minutes apart (serving.interleave): its verdict over all of them is over their timed
    seconds added up, not over the minutes between them."""
    first = LoadReading(2, 2, 2, 0.5, 1.0, wall_seconds=10.0, cpu_seconds=15.0, cores_busy_seconds=18.0)
    second = replace(first, load_before=0.2, load_after=1.5, wall_seconds=5.0, cpu_seconds=9.0, cores_busy_seconds=10.0)
    both = combined([first, second])
    assert (both.load_before, both.load_after, both.wall_seconds, both.cpu_seconds) == (0.2, 1.5, 15.0, 24.0)
    assert both.cores_busy_seconds == 28.0 and both.other_cores == pytest.approx((28.0 - 24.0) / 15.0)
    assert combined([first, replace(second, cores_busy_seconds=None)]).other_cores is None  # unknown in one: unknown


def test_a_variant_waiting_for_its_turn_to_serve_leaves_its_seat(tmp_path, monkeypatch):
    """Parked, idle, its server up, a variant must not halve the threads of the variant that runs meanwhile (nor of
    the server that one starts); it takes a seat again for its turn."""
    monkeypatch.delenv(THREADS_ENV, raising=False)
    host = HostShare.seated(environment=False, directory=tmp_path)

    def seats() -> int:
        return len(list(tmp_path.glob("*.seat")))

    assert seats() == 1
    with host.aside():
        assert seats() == 0
    assert seats() == 1
    host.leave()
