"""The checkpoint cache checks itself: sizes and safetensors headers on reuse, hashes on `cache verify`;
a bad checkpoint is set aside (renamed, never deleted, never loaded) and rebuilt."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_quantize import _variant

from quantlab import cache
from quantlab.models import load_checkpoint, resolve_source
from quantlab.recipe import CalibrationSettings, ModelSpec
from quantlab.stages.quantize import QuantizedCheckpoint, quantize_variant


def _write(cache_root: Path, name: str = "w") -> Path:
    checkpoint = cache.checkpoint_dir(cache_root, name, "0123")
    with cache.writing(checkpoint, {"name": name}) as scratch:
        save_file({"w": torch.randn(64, 64), "b": torch.zeros(8)}, scratch / "model.safetensors")
        (scratch / "config.json").write_text("{}")
    return checkpoint


def _truncate(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])


def _flip_a_data_bit(checkpoint: Path) -> None:
    weights = checkpoint / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # inside the tensor data: same size, header intact
    weights.write_bytes(bytes(data))


def _overwrite(offset: int, new: bytes):
    def damage(checkpoint: Path) -> None:
        weights = checkpoint / "model.safetensors"
        data = bytearray(weights.read_bytes())
        data[offset : offset + len(new)] = new
        weights.write_bytes(bytes(data))

    return damage


def _old_marker(checkpoint: Path) -> None:
    (checkpoint / cache.COMPLETE_MARKER).write_text(json.dumps({"name": "w"}))


DAMAGES = {  # damage: (what the cheap check says, what the deep check says); None: passes
    "truncated": (_truncate, "bytes,", "bytes,"),
    "bit flipped in the data": (_flip_a_data_bit, None, "SHA-256 differs"),
    "header length too large": (_overwrite(0, (1 << 40).to_bytes(8, "little")), "does not fit", "does not fit"),
    "header not JSON": (_overwrite(8, b"#"), "does not parse", "does not parse"),
    "file removed": (lambda c: (c / "config.json").unlink(), "config.json: missing", "config.json: missing"),
    "old marker": (_old_marker, "older quantlab", "older quantlab"),
}


def test_fresh_checkpoint_records_its_files_and_passes_both_checks(tmp_path):
    checkpoint = _write(tmp_path)
    records = {record.path: record for record in cache.recorded_files(checkpoint)}
    assert set(records) == {"model.safetensors", "config.json"}
    for name, record in records.items():
        content = (checkpoint / name).read_bytes()
        assert (record.size, record.sha256) == (len(content), hashlib.sha256(content).hexdigest())
    assert cache.check_checkpoint(checkpoint) == [] and cache.check_checkpoint(checkpoint, deep=True) == []
    assert cache.is_complete(checkpoint)


@pytest.mark.parametrize(("damage", "cheap", "deep"), DAMAGES.values(), ids=DAMAGES.keys())
def test_each_damage_is_found_by_the_check_that_can_see_it(tmp_path, damage, cheap, deep):
    checkpoint = _write(tmp_path)
    damage(checkpoint)
    cheap_problems = cache.check_checkpoint(checkpoint)
    assert (cheap is None and cheap_problems == []) or (cheap and cheap in "; ".join(cheap_problems))
    assert deep in "; ".join(cache.check_checkpoint(checkpoint, deep=True))


@pytest.mark.parametrize(("damage", "said"), [(_truncate, "bytes,"), (_old_marker, "older quantlab")])
def test_reuse_sets_a_failing_checkpoint_aside_and_says_so(tmp_path, caplog, damage, said):
    checkpoint = _write(tmp_path)
    damage(checkpoint)
    with caplog.at_level(logging.WARNING, logger="quantlab.cache"):
        assert not cache.is_complete(checkpoint)
    assert not checkpoint.exists()
    [aside] = checkpoint.parent.glob(f"{checkpoint.name}.corrupt-*")
    assert (aside / "model.safetensors").is_file()  # kept for a look, not deleted
    [record] = caplog.records
    assert str(checkpoint) in record.getMessage() and said in record.getMessage()


def test_quantize_stage_rebuilds_a_truncated_checkpoint_and_never_loads_it(tmp_path, tiny_llama):
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    calibration = CalibrationSettings(num_samples=4, seq_len=32)

    def quantize():
        return quantize_variant(source, _variant(name="b", method="bf16"), calibration, Path.cwd(), tmp_path, "cpu")

    first = quantize()
    weights = first.path / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    again = quantize()
    assert not again.reused and again.path == first.path
    assert (again.path / "model.safetensors").read_bytes() == whole
    assert cache.check_checkpoint(again.path, deep=True) == []
    [aside] = first.path.parent.glob("*.corrupt-*")
    assert (aside / "model.safetensors").stat().st_size == len(whole) // 2
    load_checkpoint(again.path, torch.float32, "cpu")


def _verify(cache_root: Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "quantlab", "cache", "verify", "--cache-dir", str(cache_root)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300)


def test_cache_verify_finds_a_flipped_bit_that_reuse_cannot_see(tmp_path):
    good, flipped = _write(tmp_path, "good"), _write(tmp_path, "flipped")
    _flip_a_data_bit(flipped)
    assert cache.is_complete(flipped)  # sizes and header are intact: only the hashes tell
    found = _verify(tmp_path)
    assert found.returncode == 1, found.stdout + found.stderr
    assert f"{good.name}: ok" in found.stdout
    assert f"{flipped.name}: model.safetensors: SHA-256 differs" in found.stdout
    assert good.exists() and not flipped.exists()
    assert len(list(tmp_path.glob("checkpoints/flipped-0123.corrupt-*"))) == 1
    again = _verify(tmp_path)
    assert again.returncode == 0 and "1 checkpoints checked, 0 bad" in again.stdout


def test_cache_verify_of_a_missing_directory_is_bad_input(tmp_path):
    missing = _verify(tmp_path / "nowhere")
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [f"error: --cache-dir: no cache directory at {tmp_path / 'nowhere'}"]


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (None, None),
        (_flip_a_data_bit, "model.safetensors: SHA-256 differs from the record"),
        (lambda c: (c / "config.json").unlink(), "config.json: missing"),
    ],
)
def test_a_reused_checkpoint_is_hashed_in_the_background_and_set_aside_when_changed(tmp_path, damage, said):
    checkpoint = _write(tmp_path)
    if damage is not None:
        damage(checkpoint)
    check = cache.PayloadCheck(checkpoint)  # started now; the caller goes on meanwhile
    if said is None:
        check.confirm()
        assert checkpoint.exists()
        return
    with pytest.raises(cache.CheckpointChanged) as changed:
        check.confirm()
    message = str(changed.value)
    assert "\n" not in message and said in message and "the next sweep rebuilds it" in message
    assert not checkpoint.exists()
    [aside] = checkpoint.parent.glob(f"{checkpoint.name}.corrupt-*")
    assert aside.name in message


@pytest.mark.parametrize(("reused", "fails"), [(True, True), (False, False)])
def test_only_a_reused_checkpoint_is_hashed_again(tmp_path, reused, fails):
    """A checkpoint the stage just wrote was hashed as it was written (its marker's records)."""
    checkpoint = _write(tmp_path)
    _flip_a_data_bit(checkpoint)
    check = QuantizedCheckpoint(checkpoint, "0123", reused=reused).check_payload()
    if fails:
        with pytest.raises(cache.CheckpointChanged):
            check.confirm()
    else:
        check.confirm()
    assert checkpoint.exists() != fails
