"""`quantlab cache list` and `quantlab cache prune`: what the cache holds, what a prune removes (a pure
selection, table-driven here), and the commands over a real cache and a real MLflow registry."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port
from memory_store import MemoryStore
from rich.console import Console
from safetensors.torch import save_file
from typer.testing import CliRunner

from quantlab import cache, cli, tracking
from quantlab.cache_inventory import (
    ABANDONED,
    CHECKPOINT,
    DAY,
    IN_PROGRESS,
    SET_ASIDE,
    UNMARKED,
    Entry,
    human_size,
    parse_size,
    select,
    short_model,
)

NOW = 1_800_000_000.0


def _entry(name: str, size: int = 100, days: float = 1, aliases=(), kind: str = CHECKPOINT) -> Entry:
    return Entry(Path("/cache/checkpoints") / name, kind, size, NOW - days * DAY, aliases=aliases)


PROD = ("quantlab-tiny@production v3",)
# case: (entries, limits, names removed in order, names kept for an alias)
SELECTIONS = {
    "older than: the old ones, least recent first": (
        [_entry("a", days=10), _entry("b", days=40), _entry("c", days=100)],
        {"older_than_days": 30},
        ["c", "b"],
        [],
    ),
    "older than is strict": ([_entry("a", days=30)], {"older_than_days": 30}, [], []),
    "older than keeps an aliased one": (
        [_entry("a", days=10), _entry("b", days=40), _entry("c", days=100, aliases=PROD)],
        {"older_than_days": 30},
        ["b"],
        ["c"],
    ),
    "force removes an aliased one": (
        [_entry("a", days=10), _entry("b", days=40), _entry("c", days=100, aliases=PROD)],
        {"older_than_days": 30, "force": True},
        ["c", "b"],
        [],
    ),
    "a young aliased one is not reported as kept": (
        [_entry("a", days=1, aliases=PROD), _entry("b", days=40)],
        {"older_than_days": 30},
        ["b"],
        [],
    ),
    "max size: least recently used until the rest fit": (
        [_entry("a", 100, 1), _entry("b", 200, 2), _entry("c", 300, 3)],
        {"max_size": 350},
        ["c"],
        [],
    ),
    "max size: at the limit fits": (
        [_entry("a", 100, 1), _entry("b", 200, 2), _entry("c", 300, 3)],
        {"max_size": 300},
        ["c"],
        [],
    ),
    "max size: under it already, nothing goes": ([_entry("a", 100), _entry("b", 200)], {"max_size": 300}, [], []),
    "max size: an aliased one is skipped, the next ones go": (
        [_entry("a", 100, 1), _entry("b", 200, 2), _entry("c", 300, 3, aliases=PROD)],
        {"max_size": 350},
        ["b", "a"],
        ["c"],
    ),
    "max size 0: all but the aliased": (
        [_entry("a", 100, 1), _entry("b", 200, 2, aliases=PROD), _entry("c", 300, 3)],
        {"max_size": 0},
        ["c", "a"],
        ["b"],
    ),
    "max size 0 with force: all": (
        [_entry("a", 100, 1), _entry("b", 200, 2, aliases=PROD), _entry("c", 300, 3)],
        {"max_size": 0, "force": True},
        ["c", "b", "a"],
        [],
    ),
    "equal last use: by name": ([_entry("b", days=5), _entry("a", days=5)], {"max_size": 150}, ["a"], []),
    "both limits: the old ones, then by size": (
        [_entry("a", 100, 1), _entry("b", 200, 2), _entry("c", 300, 50)],
        {"older_than_days": 30, "max_size": 100},
        ["c", "b"],
        [],
    ),
    "registry unknown: every checkpoint is kept, debris goes": (
        [_entry("a", days=40, aliases=None), _entry("x.corrupt-1", kind=SET_ASIDE)],
        {"older_than_days": 30},
        ["x.corrupt-1"],
        ["a"],
    ),
    "debris first whatever the limits; live and foreign directories stay": (
        [
            _entry("a", days=1),
            _entry("a.corrupt-20260101T000000Z", kind=SET_ASIDE),
            _entry("b.partial-h-1", kind=ABANDONED),
            _entry("c.partial-h-2", kind=IN_PROGRESS),
            _entry("d", kind=UNMARKED),
        ],
        {"older_than_days": 1000},
        ["a.corrupt-20260101T000000Z", "b.partial-h-1"],
        [],
    ),
    "only checkpoints count toward the size": (
        [_entry("a", 100), _entry("b.partial-h-2", 10_000, kind=IN_PROGRESS), _entry("c", 10_000, kind=UNMARKED)],
        {"max_size": 100},
        [],
        [],
    ),
}


@pytest.mark.parametrize("case", SELECTIONS)
def test_selection(case):
    entries, limits, removed, kept = SELECTIONS[case]
    plan = select(entries, now=NOW, **limits)
    assert [entry.name for entry in plan.remove] == removed
    assert [entry.name for entry, _ in plan.kept] == kept
    left = [e for e in entries if e.kind == CHECKPOINT and e.name not in removed]
    assert plan.size_after == sum(entry.size for entry in left)
    for entry, why in plan.kept:
        assert "--force" in why and (entry.aliases is None or entry.aliases[0] in why)


def test_selection_needs_a_limit():
    with pytest.raises(ValueError):
        select([_entry("a")], now=NOW)


@pytest.mark.parametrize(
    "text, size",
    [("0", 0), ("123", 123), ("500M", 500 << 20), ("20G", 20 << 30), ("1.5T", 3 << 39), ("20GiB", 20 << 30)]
    + [("2 kb", 2048), ("7B", 7)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "G", "-1G", "1x", "12 parsecs"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError, match="500M"):
        parse_size(text)


def _write(cache_root: Path, name: str, floats: int, last_used: float) -> Path:
    checkpoint = cache.checkpoint_dir(cache_root, name, "0123")
    identity = {"model": "hub:HuggingFaceTB/SmolLM2-135M@main", "method": name}
    with cache.writing(checkpoint, identity) as scratch:
        save_file({"w": torch.zeros(floats)}, scratch / "model.safetensors")
        (scratch / "config.json").write_text("{}")
    os.utime(checkpoint / cache.COMPLETE_MARKER, (last_used, last_used))
    return checkpoint


def _recorded(checkpoint: Path) -> int:
    return sum(record.size for record in cache.recorded_files(checkpoint))


def test_reuse_and_writing_record_the_last_use(tmp_path):
    before = time.time() - 1
    checkpoint = _write(tmp_path, "bf16", 16, last_used=1_000_000)
    assert cache.last_used(checkpoint) == 1_000_000
    assert cache.is_complete(checkpoint)
    assert cache.last_used(checkpoint) >= before
    assert cache.check_checkpoint(checkpoint, deep=True) == []  # the marker's records are unchanged
    fresh = cache.checkpoint_dir(tmp_path, "fp8", "4567")
    with cache.writing(fresh, {"k": 1}) as scratch:
        (scratch / "weights.bin").write_bytes(b"w")
    assert cache.last_used(fresh) >= before


@pytest.fixture(params=["memory", "mlflow"])
def store(request, tmp_path):
    if request.param == "memory":
        return MemoryStore()
    return tracking.open_store(f"sqlite:///{tmp_path / 'mlflow.db'}")


def _register(store, checkpoint: Path, alias: str | None, model: str = "quantlab-tiny") -> None:
    experiment = store.experiment_id("tiny")
    tags = {tracking.CHECKPOINT: str(checkpoint), tracking.CONTENT_KEY: checkpoint.name}
    run = store.run(store.start_run(experiment, checkpoint.name, tags))
    if alias is None:
        store.create_model_version(model, checkpoint.resolve().as_uri(), run.run_id, tags)
    else:
        tracking.register_checkpoint(store, model, alias, run, {})


def test_registered_checkpoints_are_those_an_alias_points_at(store, tmp_path):
    chosen, unaliased = tmp_path / "fp8-1", tmp_path / "awq-2"
    _register(store, chosen, "production")
    _register(store, unaliased, None)
    store.set_alias("quantlab-tiny", "staging", "1")
    assert tracking.registered_checkpoints(store) == {
        str(chosen): ["quantlab-tiny@production v1", "quantlab-tiny@staging v1"]
    }


def _dead_pid() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


@pytest.fixture
def populated(tmp_path):
    """A cache of three checkpoints (bf16 used last, fp8 in between and aliased, awq first), one set aside,
    a dead writer's and a dead pruner's scratch, a live writer's; a SQLite store whose registry has fp8."""
    root, now, host = tmp_path / "cache", time.time(), socket.gethostname()
    made = {
        name: _write(root, name, floats, now - days * DAY)
        for name, floats, days in (("awq", 3000, 30), ("fp8", 2000, 20), ("bf16", 1000, 10))
    }
    debris = {
        "set aside": made["bf16"].with_name(f"{made['bf16'].name}.corrupt-20260101T000000Z"),
        "dead writer": made["bf16"].with_name(f"{made['bf16'].name}.partial-{host}-{_dead_pid()}"),
        "dead pruner": made["awq"].with_name(f"{made['awq'].name}.pruning-{host}-{_dead_pid()}"),
        "live writer": made["fp8"].with_name(f"{made['fp8'].name}.partial-{host}-{os.getpid()}"),
    }
    for directory in debris.values():
        directory.mkdir()
        (directory / "model.safetensors").write_bytes(b"x" * 500)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _register(tracking.open_store(uri), made["fp8"], "production")
    return root, uri, made, debris


