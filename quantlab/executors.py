"""Where a variant runs: its own spawned process (local) or a Ray task. Both return a VariantResult.

One process per variant keeps memory figures clean (nothing left over from the previous
variant) and contains crashes: a segfault or the OOM killer takes one variant, not the sweep.
The child's stdout and stderr go to a log file that is kept as the run's artifact.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import traceback
from collections.abc import Callable
from pathlib import Path

from quantlab.runner import VariantJob, VariantResult, run_variant

StageCallback = Callable[[str, str], None]  # (variant, stage)


class VariantFailed(Exception):
    def __init__(self, reason: str, details: str):
        super().__init__(reason)
        self.reason = reason
        self.details = details  # traceback or log tail, kept as an artifact


def _child_main(job: VariantJob, messages: multiprocessing.Queue, log_path: str) -> None:
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        result = run_variant(job, lambda stage: messages.put(("stage", stage)))
        messages.put(("result", result))
    except BaseException as error:  # noqa: BLE001 - everything must reach the parent as a failure
        messages.put(("error", (f"{type(error).__name__}: {error}", traceback.format_exc())))
        raise SystemExit(1) from None


def run_local(job: VariantJob, log_path: Path, on_stage: StageCallback) -> VariantResult:
    """Run the job in a fresh spawned interpreter; raise VariantFailed if it fails or dies."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    process = context.Process(target=_child_main, args=(job, messages, str(log_path)), name=f"quantlab-{job.variant}")
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
