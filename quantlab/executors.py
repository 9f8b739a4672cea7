"""Where a variant runs: its own spawned process (local), a Ray task, or the sweep's own process
(inprocess). All yield the same outcomes: a VariantResult, or VariantFailed with the traceback.

One process per variant keeps memory figures clean (nothing left over from the previous
variant) and contains crashes: a segfault or the OOM killer takes one variant, not the sweep.
The child's stdout and stderr go to a log file that is kept as the run's artifact. The
in-process executor gives both up for one process and one CUDA context (see InProcessExecutor).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import queue
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

from quantlab.errors import BadInput
from quantlab.jobs import VariantJob, VariantResult
from quantlab.runner import run_variant

StageCallback = Callable[[str, str], None]  # (variant, stage)
Outcome = tuple[VariantJob, "VariantResult | VariantFailed", Path]  # job, what came of it, its log file


class VariantFailed(Exception):
    def __init__(self, reason: str, details: str):
        super().__init__(reason)
        self.reason = reason
        self.details = details  # traceback or log tail, kept as an artifact


def _child_main(variant: str, job_path: str, messages: multiprocessing.Queue, log_path: str) -> None:
    _bind_to_sweep(f"quantlab-{variant}")
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        job = pickle.loads(Path(job_path).read_bytes())
        Path(job_path).unlink()
        result = run_variant(job, lambda stage: messages.put(("stage", stage)))
        messages.put(("result", result))
    except BaseException as error:  # noqa: BLE001 - everything must reach the parent as a failure
        messages.put(("error", (failure_reason(error), traceback.format_exc())))
        raise SystemExit(1) from None


def _bind_to_sweep(name: str) -> None:
    """Name the variant's process and make it die with its sweep (Linux; elsewhere a no-op).

    The name lets ps, top and psutil show which variant a process runs (Linux keeps 15 bytes);
    multiprocessing's `Process(name=...)` is only a Python attribute. A sweep killed outright
    (SIGKILL, the OOM killer) cannot kill its variant: the kernel does (PR_SET_PDEATHSIG), rather
    than leave it computing for nobody, holding memory the next sweep needs.
    """
    if sys.platform != "linux":
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # the sweep died before the line above
        os._exit(1)


def failure_reason(error: BaseException) -> str:
    if isinstance(error, BadInput):  # found only at run time, e.g. too little calibration text
        return (
            f"{error.problems[0].field or 'input'}: {error.problems[0].message}"
            if len(error.problems) == 1
            else str(error)
        )
    return f"{type(error).__name__}: {error}"


def run_local(job: VariantJob, log_path: Path, on_stage: StageCallback) -> VariantResult:
    """Run the job in a fresh spawned interpreter; raise VariantFailed if it fails or dies."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The job (with the baseline's per-document scores, often megabytes) goes through a file, not
    # the spawn pipe: Process.start() writes its arguments into a pipe whose read end it keeps
    # open until the write ends, so a child that dies while reading a payload larger than the
    # pipe's buffer (e.g. it cannot unpickle it) blocks the sweep forever.
    job_path = log_path.with_name(f"{log_path.stem}.job.pickle")
    job_path.write_bytes(pickle.dumps(job))
    process = context.Process(
        target=_child_main, args=(job.variant, str(job_path), messages, str(log_path)), name=f"quantlab-{job.variant}"
    )
    process.start()
    try:
        while True:
            try:
                kind, payload = messages.get(timeout=0.5)
            except queue.Empty:
                if not process.is_alive():
                    break
                continue
            if kind == "stage":
                on_stage(job.variant, payload)
            elif kind == "result":
                process.join()
                return payload
            elif kind == "error":
                process.join()
                raise VariantFailed(payload[0], payload[1] + _log_tail(log_path))
    except BaseException:
        process.kill()
        raise
    process.join()
    raise VariantFailed(_death_reason(process.exitcode), _log_tail(log_path))


def _death_reason(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name
        hint = " (the out-of-memory killer sends SIGKILL)" if name == "SIGKILL" else ""
        return f"variant process was killed by {name}{hint}"
    return f"variant process exited with code {exitcode} without a result"


def _log_tail(log_path: Path, lines: int = 60) -> str:
    if not log_path.is_file():
        return ""
    tail = log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:]
    return "\n\n--- last lines of the variant's log ---\n" + "\n".join(tail)


class Executor(Protocol):
    def run(self, jobs: list[VariantJob], log_dir: Path, on_stage: StageCallback) -> Iterator[Outcome]:
        """Run the jobs, yielding each outcome as soon as it is known."""
        ...


