"""What the checkpoint cache holds and what pruning removes.

`inventory` lists the directories under the cache's `checkpoints/`: complete checkpoints with their model,
method, size, last use and the registry aliases that point at them, and the directories that only take
disk (set aside after failing a check, or left by a dead writer or pruner). `select` decides, from those
facts alone, what `quantlab cache prune` removes; `remove` removes one directory so that no reader ever
finds half of it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from quantlab import cache

# An entry's kind. Pruning removes SET_ASIDE and ABANDONED ones whatever the limits, CHECKPOINTs by the
# limits, never the others: IN_PROGRESS is a live process's (or another host's, which only it can judge),
# UNMARKED a directory quantlab did not leave there.
CHECKPOINT, SET_ASIDE, ABANDONED, IN_PROGRESS, UNMARKED = (
    "checkpoint",
    "set aside",
    "abandoned",
    "in progress",
    "no marker",
)
DAY = 86400.0


@dataclass(frozen=True)
class Entry:
    """A directory of the cache, as far as listing and pruning care."""

    path: Path
    kind: str
    size: int  # bytes: a checkpoint's recorded files; everything in the directory for the others
    last_used: float  # seconds since the epoch: a checkpoint's last use (cache.last_used), else the directory's mtime
    model: str | None = None  # from a checkpoint's identity
    method: str | None = None
    aliases: tuple[str, ...] | None = ()  # "model@alias vN" of each registry alias on it; None: registry unknown

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def protected(self) -> bool:
        """A registry alias points at it, or might: the registry could not be read."""
        return self.aliases is None or bool(self.aliases)

    @property
    def debris(self) -> bool:
        """Only takes disk: pruning removes it first, whatever the limits."""
        return self.kind in (SET_ASIDE, ABANDONED)


@dataclass(frozen=True)
class Prune:
    """What a prune removes, in order (debris first, then checkpoints least recently used first), the
    checkpoints a limit chose that an alias keeps (with why), and what the checkpoints take after it."""

    remove: tuple[Entry, ...]
    kept: tuple[tuple[Entry, str], ...]
    size_after: int


def select(
    entries: Iterable[Entry],
    *,
    now: float,
    older_than_days: float | None = None,
    max_size: int | None = None,
    force: bool = False,
) -> Prune:
    """Which entries a prune removes: every debris entry; each checkpoint last used more than
    `older_than_days` ago; then the least recently used until the checkpoints left take at most `max_size`
    bytes. A protected checkpoint is kept (and said why) unless `force`."""
    if older_than_days is None and max_size is None:
        raise ValueError("a prune needs a limit: older_than_days, max_size or both")
    entries = list(entries)
    checkpoints = sorted((e for e in entries if e.kind == CHECKPOINT), key=lambda e: (e.last_used, e.name))
    chosen: list[Entry] = []
    kept: dict[Path, tuple[Entry, str]] = {}
    size = sum(entry.size for entry in checkpoints)

    def choose(entry: Entry) -> None:
        nonlocal size
        if entry.protected and not force:
            kept.setdefault(entry.path, (entry, _protection(entry)))
        elif entry not in chosen:
            chosen.append(entry)
            size -= entry.size

    if older_than_days is not None:
        for entry in checkpoints:
            if now - entry.last_used > older_than_days * DAY:
                choose(entry)
    if max_size is not None:
        for entry in checkpoints:
            if size <= max_size:
                break
            choose(entry)
    debris = [entry for entry in entries if entry.debris]
    least_recent_first = [entry for entry in checkpoints if entry in chosen]
    return Prune(tuple(debris + least_recent_first), tuple(kept.values()), size)


def _protection(entry: Entry) -> str:
    if entry.aliases is None:
        return "the registry could not be read, so an alias may point at it (--force removes it)"
    return f"registry alias {', '.join(entry.aliases)} points at it (--force removes it)"


def inventory(cache_root: Path, registry: dict[str, list[str]] | None) -> list[Entry]:
    """Every directory under the cache's `checkpoints/`, by name. `registry` maps a checkpoint (path or URI,
    as tracking.registered_checkpoints gives it) to the aliases on it; None: the registry is unknown."""
    directory = cache_root / "checkpoints"
    complete = set(cache.complete_checkpoints(cache_root))
    places = None if registry is None else _by_place(registry)
    entries = []
    for path in sorted(directory.iterdir()) if directory.is_dir() else ():
        with suppress(FileNotFoundError):  # removed or set aside by another process meanwhile
            if path in complete:
                entries.append(_checkpoint(path, places))
            elif path.is_dir():
                entries.append(Entry(path, _kind(path), disk_size(path), path.stat().st_mtime))
    return entries


def _by_place(registry: dict[str, list[str]]) -> dict[str, tuple[str, ...]]:
    found: dict[str, tuple[str, ...]] = {}
    for checkpoint, aliases in registry.items():
        place = _place(checkpoint)
        found[place] = found.get(place, ()) + tuple(aliases)
    return found


def _place(checkpoint: str) -> str:
    """A checkpoint's path with links resolved, however it was written down (a path or a file:// URI)."""
    if checkpoint.startswith("file:"):
        checkpoint = urllib.request.url2pathname(urllib.parse.urlsplit(checkpoint).path)
    elif "://" in checkpoint:
        return checkpoint
    return os.path.realpath(checkpoint)


