"""Content-addressed cache: a checkpoint's key hashes everything that decides its bytes. Each is
written beside its final place and renamed into it once complete, so a crash leaves only a
`.partial-*` directory, never taken for a result and removed by the next writer on that host.
The completion marker records each file's size and SHA-256: reuse checks sizes and safetensors
headers before loading, then the hashes in the background while the variant loads and evaluates it (`PayloadCheck`);
`quantlab cache verify` checks the hashes of all. A checkpoint that fails is set aside.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

COMPLETE_MARKER = "quantlab-checkpoint.json"
# Scratch directories beside a checkpoint, named `<name><kind><host>-<pid>` after the process using them:
# a writer's, renamed into place when complete, and a pruner's, a checkpoint renamed aside to be deleted.
PARTIAL, PRUNING = ".partial-", ".pruning-"
logger = logging.getLogger(__name__)
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
    if directory is not None:
        with suppress(OSError, ValueError):  # absent, or unreadable: the caller computes it again
            return json.loads((directory / f"{cache_key(identity)}.json").read_text())
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


TASK_FILE_SUFFIXES = (".yaml", ".yml", ".jsonl", ".json", ".py")


def tasks_digest(directory: Path | None) -> str | None:
    """Hash of the lm-eval task files (YAML, data, helper code) under a task directory."""
    if directory is None:
        return None
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        # lm-eval's `include:` templates are named *_yaml, so that its task index does not load them as tasks
        if path.is_file() and (path.suffix in TASK_FILE_SUFFIXES or path.name.endswith("_yaml")):
            digest.update(str(path.relative_to(directory)).encode() + path.read_bytes())
    return digest.hexdigest()


def checkpoint_dir(cache_root: Path, variant_name: str, key: str) -> Path:
    return cache_root / "checkpoints" / f"{variant_name}-{key}"


@dataclass(frozen=True)
class FileRecord:
    """One file of a checkpoint as its writer left it (path relative to the checkpoint)."""

    path: str
    size: int
    sha256: str


def file_sha256(path: Path, advance: Callable[[int], object] = lambda n: None) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as stream:
        while chunk := stream.read(1 << 23):
            digest.update(chunk)
            advance(len(chunk))
    return digest.hexdigest()


def recorded_files(checkpoint: Path) -> list[FileRecord] | None:
    """The files its marker records; None for a marker without records (an older quantlab's) or unreadable."""
    with suppress(OSError, ValueError, KeyError, TypeError):
        return [FileRecord(**record) for record in json.loads((checkpoint / COMPLETE_MARKER).read_text())["files"]]
    return None


def _safetensors_problem(path: Path, size: int) -> str | None:
    """Whether the header parses and its tensors end exactly where the file does."""
    try:
        with path.open("rb") as stream:
            length = int.from_bytes(stream.read(8), "little")
            if size < 8 or 8 + length > size:
                return f"{path.name}: safetensors header length {length} does not fit in {size} bytes"
            header = json.loads(stream.read(length))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return f"{path.name}: safetensors header does not parse"
    if end != size - 8 - length:
        return f"{path.name}: tensors end at byte {end} of data, the file holds {size - 8 - length}"
    return None


def check_checkpoint(
    checkpoint: Path, deep: bool = False, advance: Callable[[int], object] = lambda n: None
) -> list[str]:
    """Problems of a checkpoint that carries its marker: files missing or of another size, safetensors
    headers that do not match their file; with `deep`, contents whose SHA-256 differs from the record
    (`advance` is told the bytes read)."""
    records = recorded_files(checkpoint)
    if records is None:
        return ["its marker records no files (an older quantlab wrote it), so it cannot be verified"]
    problems = []
    for record in records:
        path = checkpoint / record.path
        if not path.is_file():
            problems.append(f"{record.path}: missing")
        elif (size := path.stat().st_size) != record.size:
            problems.append(f"{record.path}: {size} bytes, {record.size} recorded")
        elif path.suffix == ".safetensors" and (problem := _safetensors_problem(path, size)):
            problems.append(problem)
    if deep and not problems:
        problems = [
            f"{r.path}: SHA-256 differs from the record"
            for r in records
            if file_sha256(checkpoint / r.path, advance) != r.sha256
        ]
    return problems


def set_aside(checkpoint: Path) -> Path:
    """Rename a bad checkpoint to `<name>.corrupt-<UTC time>`: never loaded, never silently deleted."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    aside = checkpoint.with_name(f"{checkpoint.name}.corrupt-{stamp}")
    with suppress(FileNotFoundError):  # another process set it aside first
        os.replace(checkpoint, aside)
    return aside


class CheckpointChanged(RuntimeError):
    """A reused checkpoint whose payload differs from what its writer recorded (one line: the variant's failure)."""


class PayloadCheck:
    """A reused checkpoint's files hashed against the SHA-256s its writer recorded, in a background thread while
    the variant loads and evaluates it (reuse itself checks sizes and headers only: `is_complete`). The thread runs
    at the lowest CPU priority, and SHA-256 releases the GIL: it takes what the variant leaves idle. None: nothing
    to check (a checkpoint just written was hashed as it was written)."""

    def __init__(self, checkpoint: Path | None):
        self.checkpoint = checkpoint
        self._problems: list[str] = []
        self._thread = None
        if checkpoint is not None:
            self._thread = threading.Thread(target=self._hash, name=f"sha256 {checkpoint.name}", daemon=True)
            self._thread.start()

    def _hash(self) -> None:
        with suppress(OSError, AttributeError):  # Linux gives each thread its own nice value
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            self._problems = check_checkpoint(self.checkpoint, deep=True)
        except OSError as error:  # a file gone or unreadable meanwhile
            self._problems = [f"reading it failed ({error})"]

    def confirm(self) -> None:
        """Wait for the hashes; when they differ from the record, set the checkpoint aside (the next sweep rebuilds
        it) and raise CheckpointChanged: nothing measured on it may be logged."""
        if self._thread is None:
            return
        self._thread.join()
        if self._problems:
            aside = set_aside(self.checkpoint)
            raise CheckpointChanged(
                f"the cached checkpoint {self.checkpoint.name} changed on disk since it was written "
                f"({'; '.join(self._problems)}); set aside as {aside.name}, the next sweep rebuilds it"
            )


def complete_checkpoints(cache_root: Path) -> list[Path]:
    """The cache's checkpoints that carry a marker (checked or not), not those set aside or being written."""
    markers = (cache_root / "checkpoints").glob(f"*/{COMPLETE_MARKER}")
    scratch = (".corrupt-", PARTIAL, PRUNING)
    return sorted(m.parent for m in markers if not any(kind in m.parent.name for kind in scratch))


def mark_used(checkpoint: Path) -> None:
    """Record that `checkpoint` is used now: its marker's mtime (the marker is not among the files it
    records, so its checks are unchanged). A cache this process may not write keeps the older time."""
    with suppress(OSError):
        os.utime(checkpoint / COMPLETE_MARKER)


def last_used(checkpoint: Path) -> float:
    """When `checkpoint` was last reused or written (seconds since the epoch; see `mark_used`)."""
    return (checkpoint / COMPLETE_MARKER).stat().st_mtime


def scratch_owner(directory: Path) -> tuple[str, int] | None:
    """The host and pid a `.partial-` or `.pruning-` directory is named after; None for other names."""
    for kind in (PARTIAL, PRUNING):
        _, found, owner = directory.name.rpartition(kind)
        host, _, pid = owner.rpartition("-")
        if found and host and pid.isdigit():
            return host, int(pid)
    return None


def is_abandoned(directory: Path) -> bool:
    """Whether a scratch directory's process, one of this host, is gone. Another host's (a cache shared by
    a Ray cluster) only that host can judge: never abandoned here."""
    import psutil

    owner = scratch_owner(directory)
    return owner is not None and owner[0] == socket.gethostname() and not psutil.pid_exists(owner[1])


def is_complete(checkpoint: Path) -> bool:
    """Whether `checkpoint` carries its marker and passes the cheap check; one that fails is
    reported (a logged warning) and set aside, so the caller rebuilds it. A complete one is marked used
    (`mark_used`): callers ask in order to reuse it."""
    if not (checkpoint / COMPLETE_MARKER).is_file():
        return False
    if problems := check_checkpoint(checkpoint):
        aside = set_aside(checkpoint)
        logger.warning(
            "cached checkpoint %s: %s; set aside as %s, rebuilding it", checkpoint, "; ".join(problems), aside.name
        )
        return False
    mark_used(checkpoint)
    return True


@contextmanager
def atomic_directory(target: Path, *, replace_existing: bool = False) -> Iterator[Path]:
    """Yield an empty scratch directory beside `target` (same file system, so the final rename is
    atomic); on success it becomes `target`, on failure it is removed. An existing `target` is
    replaced with `replace_existing`; otherwise a complete one another process wrote first wins."""
    target.parent.mkdir(parents=True, exist_ok=True)
    # Scratch directories are named by writer, `<target>.partial-<host>-<pid>`: those that dead processes
    # of this host left (as large as the result) are removed (`is_abandoned`).
    for abandoned in target.parent.glob(f"{target.name}{PARTIAL}*"):
        if is_abandoned(abandoned):
            shutil.rmtree(abandoned, ignore_errors=True)
    scratch = target.with_name(f"{target.name}{PARTIAL}{socket.gethostname()}-{os.getpid()}")
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
            # first, with the same content, so ours is dropped (a bad one is set aside for ours).
            if is_complete(target):
                shutil.rmtree(scratch)
            else:
                os.replace(scratch, target)
    except BaseException as error:
        written = _tree_bytes(scratch)
        shutil.rmtree(scratch, ignore_errors=True)
        if _out_of_space(error):
            free = shutil.disk_usage(target.parent).free
            raise NotEnoughSpace(
                f"{target.parent}: the file system filled up while writing {target.name} ({written:,} bytes of it "
                f"written, now removed; {free:,} bytes free): free space there (`quantlab cache prune` removes the "
                "checkpoints no sweep used lately) or point --cache-dir / QUANTLAB_CACHE_DIR at a larger disk"
            ) from error
        raise


class NotEnoughSpace(OSError):
    """Too little free space for what the cache is to hold: found before writing (`quantlab.disk`'s estimate) or
    while writing (ENOSPC, the partial copy removed). An OSError with errno ENOSPC; its text says what to free."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror

    def __reduce__(self):  # pickled (Ray) by its message alone
        return type(self), (self.strerror,)


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


def _out_of_space(error: BaseException | None) -> bool:
    """Whether `error`, or what caused it, is a full disk or quota: an OSError's errno, or the OS's words for it in
    another library's error (safetensors' writer raises `SafetensorError("... No space left on device (os error 28)")`)."""
    words = [os.strerror(number) for number in _NO_SPACE]
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if (isinstance(error, OSError) and error.errno in _NO_SPACE) or any(w in str(error) for w in words):
            return True
        error = error.__cause__ or error.__context__
    return False


def _tree_bytes(directory: Path) -> int:
    with suppress(OSError):
        return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())
    return 0


def lock_file(checkpoint: Path) -> Path:
    """The lock file of a checkpoint's key, beside it while a process builds it: `<name>.lock`."""
    return checkpoint.with_name(f"{checkpoint.name}.lock")


@contextmanager
def building(checkpoint: Path) -> Iterator[None]:
    """Hold the key's lock file exclusively, so that one process at a time builds `checkpoint` (re-check
    `is_complete` inside: who waited reuses what the other built). A POSIX record lock (`fcntl.lockf`), which
    local file systems and NFS (v3 with lockd, v4) hold across processes and hosts; released when its process
    ends, however it ends. Where the file system refuses locks, the build goes ahead unlocked: two may build at
    once, and the atomic rename keeps one complete copy."""
    import fcntl
    import time

    path = lock_file(checkpoint)
    path.parent.mkdir(parents=True, exist_ok=True)
    lock, waiting_since = None, None
    while lock is None:
        candidate = open(path, "a")  # noqa: SIM115 - held open past this block: closing it releases the lock
        try:
            fcntl.lockf(candidate, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EAGAIN):  # e.g. ENOLCK: an NFS mount without lockd
                candidate.close()
                logger.warning("cannot lock %s (%s): building %s without the lock", path, error, checkpoint.name)
                break
            if waiting_since is None:
                # A warning, to reach the variant's log: its process sets up no logging, and Python's
                # last-resort handler writes warnings (only) to stderr, which is that log.
                logger.warning("waiting for another process building the same checkpoint %s", checkpoint)
                waiting_since = time.monotonic()
            try:
                fcntl.lockf(candidate, fcntl.LOCK_EX)
            except BaseException:
                candidate.close()
                raise
        # Each holder removes the file when done (no litter beside the checkpoints): a lock taken on a file
        # removed meanwhile guards nothing, so it is taken again on the file now at `path`.
        if _still_at(path, candidate):
            lock = candidate
        else:
            candidate.close()
    if lock is None:  # this file system takes no locks
        yield
        return
    if waiting_since is not None:
        logger.warning("took the lock of %s after %.0f s", checkpoint.name, time.monotonic() - waiting_since)
    try:
        yield
    finally:
        with suppress(FileNotFoundError):
            os.unlink(path)  # still holding it: whoever waits on this file takes the lock on a new one
        lock.close()  # releases it


def _still_at(path: Path, stream: Any) -> bool:
    """Whether the open file `stream` is the one at `path` now (not removed, nor replaced)."""
    opened = os.fstat(stream.fileno())
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    return (now.st_ino, now.st_dev) == (opened.st_ino, opened.st_dev)


@contextmanager
def writing(checkpoint: Path, identity: dict[str, Any]) -> Iterator[Path]:
    """A checkpoint written atomically, with the completion marker that `is_complete` reads: its
    identity and each file's size and SHA-256. The marker's mtime is the checkpoint's last use (`mark_used`)."""
    with atomic_directory(checkpoint) as scratch:
        yield scratch
        files = sorted(path for path in scratch.rglob("*") if path.is_file())
        records = [FileRecord(p.relative_to(scratch).as_posix(), p.stat().st_size, file_sha256(p)) for p in files]
        marker = {"identity": identity, "files": [asdict(record) for record in records]}
        (scratch / COMPLETE_MARKER).write_text(json.dumps(marker, indent=2, sort_keys=True, default=str))
    mark_used(checkpoint)  # ours, or the equal one another process finished first