def _quantlab(*args: str):
    result = CliRunner().invoke(cli.app, list(args))
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def test_list_shows_every_directory_and_the_alias(populated, monkeypatch):
    root, uri, made, debris = populated
    listed = json.loads(_quantlab("cache", "list", "--cache-dir", str(root), "--tracking-uri", uri, "--json").stdout)
    assert listed["registry_unknown"] is None
    by_name = {entry["name"]: entry for entry in listed["entries"]}
    assert by_name[made["fp8"].name]["registry"] == ["quantlab-tiny@production v1"]
    assert by_name[made["awq"].name]["registry"] == by_name[made["bf16"].name]["registry"] == []
    for name, checkpoint in made.items():
        entry = by_name[checkpoint.name]
        assert (entry["kind"], entry["method"], entry["size_bytes"]) == (CHECKPOINT, name, _recorded(checkpoint))
        assert entry["model"] == "hub:HuggingFaceTB/SmolLM2-135M@main"
    kinds = {"set aside": SET_ASIDE, "dead writer": ABANDONED, "dead pruner": ABANDONED, "live writer": IN_PROGRESS}
    for what, directory in debris.items():
        assert (by_name[directory.name]["kind"], by_name[directory.name]["size_bytes"]) == (kinds[what], 500)
    assert len(by_name) == 7

    monkeypatch.setattr(cli, "out", Console(width=300, soft_wrap=True, highlight=False))
    table = _quantlab("cache", "list", "--cache-dir", str(root), "--tracking-uri", uri).stdout
    (fp8_row,) = [line for line in table.splitlines() if made["fp8"].name + " " in line]
    assert "quantlab-tiny@production v1" in fp8_row and "20 d ago" in fp8_row
    assert "3 checkpoints" in table and "3 set aside or abandoned" in table


