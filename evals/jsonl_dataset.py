"""Loads a bundled JSONL file for lm-eval, wherever the process happens to run.

lm-eval's usual ``dataset_path: json`` + ``data_files`` resolves relative paths against the
current directory. A task's ``custom_dataset`` hook runs this module instead, which resolves
the file against this directory and reads it without touching any hub or dataset cache.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets

EVALS_DIR = Path(__file__).resolve().parent


def load(data_file: str, split: str = "test", **_task_metadata: Any) -> datasets.DatasetDict:
    """The rows of ``data_file`` (relative to evals/) as the one split ``split``.

    lm-eval passes the task's metadata (version, model arguments) as keyword arguments too.
    """
    lines = (EVALS_DIR / data_file).read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    return datasets.DatasetDict({split: datasets.Dataset.from_list(rows)})
