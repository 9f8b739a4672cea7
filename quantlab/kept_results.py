"""A variant's finished result, kept in the cache until the tracking store has it.

Hours of quantization and evaluation must not hang on one HTTP call: the sweep writes each result here
(atomically, under its run key) before logging it, and removes it once logged. A store that is down,
slow or refusing when a variant finishes costs that variant its run for now, never its numbers: the
next sweep of the same recipe logs what was kept instead of recomputing it.

Layout: `<cache>/results/<run key>/result.json` (figures, tags, datasets) and `files/` (its artifacts).
"""

from __future__ import annotations

import json
import shutil
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from quantlab.cache import atomic_directory
from quantlab.tracking import DatasetRecord

FORMAT = 1


@dataclass(frozen=True)
class KeptResult:
    """Everything a variant run logs, as `tracking.log_variant` takes it."""

    variant: str
    run_key: str
    metrics: dict[str, float]
    params: dict[str, str]
    tags: dict[str, str]
    datasets: tuple[DatasetRecord, ...] = ()
    files: dict[str, str | bytes] = field(default_factory=dict)
    finished_at: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))


def kept_dir(cache_root: Path, run_key: str) -> Path:
    return cache_root / "results" / run_key


def keep(cache_root: Path, result: KeptResult) -> Path:
    """Write `result` under its run key (replacing an older one); a crash midway leaves no result."""
    target = kept_dir(cache_root, result.run_key)
    with atomic_directory(target, replace_existing=True) as scratch:
        for name, content in result.files.items():
            path = scratch / "files" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
        figures = asdict(result) | {"format": FORMAT, "files": sorted(result.files)}
        (scratch / "result.json").write_text(json.dumps(figures, indent=2, sort_keys=True))
    return target


def has(cache_root: Path, run_key: str) -> bool:
    return (kept_dir(cache_root, run_key) / "result.json").is_file()


def recall(cache_root: Path, run_key: str) -> KeptResult | None:
    """The result kept under `run_key`, or None (none kept, or one this version cannot read)."""
    directory = kept_dir(cache_root, run_key)
    try:
        figures = json.loads((directory / "result.json").read_text())
        if figures.pop("format") != FORMAT:
            return None
        names = figures.pop("files")
        files = {name: (directory / "files" / name).read_bytes() for name in names}
        datasets = tuple(DatasetRecord(**record) for record in figures.pop("datasets"))
        return KeptResult(**figures, datasets=datasets, files=files)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def discard(cache_root: Path, run_key: str) -> None:
    """The store has it now."""
    with suppress(FileNotFoundError):
        shutil.rmtree(kept_dir(cache_root, run_key))
