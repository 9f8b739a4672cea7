"""Content-addressed checkpoint cache.

A checkpoint's key hashes everything that decides its bytes: the model's content identity,
the method and its resolved parameters, the calibration settings (for methods that calibrate)
and the library versions. A checkpoint is written beside its final place and renamed into it
only once complete, so a crash leaves a `.partial-*` directory that is never taken for a result.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

COMPLETE_MARKER = "quantlab-checkpoint.json"
LIBRARIES = ("torch", "transformers", "llmcompressor", "compressed-tensors", "quantlab")


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


def checkpoint_dir(cache_root: Path, variant_name: str, key: str) -> Path:
    return cache_root / "checkpoints" / f"{variant_name}-{key}"


def is_complete(checkpoint: Path) -> bool:
    return (checkpoint / COMPLETE_MARKER).is_file()


def discard(checkpoint: Path) -> None:
    shutil.rmtree(checkpoint, ignore_errors=True)


@contextmanager
def writing(checkpoint: Path, identity: dict[str, Any]) -> Iterator[Path]:
    """Yield a scratch directory; on success it becomes `checkpoint`, on failure it is removed."""
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    scratch = checkpoint.with_name(f"{checkpoint.name}.partial-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        yield scratch
        (scratch / COMPLETE_MARKER).write_text(json.dumps(identity, indent=2, sort_keys=True, default=str))
        if checkpoint.exists():  # another process finished the same key first; theirs is equal
            shutil.rmtree(scratch)
        else:
            os.replace(scratch, checkpoint)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
