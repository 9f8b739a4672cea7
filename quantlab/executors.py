"""Where a variant runs: its own process (local, forked from a server that preloaded the libraries), a Ray task, or the sweep's own process
(inprocess). Each yields every outcome as soon as it is known: a VariantResult, or VariantFailed with the traceback.

A process per variant keeps memory figures clean and contains crashes (a segfault or the OOM
killer takes one variant, not the sweep); its stdout and stderr go to a log file kept as an artifact.

Each executor makes the variant's share of the host's cores (host_share.HostShare) in the process that runs it,
and hands it to the runner with the job: under Ray the CPUs its task reserved, locally the visible cores divided
by the quantlab variants running on the host (a seat each; other sweeps may run theirs), QUANTLAB_THREADS if set.
Without it every process runs one thread per core, and variants side by side oversubscribe the cores.

One module-level object, `_FORK_SERVER`: what the running fork server preloaded (`start_variant_processes`).
The stdlib keeps one fork server per process, so what it preloaded is the process's too.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from multiprocessing import forkserver
from pathlib import Path
from typing import TYPE_CHECKING

from quantlab import stopping
from quantlab.errors import BadInput
from quantlab.host_share import THREADS_ENV, HostShare, ThreadShare, local_share, thread_share, visible_cores
from quantlab.jobs import BaselineOutputs, VariantJob, VariantResult
from quantlab.preload import ENV as PRELOAD_ENV
from quantlab.preload import output_to
from quantlab.runner import run_variant

if TYPE_CHECKING:
    from quantlab.recipe import LoadedRecipe

StageCallback = Callable[[str, str], None]  # (variant, stage)
# job, what came of it, its log file. BaselineOutputs: its quality stages are done, and it waits to serve (it comes
# again with its result or failure; LocalExecutor).
Outcome = tuple[VariantJob, "VariantResult | VariantFailed | BaselineOutputs", Path]


class VariantFailed(Exception):
    def __init__(self, reason: str, details: str):
        super().__init__(reason)
        self.reason = reason
        self.details = details  # traceback or log tail, kept as an artifact


def _child_main(
    variant: str,
    job_path: str,
    reports: multiprocessing.connection.Connection,
    log_path: str,
    share: ThreadShare | None = None,
    turns: multiprocessing.connection.Connection | None = None,
) -> None:
    """`reports`: the write end of a pipe, written synchronously. Not a multiprocessing.Queue: its first put starts
    a feeder thread, and a thread start can hang the variant for good (_no_progress_monitor). `turns`: the read end
    of the pipe its turns to serve come through (None: the executor does not interleave)."""
    _bind_to_sweep(f"quantlab-{variant}")
    output_to(log_path)
    _no_progress_monitor()
    try:
        job = pickle.loads(Path(job_path).read_bytes())
        Path(job_path).unlink()
        host = HostShare.fixed(share) if share else HostShare.seated()
        serving_turns = _ChildTurns(reports, turns) if turns is not None else None
        result = run_variant(job, lambda stage: reports.send(("stage", stage)), host, serving_turns)
        reports.send(("result", result))
    except BaseException as error:  # noqa: BLE001 - everything must reach the parent as a failure
        reports.send(("error", (failure_reason(error), traceback.format_exc())))
        raise SystemExit(1) from None


@dataclass(frozen=True)
class _ChildTurns:
    """A variant process's side of LocalExecutor's turns (quantlab.jobs.ServingTurns), through its pipes."""

    reports: multiprocessing.connection.Connection
    turns: multiprocessing.connection.Connection

    def scored(self, outputs: BaselineOutputs) -> None:
        self.reports.send(("scored", outputs))

    def wait(self) -> None:
        self._parked("parked")

    def served(self) -> None:
        self._parked("served")

    def _parked(self, kind: str) -> None:
        self.reports.send((kind, None))
        try:
            self.turns.recv()
        except EOFError:
            raise RuntimeError("the sweep ended while the variant waited for its turn to serve") from None


def _no_progress_monitor() -> None:
    """No tqdm monitor thread in a variant. tqdm starts one with the first progress bar and again after every bar
    has closed (each model load, each quantization step), only to retune a stalled bar's refresh rate, which a log
    file does not need. Each start is a risk: on CPython 3.11, a thread that dies booting (a MemoryError when memory
    runs out, seen in tests/test_resilience.py's starved variant: "Exception ignored in thread started by")
    leaves Thread.start() waiting forever, so the variant hung instead of failing."""
    from tqdm import std

    std.tqdm.monitor_interval = 0


def _bind_to_sweep(name: str) -> None:
    """Name the variant's process for ps/top/psutil (15 bytes) and end it when the sweep dies outright
    (SIGKILL, OOM killer), rather than leave it holding memory."""
    parent = multiprocessing.parent_process()
    if parent is not None:  # the sweep's end of a pipe closes when it dies, however it dies
        threading.Thread(target=_exit_when_ready, args=(parent.sentinel,), name="sweep-watch", daemon=True).start()
    if sys.platform != "linux":
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        # The kernel's own guard, for when this process cannot run Python; its parent is the fork server.
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return


def _exit_when_ready(sentinel: int) -> None:
    multiprocessing.connection.wait([sentinel])
    os._exit(1)


def failure_reason(error: BaseException) -> str:
    if not isinstance(error, BadInput):
        message = str(error)
        if not message and isinstance(error, MemoryError):  # Python's own, raised where an allocation failed
            message = "the variant's process ran out of memory (see failure/traceback.txt for where)"
        return f"{type(error).__name__}: {message}" if message else type(error).__name__
    if len(error.problems) != 1:  # bad input found only at run time, e.g. too little calibration text
        return str(error)
    return f"{error.problems[0].field or 'input'}: {error.problems[0].message}"


class VariantProcess:
    """One variant in a fresh process forked from the fork server, with `share` threads (default: its share of
    this host's cores, among the quantlab variants running on it). `poll` reads what it reports, without
    blocking longer than its timeout; VariantFailed if it cannot start. With `turns`, its serving waits for each
    turn (`parked` until `give_turn`)."""

    def __init__(self, job: VariantJob, log_path: Path, share: ThreadShare | None = None, turns: bool = False):
        self.job, self.log_path = job, log_path
        self.parked, self.turns_taken = False, 0
        self.served = False  # its timed load runs are done: parked until every variant's are
        context = start_variant_processes(job.loaded)
        self.reports, child_end = context.Pipe(duplex=False)
        child_turns, self._turns = context.Pipe(duplex=False) if turns else (None, None)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        # The job (often megabytes of baseline scores) goes through a file, not the spawn pipe: a child
        # that dies while reading a payload larger than the pipe's buffer would block start() forever.
        job_path = log_path.with_name(f"{log_path.stem}.job.pickle")
        job_path.write_bytes(pickle.dumps(job))
        self.process = context.Process(
            target=_child_main,
            args=(job.variant, str(job_path), child_end, str(log_path), share, child_turns),
            name=f"quantlab-{job.variant}",
        )
        try:
            self.process.start()
        except (OSError, EOFError) as error:  # the fork server is gone (killed, or crashed importing a library)
            reason = f"could not start the variant's process: {failure_reason(error)}"
            raise VariantFailed(reason, traceback.format_exc()) from None
        finally:
            # Only the child writes: a child that dies halfway through a report then reads as EOF, not as a wait.
            child_end.close()
            if child_turns is not None:  # only the child reads: the sweep's end reads there as EOF
                child_turns.close()

    def poll(
        self, on_stage: StageCallback, timeout: float = 0.5
    ) -> VariantResult | VariantFailed | BaselineOutputs | None:
        """Its outcome once it has one (a result, or how it failed or died), or its outputs once scored (it waits to
        serve); None while it runs."""
        reported = self.reports.poll(timeout)
        if not reported and self.process.is_alive():
            return None
        try:
            kind, payload = self.reports.recv() if reported else ("died", None)
        except EOFError:  # it died in the middle of a report
            kind, payload = "died", None
        if kind == "stage":
            on_stage(self.job.variant, payload)
            return None
        if kind in ("parked", "served"):
            self.parked, self.served = True, kind == "served"
            return None
        if kind == "scored":
            return payload
        self.process.join()
        self.reports.close()
        if kind == "died":
            return VariantFailed(_death_reason(self.process.exitcode), _log_tail(self.log_path))
        if kind == "result":
            return payload
        return VariantFailed(payload[0], payload[1] + _log_tail(self.log_path))

    def give_turn(self) -> None:
        assert self._turns is not None and self.parked
        self.parked = False
        self.turns_taken += 1
        self._turns.send(self.turns_taken)

    def kill(self) -> None:
        self.process.kill()


def run_local(
    job: VariantJob, log_path: Path, on_stage: StageCallback, share: ThreadShare | None = None
) -> VariantResult:
    """Run the job in a VariantProcess until it ends; raise VariantFailed if it fails or dies."""
    variant = VariantProcess(job, log_path, share)
    try:
        while (outcome := variant.poll(on_stage)) is None:
            pass
    except BaseException:
        variant.kill()
        raise
    if isinstance(outcome, VariantFailed):
        raise outcome
    return outcome


@dataclass
class _ForkServer:
    preloaded_for: str | None = None  # the spec the running fork server preloaded


_FORK_SERVER = _ForkServer()  # the process's one fork server, as the stdlib keeps it
# Variables the libraries' own imports set (sklearn's and threadpoolctl's defaults, torch inductor's cache folder,
# lm-eval's hub download mode): checking a recipe can import them after the fork server started, which imports them
# too. Not a change of environment: counted as one, a sweep that checked a new model's widths would start its fork
# server twice, paying its imports again before the first variant could start.
SET_BY_IMPORTS = frozenset(
    {"KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK", "TORCHINDUCTOR_CACHE_DIR", "HF_XET_HIGH_PERFORMANCE"}
)


def start_variant_processes(loaded: LoadedRecipe) -> multiprocessing.context.BaseContext:
    """A fork server that imports what this recipe's variants need (quantlab.preload), in the
    background from the moment it starts: each variant is a fresh fork of it, as isolated as a
    spawned interpreter without paying the imports again. One per sweep; a server left by an
    earlier sweep with other needs or another environment is replaced."""
    # _stop is the stdlib's only way to restart its fork server (stop_variant_processes).
    if "forkserver" not in multiprocessing.get_all_start_methods() or not hasattr(forkserver._forkserver, "_stop"):  # noqa: SLF001
        return multiprocessing.get_context("spawn")
    recipe = loaded.recipe
    spec = json.dumps(
        {
            "tasks": [task.name for task in recipe.evals.tasks],
            "include_path": str(loaded.include_path) if loaded.include_path else None,
            "quantizes": any(variant.method != "bf16" for variant in recipe.variants),
            # Not MLflow's variables, which the sweep sets after starting the server (a variant never talks to MLflow),
            # nor those the libraries' imports set (SET_BY_IMPORTS).
            "environment": hashlib.sha256(
                json.dumps(sorted(item for item in os.environ.items() if _tells_servers_apart(item[0]))).encode()
            ).hexdigest(),
        }
    )
    if spec != _FORK_SERVER.preloaded_for:
        stop_variant_processes()
        forkserver.set_forkserver_preload(["quantlab.preload"])
        os.environ[PRELOAD_ENV] = spec
        try:
            forkserver.ensure_running()
        finally:
            del os.environ[PRELOAD_ENV]
        _FORK_SERVER.preloaded_for = spec
    return multiprocessing.get_context("forkserver")


def _tells_servers_apart(variable: str) -> bool:
    # MLflow's private ones too: importing it sets (or, telemetry off, removes) _MLFLOW_TELEMETRY_SESSION_ID, which
    # every process started under a parent that imported MLflow (a test, a notebook) inherits.
    return not variable.lstrip("_").startswith("MLFLOW_") and variable not in SET_BY_IMPORTS


def stop_variant_processes() -> None:
    """End the fork server now, without waiting for its imports: for a sweep that ends before its variants,
    or one whose needs the running server does not meet (its forked variants, if any, live on)."""
    server = forkserver._forkserver  # noqa: SLF001 - see start_variant_processes
    if getattr(server, "_forkserver_pid", None) is not None:
        os.kill(server._forkserver_pid, signal.SIGKILL)  # noqa: SLF001
        server._stop()  # noqa: SLF001 - reaps it and removes its socket
    _FORK_SERVER.preloaded_for = None


def _death_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        hint = " (the out-of-memory killer sends SIGKILL)" if name == "SIGKILL" else ""
        return f"variant process was killed by {name}{hint}"
    return f"variant process exited with code {exitcode} without a result"


def _log_tail(log_path: Path) -> str:
    if not log_path.is_file():
        return ""
    tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-60:]
    return "\n\n--- last lines of the variant's log ---\n" + "\n".join(tail)


class LocalExecutor:
    """One process per variant, `parallel` at a time (default one: the machine is the variant's alone). Side by
    side they share the cores through their seats on the host, and each measure stage times alone: the others
    pause at their next forward pass until it is done (host_share.HostShare.timing).

    Serving interleaved (serving.interleave, on CPU: runner.run_variant decides): a variant that has scored waits to
    serve, parked, its server up, and counts no more against `parallel`; once every variant is parked, each gets a
    turn in order, the one with the fewest turns first: round by round, every variant runs its levels once. A variant
    whose load runs are done waits again, served, until every variant's are: then all of them finish at once (their
    figures, charts, servers' stops and the sweep's logging of their results, none of it beside a timed round).
    `run(..., hold=True)` returns once every variant left is parked (the sweep's baseline, whose outputs the others
    need to start), keeping them for the next `run`; `close` ends any still kept."""

    def __init__(self, parallel: int = 1) -> None:
        self.parallel = parallel
        self._kept: list[VariantProcess] = []  # parked at the end of a run that held them

    def run(
        self, jobs: list[VariantJob], log_dir: Path, on_stage: StageCallback, hold: bool = False
    ) -> Iterator[Outcome]:
        local_share()  # a bad QUANTLAB_THREADS is bad input, found before any variant starts
        waiting, running, self._kept = list(jobs), self._kept, []
        try:
            while waiting or running:
                while waiting and sum(not variant.parked for variant in running) < max(1, self.parallel):
                    job = waiting.pop(0)
                    log_path = log_dir / f"{job.variant}.log"
                    try:
                        running.append(VariantProcess(job, log_path, turns=True))
                    except VariantFailed as failed:
                        yield job, failed, log_path
                for variant in list(running):
                    stopping.raise_if_stopped()  # a stop whose first raise was swallowed
                    outcome = variant.poll(on_stage, timeout=0.5 / len(running))
                    if outcome is None:
                        continue
                    if not isinstance(outcome, BaselineOutputs):
                        running.remove(variant)
                    # Before the next turn: what the sweep does with it (logging a result) must not compete with a
                    # variant's timed round.
                    yield variant.job, outcome, variant.log_path
                if hold and not waiting and running and all(variant.parked for variant in running):
                    self._kept, running = running, []
                    return
                if not hold:
                    _next_turn(waiting, running)
        except BaseException:  # Ctrl-C, or the sweep stopped reading: no variant outlives it
            for variant in running:
                variant.kill()
            raise

    def close(self) -> None:
        for variant in self._kept:
            variant.kill()
        self._kept = []


def _next_turn(waiting: list[VariantJob], running: list[VariantProcess]) -> None:
    """Once every variant has scored and waits: a turn to the one with the fewest turns taken of those still to serve;
    once every one has served, all of them go on to finish."""
    if not waiting and running and all(variant.parked for variant in running):
        if to_serve := [variant for variant in running if not variant.served]:
            min(to_serve, key=lambda variant: variant.turns_taken).give_turn()
        else:
            for variant in running:
                variant.give_turn()


class InProcessExecutor:
    """Every variant in the sweep's own process, one after another: for notebooks, debuggers and
    scripts/gpu_check.py (one process, one CUDA context). No isolation: a crash ends the sweep (its
    runs stay RUNNING until the next sweep marks them KILLED; an exception fails only its variant);
    allocator caches and imports stay between variants; no log file (capturing fds 1 and 2 would
    swallow the sweep's progress display), so the sweep logs none."""

    def run(
        self, jobs: list[VariantJob], log_dir: Path, on_stage: StageCallback, hold: bool = False
    ) -> Iterator[Outcome]:
        """`hold`: nothing to hold, each variant runs to its end."""
        local_share()  # a bad QUANTLAB_THREADS is bad input, found before any variant starts
        for job in jobs:
            log_path = log_dir / f"{job.variant}.log"
            try:
                yield job, self.run_one(job, log_path, on_stage), log_path
            except VariantFailed as failed:
                yield job, failed, log_path

    def close(self) -> None:
        """Nothing kept between runs."""

    @staticmethod
    def run_one(job: VariantJob, log_path: Path, on_stage: StageCallback) -> VariantResult:
        from quantlab.stages.quantize import release_quantizer_memory

        # The sweep's own process: torch's pool only, the environment (and so the fork server's) left alone.
        host = HostShare.seated(environment=False)
        try:
            return run_variant(job, lambda stage: on_stage(job.variant, stage), host)
        except Exception as error:  # noqa: BLE001 - one variant's error must not end the sweep; Ctrl-C still does
            raise VariantFailed(failure_reason(error), traceback.format_exc()) from None
        finally:
            host.leave()  # the sweep's process lives on: its seat must not count once the variant is done
            release_quantizer_memory()  # so that the next variant's peak memory is its own


@dataclass(frozen=True)
class RayExecutor:
    """One Ray task per variant, all at once, each with the resources its recipe asks for. Workers
    write the cache and `log_dir`: on a multi-node cluster both must be on a shared file system. A node without
    the variant's serving engine installs it (VariantJob.node)."""

    address: str | None

    def run(
        self, jobs: list[VariantJob], log_dir: Path, on_stage: StageCallback, hold: bool = False
    ) -> Iterator[Outcome]:
        """`hold`: nothing to hold, each variant runs to its end."""
        import ray

        if not ray.is_initialized():  # a cluster at `address` has its own CPUs (and no dashboard to start)
            cpus = None if self.address else os.cpu_count()
            ray.init(self.address, num_cpus=cpus, include_dashboard=False, log_to_driver=False)
        # max_calls=1: a fresh worker process per variant. max_retries=0: a variant whose worker died
        # fails like a local one instead of being rerun (endlessly, for Ray's memory monitor).
        remote = ray.remote(max_calls=1, max_retries=0)(_ray_task)
        pending = {}
        for job in jobs:
            runtime = job.loaded.recipe.runtime
            log_path = log_dir / f"{job.variant}.log"
            # Decided here: the driver's QUANTLAB_THREADS, which workers on other nodes do not see.
            share = thread_share(visible_cores(), ray_cpus=runtime.cpus, override=os.environ.get(THREADS_ENV))
            ref = remote.options(num_cpus=runtime.cpus, num_gpus=runtime.gpus, name=f"quantlab-{job.variant}").remote(
                job, str(log_path), share
            )
            pending[ref] = (job, log_path)
            on_stage(job.variant, "queued on Ray")
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            job, log_path = pending.pop(done[0])
            try:
                yield job, ray.get(done[0]), log_path
            except ray.exceptions.RayError as error:
                if isinstance(error, ray.exceptions.RayTaskError):  # the variant raised
                    cause = getattr(error, "cause", None)
                    reason = failure_reason(cause if isinstance(cause, BaseException) else error)
                else:  # its worker died: killed, out of memory, node lost
                    reason = f"Ray worker failed: {type(error).__name__}"
                yield job, VariantFailed(reason, str(error) + _log_tail(log_path)), log_path

    def close(self) -> None:
        """Nothing kept between runs."""


def _ray_task(job: VariantJob, log_path: str, share: ThreadShare) -> VariantResult:
    output_to(log_path)
    # The driver cannot prepare the nodes Ray picks: the variant's own node installs what it lacks (its engine).
    return run_variant(replace(job, node=ray_node()), host=HostShare.fixed(share))


def ray_node() -> str:
    """The node this Ray task runs on, for people: its host and Ray's id for it (several nodes may share a host)."""
    import ray

    return f"{socket.gethostname()} (Ray node {ray.get_runtime_context().get_node_id()})"


# --executor's choices, each made from the sweep's --ray-address and --parallel.
EXECUTORS: dict[str, Callable[[str | None, int], LocalExecutor | InProcessExecutor | RayExecutor]] = {
    "local": lambda ray_address, parallel: LocalExecutor(parallel),
    "ray": lambda ray_address, parallel: RayExecutor(ray_address),
    "inprocess": lambda ray_address, parallel: InProcessExecutor(),
}