def _names(root: Path) -> set[str]:
    return {path.name for path in (root / "checkpoints").iterdir()}


def test_prune_keeps_what_an_alias_points_at_unless_forced(populated):
    root, uri, made, debris = populated
    everything, sizes = _names(root), {name: _recorded(checkpoint) for name, checkpoint in made.items()}
    common = ["cache", "prune", "--cache-dir", str(root), "--tracking-uri", uri]

    dry = _quantlab(*common, "--max-size", "0", "--dry-run")
    assert dry.exit_code == 0 and _names(root) == everything
    assert f"would remove {made['awq'].name} " in dry.stdout and "would free" in dry.stdout

    aged = _quantlab(*common, "--older-than", "25")
    assert aged.exit_code == 0, aged.stdout
    gone = {debris[what].name for what in ("set aside", "dead writer", "dead pruner")} | {made["awq"].name}
    assert _names(root) == everything - gone

    pruned = _quantlab(*common, "--max-size", "0")
    assert pruned.exit_code == 0, pruned.stdout
    assert _names(root) == {made["fp8"].name, debris["live writer"].name}
    assert f"removed {made['bf16'].name} " in pruned.stdout
    assert f"kept {made['fp8'].name}" in pruned.stdout and "quantlab-tiny@production v1" in pruned.stdout
    assert f"freed {human_size(sizes['bf16'])};" in pruned.stdout

    forced = _quantlab(*common, "--max-size", "0", "--force")
    assert forced.exit_code == 0 and _names(root) == {debris["live writer"].name}
    assert f"removed {made['fp8'].name} " in forced.stdout


def test_an_unreadable_registry_lists_anyway_and_prunes_no_checkpoint(populated):
    root, _, made, debris = populated
    unreachable = f"http://127.0.0.1:{free_port()}"
    listed = _quantlab("cache", "list", "--cache-dir", str(root), "--tracking-uri", unreachable, "--json")
    assert listed.exit_code == 0
    found = json.loads(listed.stdout)
    assert found["registry_unknown"].startswith("registry unknown") and "\n" not in found["registry_unknown"]
    assert {e["name"]: e["registry"] for e in found["entries"]}[made["awq"].name] is None

    common = ["cache", "prune", "--cache-dir", str(root), "--tracking-uri", unreachable, "--max-size", "0"]
    pruned = _quantlab(*common)
    assert pruned.exit_code == 0
    assert "registry unknown" in pruned.stdout
    assert {path.name for path in made.values()} <= _names(root)
    assert debris["set aside"].name not in _names(root)
    assert _quantlab(*common, "--force").exit_code == 0
    assert not {path.name for path in made.values()} & _names(root)


@pytest.mark.parametrize(
    "flags, option",
    [([], "--older-than/--max-size"), (["--max-size", "lots"], "--max-size"), (["--older-than", "-1"], "older-than")],
)
def test_prune_without_a_good_limit_is_bad_input(populated, flags, option):
    root, uri, _, _ = populated
    everything = _names(root)
    args = [sys.executable, "-m", "quantlab", "cache", "prune", "--cache-dir", str(root), "--tracking-uri", uri]
    result = subprocess.run([*args, *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert option in result.stderr and "Traceback" not in result.stderr
    assert _names(root) == everything


@pytest.mark.parametrize(
    ("identity", "shown"),
    [
        (
            "gguf:SmolLM2-135M-Instruct.Q4_1.gguf:sha256=" + "b179c9523d0e" * 5,
            "gguf:SmolLM2-135M-Instruct.Q4_1.gguf:b179c952",
        ),
        ("local:/models/tiny:" + "0123456789abcdef" * 2, "local:/models/tiny:01234567"),
        ("hub:HuggingFaceTB/SmolLM2-135M@main", "hub:HuggingFaceTB/SmolLM2-135M@main"),
        (None, "-"),
    ],
)
def test_a_model_identity_is_shown_short(identity, shown):
    assert short_model(identity) == shown
