"""Ctrl-C at random moments: tiny-model sweeps interrupted uniformly over their life, each stop checked.

    .venv/bin/python benchmarks/interrupt_trials.py --trials 120 --seed 1 --work-dir /tmp/interrupts

Configurations (drawn per trial, seeded): the executor (local, inprocess), the recipe (`core`: quantize,
evaluate, damage and measure, bf16 and fp8; `served`: the baseline alone, served through `transformers serve`
under guidellm's load), and a CPU-bound neighbour process (none, or one busy core). Each configuration's life is measured
first by one uninterrupted sweep; each trial then signals the sweep's process group (what a terminal's
Ctrl-C does) at a moment drawn uniformly over that life: SIGINT, SIGTERM (a scheduler), or SIGINT twice
one second apart (a user who presses again).

Each trial checks: the exit code (130 for SIGINT, 143 for SIGTERM), the time from the first signal to the
sweep's exit (within --bound seconds), that no run in the store is RUNNING and that every run the sweep
started ended KILLED or FAILED with a reason, and that no process of the trial is left (every process the
trial starts carries a marker in its environment, found in /proc). A stop slower than --dump-after seconds
gets a py-spy dump of every process of the trial, written beside the trial's output.

A trial whose sweep ended before the signal reached it counts as `finished first`, not as an interrupt; so does
one whose sweep had logged every run FINISHED and exited 0 (the signal landed while the interpreter was exiting).
Printed: a line per trial, then a table by configuration and by moment (which processes were running when
the signal landed), with the median and worst time to exit and the failures. Exit 1 if any trial failed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the tests' tiny random Llama (tests/ is a folder of modules)
from fault_trials import sweep_command  # noqa: E402 - a benchmark beside this one
from tiny import save_tiny_llama  # noqa: E402

MARKER = "QUANTLAB_INTERRUPT_TRIAL"
EXIT_CODES = {"SIGINT": 130, "SIGTERM": 143, "SIGINT twice": 130}
EXECUTORS = ("local", "inprocess")
RECIPES = ("core", "served")
NEIGHBOURS = ("quiet", "busy")


def recipe_for(shape: str, model: Path) -> dict:
    common = {
        "name": f"interrupt-{shape}",
        "model": {"source": str(model)},
        "baseline": "bf16",
        "variants": [{"name": "bf16", "method": "bf16"}, {"name": "fp8", "method": "fp8"}],
    }
    if shape == "core":
        return common | {
            "evals": {
                "include_path": str(REPO / "evals"),
                "batch_size": 4,
                "tasks": [{"name": "mmlu_dev", "limit": 4}],
            },
            "quality": {"max_tokens": 96, "window": 32},
            "measure": {"prompt_tokens": 8, "output_tokens": 4, "repeats": 1, "warmup": 0},
            "serving": {"enabled": False},
        }
    # The baseline alone: its server's start, guidellm's load and the publishing, in half the time of two variants.
    return common | {
        "variants": common["variants"][:1],
        "evals": {"tasks": []},
        "quality": {"enabled": False},
        "measure": {"enabled": False},
        "serving": {
            "engine": "transformers",
            "prompt_tokens": 8,
            "output_tokens": 8,
            "concurrency": [1],
            "requests_per_level": 4,
            "slo": {"ttft_ms": 10_000, "itl_ms": 2_000},
        },
    }


@dataclass
class Trial:
    number: int
    executor: str
    recipe: str
    neighbour: str
    how: str  # SIGINT, SIGTERM, SIGINT twice
    moment_s: float  # after the sweep started
    life_s: float  # its configuration's uninterrupted life
    running_at_signal: str = ""  # which of its processes ran when the signal landed
    exit_code: int | None = None
    exit_s: float | None = None  # from the first signal to the sweep's exit
    run_states: dict = field(default_factory=dict)
    leftovers: list = field(default_factory=list)
    failures: list = field(default_factory=list)
    finished_first: bool = False
    forced: bool = False  # the stop went past the sweep's own cleanup (quantlab.stopping's watcher stopped it)


def marked_processes(marker: str) -> list[tuple[int, str]]:
    """(pid, command line) of every live process whose environment carries MARKER=marker."""
    found = []
    wanted = f"{MARKER}={marker}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if wanted not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            status = (entry / "stat").read_text()
            if status.rsplit(")", 1)[1].split()[0] == "Z":  # a zombie holds nothing; its parent will reap it
                continue
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        found.append((int(entry.name), command[:160]))
    return found


def describe_running(processes: list[tuple[int, str]], sweep_pid: int) -> str:
    """The moment, as the processes that ran: the sweep alone, its fork server, a variant, a server, guidellm."""
    kinds = []
    for pid, command in processes:
        if pid == sweep_pid:
            continue
        name = _process_name(pid)
        if name.startswith("quantlab-"):
            kinds.append(f"variant {name.removeprefix('quantlab-')}")
        elif "forkserver" in command:
            kinds.append("fork server")
        elif "guidellm" in command:
            kinds.append("guidellm")
        elif "serve" in command and "quantlab.serving.guard" not in command:
            kinds.append("server")
    return " + ".join(sorted(set(kinds))) or "sweep process only"


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def kill_marked(marker: str) -> None:
    for pid, _ in marked_processes(marker):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def py_spy_dumps(marker: str, target: Path) -> None:
    """A py-spy dump of every process of the trial (native frames too), for a stop that takes too long."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with target.open("w") as out:
        for pid, command in marked_processes(marker):
            out.write(f"\n===== {pid}: {command}\n")
            out.flush()
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                subprocess.run([py_spy, "dump", "--pid", str(pid)], stdout=out, stderr=subprocess.STDOUT, timeout=30)


