"""Imported by a sweep's fork server only: what every variant process of the sweep needs, loaded once.

Each variant forks from that server with torch, transformers, lm-eval's evaluator and task index and
llm-compressor already in memory, instead of importing them again (about 10 s each on 2 CPU cores)
and walking lm-eval's ~10k task YAMLs again (15 to 30 s). The executor says what this sweep needs in
the QUANTLAB_PRELOAD environment variable (JSON), which the server reads once and removes.

Forking is safe here because nothing below starts a thread that holds locks across a fork: torch's
thread pools start on first use (in the variant), and the one native thread these imports leave
(pyarrow's jemalloc background thread) is fork-aware.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
from pathlib import Path

ENV = "QUANTLAB_PRELOAD"

EVERY_VARIANT = ("torch", "transformers", "quantlab.runner", "quantlab.stages.evaluate", "quantlab.stages.measure")
FOR_TASKS = ("lm_eval.evaluator", "lm_eval.models.huggingface", "lm_eval.api.metrics")
FOR_QUANTIZING = ("quantlab.stages.quantize", "llmcompressor", "llmcompressor.modifiers.quantization")


def preload(tasks: list[str], include_path: str | None, quantizes: bool, environment: str) -> None:
    """`environment` only tells servers apart: one started under other variables is not reused."""
    # Import-time chatter would land on the sweep's display; anything that matters fails again,
    # logged, in the variant (a failed import is not cached).
    output_to(os.devnull)
    modules = EVERY_VARIANT + (FOR_TASKS if tasks else ()) + (FOR_QUANTIZING if quantizes else ())
    # A failure here is not the sweep's: the variant imports (or builds) it again and reports it in its own log.
    for name in modules:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    if tasks:
        with contextlib.suppress(Exception):
            from quantlab.evaluate.lm_eval_runner import task_manager_for

            task_manager_for(tasks, Path(include_path) if include_path else None)


def output_to(log_path: str) -> None:
    """This process's stdout and stderr (file descriptors, so native libraries' too) into the log,
    not onto the sweep's display."""
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)


if ENV in os.environ:
    preload(**json.loads(os.environ.pop(ENV)))