def _checkpoint(path: Path, places: dict[str, tuple[str, ...]] | None) -> Entry:
    identity: Any = {}
    with suppress(OSError, ValueError, AttributeError):
        identity = json.loads((path / cache.COMPLETE_MARKER).read_text()).get("identity") or {}
    records = cache.recorded_files(path)
    size = sum(record.size for record in records) if records is not None else disk_size(path)
    aliases = None if places is None else places.get(_place(str(path)), ())
    model, method = (identity.get("model"), identity.get("method")) if isinstance(identity, dict) else (None, None)
    return Entry(path, CHECKPOINT, size, cache.last_used(path), model, method, aliases)


def _kind(path: Path) -> str:
    if cache.scratch_owner(path) is not None:
        return ABANDONED if cache.is_abandoned(path) else IN_PROGRESS
    return SET_ASIDE if ".corrupt-" in path.name else UNMARKED


def disk_size(directory: Path) -> int:
    """Bytes of the files under `directory` (those that vanish meanwhile not counted)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def remove(entry: Entry) -> bool:
    """Delete an entry's directory; False when it is gone already (another prune took it, or a check set it
    aside). A checkpoint is first renamed to `<name>.pruning-<host>-<pid>` (atomic): a reader that looks for
    it afterwards finds nothing and rebuilds it, never half of it. An OSError says what could not be removed
    (a renamed checkpoint left behind is abandoned debris the next prune removes)."""
    target = entry.path
    if entry.kind == CHECKPOINT:
        target = entry.path.with_name(f"{entry.name}{cache.PRUNING}{socket.gethostname()}-{os.getpid()}")
        try:
            os.rename(entry.path, target)
        except FileNotFoundError:
            return False
    elif not target.is_dir():
        return False
    try:
        shutil.rmtree(target)
    except FileNotFoundError:  # debris another prune is removing too: what is left, if any, goes
        shutil.rmtree(target, ignore_errors=True)
    return True


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}


def parse_size(text: str) -> int:
    """Bytes of a size such as 500M, 20G, 1.5T or 20GiB (powers of 1024); a bare number is bytes."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(?:([KMGTP])i?)?B?\s*", text, re.IGNORECASE)
    if found is None:
        raise ValueError(f"'{text}' is not a size such as 500M, 20G or 1.5T (a bare number is bytes)")
    return int(float(found[1]) * _UNITS[(found[2] or "").upper()])


def human_size(size: int) -> str:
    """Bytes in powers of 1024, as parse_size reads them: 512 B, 1.5 KiB, 20.0 GiB."""
    value, unit = float(size), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if value < 1024 or unit == "PiB":
            break
        value /= 1024
    return f"{size} B" if unit == "B" else f"{value:.1f} {unit}"


def age(seconds: float) -> str:
    for unit, length in (("d", DAY), ("h", 3600.0), ("min", 60.0)):
        if seconds >= length:
            return f"{seconds // length:.0f} {unit} ago"
    return "just now"


def when(timestamp: float, now: float) -> str:
    """A time as this machine's clock shows it, and how long ago."""
    return f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(timestamp))} ({age(now - timestamp)})"


def short_model(model: str | None) -> str:
    """A model identity for a table: its digests (a file's or a local directory's fingerprint) cut to 8 digits,
    without their algorithm's name, so that the model's name keeps the column."""
    if not model:
        return "-"
    return re.sub(r"(sha256=)?([0-9a-f]{16,})", lambda digest: digest[2][:8], model)


def as_json(entry: Entry) -> dict[str, Any]:
    return {
        "name": entry.name,
        "path": str(entry.path),
        "kind": entry.kind,
        "model": entry.model,
        "method": entry.method,
        "size_bytes": entry.size,
        "last_used": datetime.fromtimestamp(entry.last_used, timezone.utc).isoformat(timespec="seconds"),
        "registry": None if entry.aliases is None else list(entry.aliases),
    }
