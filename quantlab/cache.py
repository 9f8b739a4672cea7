"""Content-addressed cache: a checkpoint's key hashes everything that decides its bytes. Each is
written beside its final place and renamed into it once complete, so a crash leaves only a
`.partial-*` directory, never taken for a result and removed by the next writer on that host.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

COMPLETE_MARKER = "quantlab-checkpoint.json"
LIBRARIES = ("torch", "transformers", "llmcompressor", "compressed-tensors", "quantlab")


def default_root() -> Path:
    return Path(os.environ.get("QUANTLAB_CACHE_DIR") or Path.home() / ".cache" / "quantlab")


def library_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in LIBRARIES:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    return found


def cache_key(identity: dict[str, Any]) -> str:
    canonical = json.dumps(identity, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:20]


def recall(directory: Path | None, identity: dict[str, Any]) -> Any:
    """What `remember` stored under `directory` for `identity`, or None."""
    if directory is None:
        return None
    try:
        return json.loads((directory / f"{cache_key(identity)}.json").read_text())
    except (OSError, ValueError):  # absent, or unreadable: the caller computes it again
        return None


def remember(directory: Path, identity: dict[str, Any], fact: Any) -> None:
    """Store a JSON-able `fact` that is slow to find out and fixed by `identity`."""
    path = directory / f"{cache_key(identity)}.json"
    if path.exists():
        return
    directory.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    scratch.write_text(json.dumps(fact, sort_keys=True))
    os.replace(scratch, path)


def tasks_digest(directory: Path | None) -> str | None:
    """Hash of the lm-eval task files (YAML, data, helper code) under a task directory."""
    if directory is None:
        return None
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        if path.is_file() and path.suffix in (".yaml", ".yml", ".jsonl", ".json", ".py"):
            digest.update(str(path.relative_to(directory)).encode() + path.read_bytes())
    return digest.hexdigest()


def checkpoint_dir(cache_root: Path, variant_name: str, key: str) -> Path:
    return cache_root / "checkpoints" / f"{variant_name}-{key}"


def is_complete(checkpoint: Path) -> bool:
    return (checkpoint / COMPLETE_MARKER).is_file()


def _scratch_prefix(checkpoint: Path) -> str:
    """Scratch directories are named by writer: `<checkpoint>.partial-<host>-<pid>`."""
    return f"{checkpoint.name}.partial-{socket.gethostname()}-"


def _remove_abandoned_scratch(checkpoint: Path) -> None:
    """Remove scratch directories of `checkpoint` that dead processes of this host left (as large as
    the result); another host's (a cache shared by a Ray cluster) only that host can judge."""
    import psutil

    prefix = _scratch_prefix(checkpoint)
    for scratch in checkpoint.parent.glob(f"{prefix}*"):
        pid = scratch.name[len(prefix) :]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)


@contextmanager
def atomic_directory(target: Path, *, replace_existing: bool = False) -> Iterator[Path]:
    """Yield an empty scratch directory beside `target` (same file system, so the final rename is
    atomic); on success it becomes `target`, on failure it is removed. An existing `target` is
    replaced with `replace_existing`; otherwise a complete one another process wrote first wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_scratch(target)
    scratch = target.with_name(f"{_scratch_prefix(target)}{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        yield scratch
        if replace_existing and target.exists():
            shutil.rmtree(target)
        try:
            os.replace(scratch, target)
        except OSError:
            # Renaming onto a non-empty directory fails: another process finished the same key
            # first, with the same content, so ours is dropped.
            if not is_complete(target):
                raise
            shutil.rmtree(scratch)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


@contextmanager
def writing(checkpoint: Path, identity: dict[str, Any]) -> Iterator[Path]:
    """A checkpoint written atomically, with the completion marker that `is_complete` reads."""
    with atomic_directory(checkpoint) as scratch:
        yield scratch
        (scratch / COMPLETE_MARKER).write_text(json.dumps(identity, indent=2, sort_keys=True, default=str))