@contextlib.contextmanager
def neighbour(kind: str, marker: str):
    """A CPU-bound process beside the sweep (one busy core), or nothing."""
    if kind == "quiet":
        yield
        return
    busy = subprocess.Popen(
        [sys.executable, "-c", "while True: pass"], env={**os.environ, MARKER: f"{marker}-neighbour"}
    )
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def start_sweep(recipe: Path, folder: Path, executor: str, marker: str) -> subprocess.Popen:
    """`quantlab sweep` in a session of its own (a terminal's foreground group), with a fresh store and cache."""
    folder.mkdir(parents=True, exist_ok=True)
    # Short: the fork server's socket goes under TMPDIR, and an AF_UNIX path holds 107 bytes (a trial folder under
    # pytest's tmp_path did not fit: "OSError: AF_UNIX path too long").
    tmp = Path(tempfile.mkdtemp(prefix="qit-"))
    store = f"sqlite:///{folder / 'store.db'}"
    command = sweep_command(recipe, store, folder / "cache", "--executor", executor)
    env = {**os.environ, MARKER: marker, "TMPDIR": str(tmp), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with (folder / "sweep.out").open("w") as sink:
        sweep = subprocess.Popen(
            command, cwd=folder, stdout=sink, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    sweep.scratch = tmp  # removed by `finished`
    return sweep


def finished(sweep: subprocess.Popen) -> None:
    shutil.rmtree(sweep.scratch, ignore_errors=True)


def measure_life(recipe: Path, folder: Path, executor: str, kind: str) -> float:
    marker = f"life-{folder.name}"
    with neighbour(kind, marker):
        started = time.monotonic()
        sweep = start_sweep(recipe, folder, executor, marker)
        code = sweep.wait()
        finished(sweep)
        seconds = time.monotonic() - started
    if code != 0:
        raise SystemExit(
            f"the uninterrupted sweep in {folder} exited {code}:\n{(folder / 'sweep.out').read_text()[-3000:]}"
        )
    return seconds


def run_states(folder: Path) -> dict[str, tuple[str, str]]:
    """Every run in the trial's store: name -> (status, its failure tag)."""
    if not (folder / "store.db").is_file():
        return {}
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{folder / 'store.db'}")
    states = {}
    for experiment in client.search_experiments():
        for run in client.search_runs([experiment.experiment_id], max_results=1000):
            states[run.info.run_name] = (run.info.status, run.data.tags.get("quantlab.failure", ""))
    return states


def run_trial(trial: Trial, recipe: Path, folder: Path, bound: float, dump_after: float) -> Trial:
    marker = f"trial-{trial.number}-{os.getpid()}"
    with neighbour(trial.neighbour, marker):
        started = time.monotonic()
        sweep = start_sweep(recipe, folder, trial.executor, marker)
        with contextlib.suppress(subprocess.TimeoutExpired):
            sweep.wait(timeout=max(0.0, started + trial.moment_s - time.monotonic()))
        if sweep.poll() is not None:
            trial.finished_first, trial.exit_code = True, sweep.returncode
            trial.run_states = run_states(folder)
            finished(sweep)
            return trial
        trial.running_at_signal = describe_running(marked_processes(marker), sweep.pid)
        signalled = time.monotonic()
        first = signal.SIGTERM if trial.how == "SIGTERM" else signal.SIGINT
        os.killpg(sweep.pid, first)
        if trial.how == "SIGINT twice":
            with contextlib.suppress(subprocess.TimeoutExpired):
                sweep.wait(timeout=1.0)
            if sweep.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(sweep.pid, signal.SIGINT)
        dumped = False
        while sweep.poll() is None and time.monotonic() - signalled < bound + 30:
            if not dumped and time.monotonic() - signalled > dump_after:
                py_spy_dumps(marker, folder / "py-spy.txt")
                dumped = True
            time.sleep(0.05)
        trial.exit_s = time.monotonic() - signalled
        if sweep.poll() is None:
            trial.failures.append(f"still running {trial.exit_s:.0f} s after the signal")
            kill_marked(marker)
            sweep.wait()
        trial.exit_code = sweep.returncode
    time.sleep(1.0)  # what the sweep stopped is given a moment to be reaped (a server's guard polls every 0.2 s)
    trial.leftovers = [command for _, command in marked_processes(marker)]
    kill_marked(marker)
    finished(sweep)
    try:
        trial.run_states = run_states(folder)
    except Exception as error:  # noqa: BLE001 - a store the stop left unreadable is this trial's failure
        trial.failures.append(f"store unreadable: {type(error).__name__}: {str(error)[:200]}")
    statuses = {status for status, _ in trial.run_states.values()}
    if trial.exit_code == 0 and statuses == {"FINISHED"} and not trial.leftovers:  # reached as it exited, work done
        trial.finished_first = True
        return trial
    expected = EXIT_CODES[trial.how]
    # Killed by the signal itself (before the interpreter installed quantlab's handlers, or after the sweep was done
    # and Python was finalizing): a shell reports 128 + the signal's number for that too.
    if trial.exit_code not in (expected, -(expected - 128)):
        trial.failures.append(f"exit {trial.exit_code}, not {expected}")
    trial.forced = "Stopping at once" in (folder / "sweep.out").read_text(errors="replace")
    if trial.exit_s is not None and trial.exit_s > bound:
        trial.failures.append(f"took {trial.exit_s:.1f} s to exit (bound {bound:.0f} s)")
    if trial.leftovers:
        trial.failures.append(f"{len(trial.leftovers)} process(es) left: {trial.leftovers}")
    for name, (status, reason) in trial.run_states.items():
        if status == "RUNNING":
            trial.failures.append(f"run {name} left RUNNING")
        elif status in {"KILLED", "FAILED"} and not reason:
            trial.failures.append(f"run {name} ended {status} without a reason")
    return trial


def summary(trials: list[Trial], bound: float) -> str:
    interrupted = [t for t in trials if not t.finished_first]
    lines = [
        "",
        f"{len(trials)} trials: {len(interrupted)} interrupted, {len(trials) - len(interrupted)} finished before the "
        f"signal; {sum(1 for t in interrupted if t.failures)} failed (bound {bound:.0f} s)",
        "",
        "| group | interrupts | median exit s | worst exit s | forced stops | failures |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def row(label: str, group: list[Trial]) -> None:
        times = [t.exit_s for t in group if t.exit_s is not None]
        if not group:
            return
        lines.append(
            f"| {label} | {len(group)} | {statistics.median(times):.2f} | {max(times):.2f} | "
            f"{sum(1 for t in group if t.forced)} | {sum(1 for t in group if t.failures)} |"
        )

    row("all", interrupted)
    for executor in EXECUTORS:
        row(f"executor {executor}", [t for t in interrupted if t.executor == executor])
    for shape in RECIPES:
        row(f"recipe {shape}", [t for t in interrupted if t.recipe == shape])
    for kind in NEIGHBOURS:
        row(f"neighbour {kind}", [t for t in interrupted if t.neighbour == kind])
    for how in EXIT_CODES:
        row(how, [t for t in interrupted if t.how == how])
    for tenth in range(10):
        row(
            f"moment {tenth * 10}-{tenth * 10 + 10}% of life",
            [t for t in interrupted if tenth <= t.moment_s / t.life_s * 10 < tenth + 1],
        )
    for running in sorted({t.running_at_signal for t in interrupted}):
        row(f"running: {running}", [t for t in interrupted if t.running_at_signal == running])
    for trial in interrupted:
        if trial.failures:
            lines.append(f"- trial {trial.number}: {'; '.join(trial.failures)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--work-dir", type=Path, required=True, help="trials' folders (emptied first)")
    parser.add_argument("--bound", type=float, default=30.0, help="seconds a stop may take (default 30)")
    parser.add_argument("--dump-after", type=float, default=10.0, help="py-spy dumps after this many seconds")
    parser.add_argument("--executors", default=",".join(EXECUTORS))
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--neighbours", default=",".join(NEIGHBOURS))
    parser.add_argument("--json", type=Path, help="write every trial here")
    parser.add_argument(
        "--lives-from",
        type=Path,
        help="take each configuration's life from an earlier run's --json instead of timing it",
    )
    args = parser.parse_args(argv)

    shutil.rmtree(args.work_dir, ignore_errors=True)
    args.work_dir.mkdir(parents=True)
    model = save_tiny_llama(args.work_dir / "tiny-llama")
    recipes = {}
    for shape in args.recipes.split(","):
        recipes[shape] = args.work_dir / f"{shape}.yaml"
        recipes[shape].write_text(yaml.safe_dump(recipe_for(shape, model), sort_keys=False))
    configurations = [
        (executor, shape, kind)
        for executor in args.executors.split(",")
        for shape in recipes
        for kind in args.neighbours.split(",")
    ]
    # The trials are drawn first (each its moment as a share of its configuration's life): only the configurations
    # drawn are timed.
    draw = random.Random(args.seed)
    plan = [
        (draw.choice(configurations), draw.choices(list(EXIT_CODES), weights=[6, 2, 2])[0], draw.random())
        for _ in range(args.trials)
    ]
    lives = {}
    if args.lives_from:
        for earlier in json.loads(args.lives_from.read_text()):
            lives[(earlier["executor"], earlier["recipe"], earlier["neighbour"])] = earlier["life_s"]
    for configuration in dict.fromkeys(configuration for configuration, _, _ in plan):
        if configuration in lives:
            print(f"life of {' / '.join(configuration)}: {lives[configuration]:.1f} s (from {args.lives_from})")
            continue
        executor, shape, kind = configuration
        lives[configuration] = measure_life(
            recipes[shape], args.work_dir / f"life-{executor}-{shape}-{kind}", executor, kind
        )
        print(f"life of {executor} / {shape} / {kind}: {lives[configuration]:.1f} s", flush=True)

    trials = []
    for number, (configuration, how, share) in enumerate(plan, start=1):
        life = lives[configuration]
        trial = Trial(number, *configuration, how=how, moment_s=share * life, life_s=life)
        folder = args.work_dir / f"trial-{number:03d}"
        run_trial(trial, recipes[trial.recipe], folder, args.bound, args.dump_after)
        if not trial.failures and not (folder / "py-spy.txt").is_file():
            shutil.rmtree(folder, ignore_errors=True)  # a failed or slow trial's folder is kept: output, store, dumps
        outcome = "finished first" if trial.finished_first else f"exit {trial.exit_code} in {trial.exit_s:.2f} s"
        outcome += " (forced)" if trial.forced else ""
        print(
            f"trial {number:3d} {trial.executor:9s} {trial.recipe:6s} {trial.neighbour:5s} {trial.how:12s} "
            f"at {trial.moment_s:5.1f}/{life:5.1f} s [{trial.running_at_signal}]: {outcome}"
            + (f"  FAILED: {'; '.join(trial.failures)}" if trial.failures else ""),
            flush=True,
        )
        trials.append(trial)
    print(summary(trials, args.bound))
    if args.json:
        args.json.write_text(json.dumps([asdict(t) for t in trials], indent=1))
    return 1 if any(t.failures for t in trials) else 0


if __name__ == "__main__":
    sys.exit(main())