class LocalExecutor:
    """One spawned process per variant, one variant at a time: the machine is the variant's alone."""

    def run(self, jobs: list[VariantJob], log_dir: Path, on_stage: StageCallback) -> Iterator[Outcome]:
        for job in jobs:
            log_path = log_dir / f"{job.variant}.log"
            try:
                yield job, run_local(job, log_path, on_stage), log_path
            except VariantFailed as failed:
                yield job, failed, log_path


class InProcessExecutor:
    """Every variant in the sweep's own process, one after another: no isolation at all.

    For notebooks, debuggers (a breakpoint in a stage just works) and scripts such as
    scripts/gpu_check.py that want one process and one CUDA context. The price:
    - a crash is the sweep's crash: a segfault, the OOM killer or os._exit ends the whole sweep
      (its runs stay RUNNING until the next sweep marks them KILLED); an exception still fails
      only its variant, with the traceback;
    - nothing leaks between variants as far as Python can tell (see `_release_memory`), but
      allocator caches and imported libraries stay, so memory figures are less clean than with
      a fresh process;
    - no log file: the variant writes to the sweep's own stdout and stderr, and its run has no
      `logs/variant.log` artifact (capturing file descriptors 1 and 2 would also swallow the
      sweep's own progress display).
    """

    def run(self, jobs: list[VariantJob], log_dir: Path, on_stage: StageCallback) -> Iterator[Outcome]:
        for job in jobs:
            log_path = log_dir / f"{job.variant}.log"  # never written: the sweep logs no file that is absent
            try:
                outcome: VariantResult | VariantFailed = run_variant(
                    job, lambda stage, name=job.variant: on_stage(name, stage)
                )
            except Exception as error:  # noqa: BLE001 - one variant's error must not end the sweep; Ctrl-C still does
                outcome = VariantFailed(failure_reason(error), traceback.format_exc())
            finally:
                _release_memory()
            yield job, outcome, log_path


def _release_memory() -> None:
    """Give back what a finished variant held, so the next one's peak memory is its own (a spawned
    process drops everything on exit; in-process, the quantizer's session and caches would stay)."""
    from quantlab.stages.quantize import release_quantizer_memory

    release_quantizer_memory()


class RayExecutor:
    """One Ray task per variant, all at once, each with the resources its recipe asks for.

    Workers write checkpoints and the baseline's reference pass into the cache directory and
    their logs into `log_dir`: on a multi-node cluster both must be on a shared file system.
    Only the driver talks to MLflow, so every result reaches the one tracking store.
    """

    def __init__(self, address: str | None):
        self.address = address

    def run(self, jobs: list[VariantJob], log_dir: Path, on_stage: StageCallback) -> Iterator[Outcome]:
        import ray

        if not ray.is_initialized():
            if self.address:
                ray.init(address=self.address, log_to_driver=False)
            else:
                ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
        # max_calls=1: a fresh worker process per variant, as with the local executor.
        # max_retries=0: a variant whose worker died (OOM killer, Ray's memory monitor, a lost
        # node) fails like a local one instead of being run again, up to 3 times or, for Ray's
        # memory monitor, without end; the next sweep recomputes only what did not finish.
        remote = ray.remote(max_calls=1, max_retries=0)(_ray_task)
        pending = {}
        for job in jobs:
            runtime = job.loaded.recipe.runtime
            log_path = log_dir / f"{job.variant}.log"
            ref = remote.options(num_cpus=runtime.cpus, num_gpus=runtime.gpus, name=f"quantlab-{job.variant}").remote(
                job, str(log_path)
            )
            pending[ref] = (job, log_path)
            on_stage(job.variant, "queued on Ray")
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            job, log_path = pending.pop(done[0])
            try:
                yield job, ray.get(done[0]), log_path
            except ray.exceptions.RayTaskError as error:
                cause = error.cause if isinstance(getattr(error, "cause", None), BaseException) else error
                yield job, VariantFailed(failure_reason(cause), str(error) + _log_tail(log_path)), log_path
            except ray.exceptions.RayError as error:  # worker died: killed, out of memory, node lost
                yield (
                    job,
                    VariantFailed(f"Ray worker failed: {type(error).__name__}", str(error) + _log_tail(log_path)),
                    log_path,
                )


def _ray_task(job: VariantJob, log_path: str) -> VariantResult:
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    return run_variant(job)


def make_executor(kind: str, ray_address: str | None) -> Executor:
    executors: dict[str, Callable[[], Executor]] = {
        "local": LocalExecutor,
        "inprocess": InProcessExecutor,
        "ray": lambda: RayExecutor(ray_address),
    }
    if kind not in executors:
        raise ValueError(f"unknown executor '{kind}'; known: {', '.join(executors)}")
    return executors[kind]()
