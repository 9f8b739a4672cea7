"""Disk space and the per-key lock: a checkpoint's size is modeled before it is written, a sweep or a variant that
cannot fit stops before any work and says what to free, a disk that fills up anyway leaves nothing half-written,
and two processes that need one checkpoint build it once.

Real files and processes throughout. "A small disk" is a real 2 MiB tmpfs where this machine lets the test mount
one (root on Linux); elsewhere (a CI container without CAP_SYS_ADMIN) `shutil.disk_usage` is made to report
2 MiB free under a plain directory, and the writes that would fill a real one raise ENOSPC as the kernel would
(see `small_disk` and `WRITERS`): every test runs either way, none is skipped.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors import SafetensorError
from safetensors.torch import save_file
from test_quantize import CALIBRATION, _variant

from quantlab import cache, disk
from quantlab.executors import failure_reason
from quantlab.measure.checkpoint import CheckpointFacts
from quantlab.measure.modeled import ModelShape, WeightCounts, weight_counts
from quantlab.models import checkpoint_identity, resolve_source
from quantlab.recipe import ModelSpec
from quantlab.stages import quantize as quantize_stage
from quantlab.stages.quantize import quantize_variant
from recipes import tiny_recipe, write

MiB = 1 << 20
SMALL = 2 * MiB

# A shape small enough to count by hand: 2 layers of hidden 64, 4 query and 2 KV heads of 16, MLP 128, vocab 512.
SHAPE = ModelShape(64, 2, 4, 2, 16, 128, 512, tie_word_embeddings=True)
LINEAR = 2 * (2 * 64 * (4 + 2) * 16 + 3 * 64 * 128)  # q,o + k,v and gate, up, down per layer: 73,728 weights
OTHERS = 512 * 64 + 2 * 2 * 64 + 64  # tied embedding, two norms per layer, the final norm: 33,088, kept in BF16
ROWS = 2 * ((4 + 2 * 2) * 16 + 2 * 64 + 2 * 128)  # output channels of the 7 linear layers per layer: 1,024
ASYMMETRIC = LINEAR // 64  # an INT4 zero point per group of 32, packed 8 per int32
ESTIMATES = [  # method, params, tensor bytes of the checkpoint
    ("bf16", {}, 2 * (LINEAR + OTHERS)),
    ("fp8", {}, LINEAR + 2 * ROWS + 2 * OTHERS),  # E4M3 weights, a BF16 scale per output channel
    # INT4 packed 8 per int32, a BF16 scale per group of inputs, an int64 shape per linear layer (14)
    ("awq_int4", {"group_size": 32}, LINEAR // 2 + 2 * LINEAR // 32 + 16 * 14 + 2 * OTHERS),
    ("awq_int4", {"group_size": 64}, LINEAR // 2 + 2 * LINEAR // 64 + 16 * 14 + 2 * OTHERS),
    (
        "awq_int4",
        {"group_size": 32, "symmetric": False},
        LINEAR // 2 + 2 * LINEAR // 32 + ASYMMETRIC + 16 * 14 + 2 * OTHERS,
    ),
    # GPTQ W4A16 stores what AWQ does (no g_idx)
    ("gptq_int4", {"group_size": 32}, LINEAR // 2 + 2 * LINEAR // 32 + 16 * 14 + 2 * OTHERS),
    (
        "gptq_int4",
        {"group_size": 32, "symmetric": False, "actorder": None},
        LINEAR // 2 + 2 * LINEAR // 32 + ASYMMETRIC + 16 * 14 + 2 * OTHERS,
    ),
    ("int8", {}, LINEAR + 2 * ROWS + 2 * OTHERS),  # INT8 weights, a BF16 scale per output channel
    ("int8", {"rtn": True, "smoothing_strength": 0.5}, LINEAR + 2 * ROWS + 2 * OTHERS),
    # issue 29's formats: FP4 packed two per byte; NVFP4 an FP8 scale per 16 and an FP32 global scale per layer
    ("nvfp4", {}, LINEAR // 2 + LINEAR // 16 + 4 * 14 + 2 * OTHERS),
    ("nvfp4a16", {}, LINEAR // 2 + LINEAR // 16 + 4 * 14 + 2 * OTHERS),
    ("mxfp4", {}, LINEAR // 2 + LINEAR // 32 + 2 * OTHERS),  # an E8M0 byte per 32
    ("mxfp8", {}, LINEAR + LINEAR // 32 + 2 * OTHERS),
    # 64x64 blocks, a BF16 scale each: q, k, v, o one block per layer (k, v: 32 x 64, half a block), gate, up, down two
    ("fp8_block", {"block_size": 64}, LINEAR + 2 * 2 * 10 + 2 * OTHERS),
    ("w4a8_fp8", {"group_size": 64}, LINEAR // 2 + 2 * LINEAR // 64 + 16 * 14 + 2 * OTHERS),  # packed as W4A16's
    # more than lm_head kept unquantized, or a method the table lacks: the BF16 bound
    ("fp8", {"ignore": ["lm_head", "re:.*down_proj$"]}, 2 * (LINEAR + OTHERS)),
    ("some_new_method", {}, 2 * (LINEAR + OTHERS)),
]


def test_weight_counts_by_hand():
    """What every estimate above follows from, counted once from the shape."""
    shapes = ((64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128))  # q k v o gate up down
    assert weight_counts(SHAPE) == WeightCounts(LINEAR + OTHERS, LINEAR, ROWS, layers=2, layer_shapes=shapes)


@pytest.mark.parametrize(("method", "params", "expected"), ESTIMATES, ids=[f"{m}{p}" for m, p, _ in ESTIMATES])
def test_checkpoint_estimate_table(method, params, expected):
    assert disk.checkpoint_bytes(SHAPE, method, params) == expected


def test_estimate_is_exactly_what_the_quantize_stage_writes(tmp_path, tiny_llama):
    """The table against llm-compressor's real output for the tiny Llama: tensor bytes equal; the whole
    directory (tokenizer, configs, headers, marker) within the margin."""
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    shape = disk.model_shape(source)
    for method, params in (
        ("bf16", {}),
        ("fp8", {}),
        ("awq_int4", {"group_size": 32}),
        ("gptq_int4", {"group_size": 32}),
        ("int8", {}),
    ):
        variant = _variant(name=method, method=method, params=params)
        made = quantize_variant(source, variant, CALIBRATION, Path.cwd(), tmp_path, "cpu")
        estimate = disk.checkpoint_bytes(shape, method, params)
        assert CheckpointFacts.from_dir(made.path).payload_bytes == estimate, method
        on_disk = sum(path.stat().st_size for path in made.path.rglob("*") if path.is_file())
        assert estimate < on_disk <= disk.with_margin(estimate), method


ARTIFACT_STORES = {  # tracking URI: where its artifacts go (relative to the working directory), or None
    "sqlite:///mlruns/mlflow.db": "mlruns/artifacts",
    "sqlite:////srv/mlflow/mlflow.db": "/srv/mlflow/artifacts",
    "file:///srv/mlruns": "/srv/mlruns",
    "./mlruns": "mlruns",
    "http://mlflow-host:5000": None,
    "postgresql://user@db/mlflow": None,
    "databricks": None,
}


@pytest.mark.parametrize("uri", ARTIFACT_STORES)
def test_artifact_needs_of_each_store(uri):
    needs = disk.artifact_needs(uri, runs=4)
    expected = ARTIFACT_STORES[uri]
    if expected is None:
        assert needs == []
    else:
        [need] = needs
        assert need.directory == Path(expected).resolve() and need.bytes == 4 * disk.ARTIFACT_BYTES_PER_RUN


@dataclass(frozen=True)
class SmallDisk:
    path: Path
    mounted: bool  # a real 2 MiB tmpfs; else disk_usage reports 2 MiB free under `path` (this process only)

    def quantlab(self, *args: str, cwd: Path) -> subprocess.CompletedProcess:
        """`quantlab ARGS` in a new process that sees this small disk too."""
        command = [sys.executable, "-m", "quantlab", *args]
        if not self.mounted:
            command = [sys.executable, "-c", FAKE_SMALL_DISK, str(self.path), *args]
        return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=600)

    def free(self) -> int:
        return shutil.disk_usage(self.path).free


FAKE_SMALL_DISK = """
import shutil, sys
from pathlib import Path

real, small = shutil.disk_usage, Path(sys.argv.pop(1)).resolve()
shutil.disk_usage = lambda path: shutil._ntuple_diskusage(2 << 20, 0, 2 << 20) if Path(path).resolve().is_relative_to(small) else real(path)
sys.argv[0] = "quantlab"
from quantlab.cli import main
main()
"""


def _fake_usage(small: Path, real=shutil.disk_usage):
    def usage(path):
        if Path(path).resolve().is_relative_to(small.resolve()):
            return shutil._ntuple_diskusage(SMALL, 0, SMALL)
        return real(path)

    return usage


@pytest.fixture
def small_disk(tmp_path, monkeypatch):
    """A 2 MiB file system at tmp_path/small: a tmpfs when `mount` works here (unmounted afterwards), else a
    plain directory that `shutil.disk_usage` reports as having 2 MiB free."""
    path = tmp_path / "small"
    path.mkdir()
    try:
        mount = ["mount", "-t", "tmpfs", "-o", f"size={SMALL}", "tmpfs", str(path)]
        mounted = subprocess.run(mount, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        mounted = False
    if not mounted:
        monkeypatch.setattr(shutil, "disk_usage", _fake_usage(path))
    yield SmallDisk(path, mounted)
    if mounted:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def test_needs_on_one_file_system_add_up(small_disk, tmp_path):
    fits = disk.Need(small_disk.path / "a", MiB, "a")
    assert disk.shortfalls([fits]) == []
    [(need, message)] = disk.shortfalls([fits, disk.Need(small_disk.path / "b", MiB + 4096, "b")])
    assert need is fits and f"{2 * MiB + 4096:,} bytes) needed" in message
    if small_disk.mounted:  # another file system's needs do not (a fake small disk shares tmp_path's)
        assert disk.shortfalls([fits, disk.Need(tmp_path / "elsewhere", MiB + 4096, "b")]) == []


def test_quantize_stage_refuses_a_checkpoint_that_cannot_fit_before_loading_the_model(
    small_disk, tiny_llama, monkeypatch
):
    loads = []
    monkeypatch.setattr(quantize_stage, "load_source_model", lambda *args: loads.append(args))
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    variant = _variant(name="bf16", method="bf16")
    with pytest.raises(cache.NotEnoughSpace) as refused:
        quantize_variant(source, variant, CALIBRATION, Path.cwd(), small_disk.path, "cpu")
    assert loads == []
    needed = disk.with_margin(disk.checkpoint_bytes(disk.model_shape(source), "bf16", {}))
    reason = failure_reason(refused.value)  # what the sweep logs as the variant's failure
    assert reason.startswith(f"NotEnoughSpace: {small_disk.path / 'checkpoints'}: the bf16 checkpoint: "), reason
    assert f"({needed:,} bytes) needed" in reason and f"({small_disk.free():,} bytes) free" in reason, reason
    assert "quantlab cache prune" in reason
    assert list((small_disk.path / "checkpoints").iterdir()) == []  # nor a lock file left


def _no_runs(uri: str) -> bool:
    client = MlflowClient(uri)
    return not client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.mark.parametrize("where", ["cache", "store"])
def test_a_sweep_that_cannot_fit_is_bad_input_before_any_run(small_disk, tmp_path, tiny_llama, where):
    """Three checkpoints (bf16, fp8, awq) need about 3 x 23 MiB, the MLflow artifacts of four runs 4 x 16 MiB:
    either on the small disk stops the sweep with exit 2 and one line, and leaves no run."""
    recipe = tiny_recipe(tiny_llama.path, evals={"tasks": []}, quality={"enabled": False})
    path = write(tmp_path / "recipe.yaml", recipe)
    db = (small_disk.path if where == "store" else tmp_path) / "mlflow.db"
    cache_root = small_disk.path / "cache" if where == "cache" else tmp_path / "cache"
    uri = f"sqlite:///{db}"
    assert _no_runs(uri)  # creates the store now: MLflow says so on stderr, beside the one line under test
    result = small_disk.quantlab(
        "sweep", str(path), "--tracking-uri", uri, "--cache-dir", str(cache_root), cwd=tmp_path
    )
    assert result.returncode == 2, result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    line = lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    if where == "cache":
        # (without a mount the store's directory shares the file system, and so the line)
        assert line.startswith(f"error: --cache-dir: {cache_root / 'checkpoints'}"), line
        assert "3 checkpoints to build (bf16, fp8, awq)" in line
        assert "quantlab cache prune" in line
    else:  # with the cache on the same file system (no mount here), both are named in one line
        assert f"{small_disk.path / 'artifacts'}" in line and "the MLflow artifacts of 4 runs" in line, line
        assert "--tracking-uri" in line
    assert "bytes) needed" in line and "bytes) free" in line
    assert not (cache_root / "checkpoints").exists()
    assert _no_runs(uri)


def _safetensors_too_big(scratch: Path, mounted: bool) -> None:
    if mounted:
        save_file({"w": torch.zeros(MiB)}, scratch / "model.safetensors")  # 4 MiB on a 2 MiB disk
        return
    (scratch / "model.safetensors").write_bytes(bytes(MiB))
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _file_too_big(scratch: Path, mounted: bool) -> None:
    with (scratch / "model.bin").open("wb") as stream:
        stream.write(bytes(MiB))
        if mounted:
            stream.write(bytes(3 * MiB))  # 4 MiB on a 2 MiB disk
            stream.flush()
            return
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


WRITERS = {  # how a write fills the disk: for real on the tmpfs; else it raises what the real one did here
    "safetensors": _safetensors_too_big,  # its Rust writer: SafetensorError naming "os error 28"
    "python file": _file_too_big,  # OSError(ENOSPC)
}


@pytest.mark.parametrize("writer", WRITERS)
def test_a_disk_that_fills_up_while_writing_leaves_nothing_and_says_what_to_free(small_disk, writer):
    target = cache.checkpoint_dir(small_disk.path, "big", "0123")
    with pytest.raises(cache.NotEnoughSpace) as full, cache.writing(target, {"name": "big"}) as scratch:
        (scratch / "config.json").write_text("{}")
        WRITERS[writer](scratch, small_disk.mounted)
        pytest.fail("the write fit")  # pragma: no cover
    assert full.value.errno == errno.ENOSPC
    message = str(full.value)
    assert message.startswith(f"{target.parent}: the file system filled up while writing {target.name} ("), message
    assert f"{small_disk.free():,} bytes free" in message and "quantlab cache prune" in message
    assert not target.exists() and list(target.parent.glob("*.partial-*")) == []


def test_a_variant_whose_disk_fills_up_fails_with_what_to_free(small_disk, tiny_llama, monkeypatch):
    """The estimate let through (as when another writer takes the space meanwhile); then the disk fills up."""
    monkeypatch.setattr(disk, "require", lambda needs: None)
    if not small_disk.mounted:
        from transformers import PreTrainedModel

        def full(self, directory, **kwargs):
            (Path(directory) / "model.safetensors").write_bytes(bytes(MiB))
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(PreTrainedModel, "save_pretrained", full)
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    with pytest.raises(cache.NotEnoughSpace) as failed:
        quantize_variant(source, _variant(name="bf16", method="bf16"), CALIBRATION, Path.cwd(), small_disk.path, "cpu")
    checkpoints = small_disk.path / "checkpoints"
    assert failure_reason(failed.value).startswith(f"NotEnoughSpace: {checkpoints}: the file system filled up")
    assert list(checkpoints.iterdir()) == []


WORKER = """
import json, sys
from pathlib import Path
from pydantic import TypeAdapter
from quantlab.models import resolve_source
from quantlab.recipe import CalibrationSettings, ModelSpec, VariantSpec
from quantlab.stages.quantize import quantize_variant

model_dir, cache_root = sys.argv[1:3]
variant = TypeAdapter(VariantSpec).validate_python({"name": "bf16", "method": "bf16"})
source = resolve_source(ModelSpec(source=model_dir), Path.cwd())
made = quantize_variant(source, variant, CalibrationSettings(num_samples=4, seq_len=32), Path.cwd(), Path(cache_root), "cpu")
print(json.dumps({"path": str(made.path), "reused": made.reused, "inode": made.path.stat().st_ino}))
"""
WAITING = "waiting for another process building the same checkpoint"


def _until_both_wait_on(inode: int, workers: list[subprocess.Popen], target: Path) -> None:
    """Until every worker is queued on the lock of file `inode` (the kernel's /proc/locks lists who waits for
    which lock, "->"); a worker that ends or builds meanwhile fails the test. Without /proc/locks (not Linux):
    5 s, ample for a worker that wrongly went ahead to build the tiny checkpoint."""
    deadline = time.monotonic() + (120 if Path("/proc/locks").exists() else 5)
    while time.monotonic() < deadline:
        assert not target.exists() and all(worker.poll() is None for worker in workers)
        if Path("/proc/locks").exists():
            waiting = set()
            for line in Path("/proc/locks").read_text().splitlines():
                if "->" in (fields := line.split()):  # N: -> POSIX ADVISORY WRITE <pid> <major>:<minor>:<inode> ...
                    at = fields.index("->")
                    if int(fields[at + 5].rsplit(":", 1)[1]) == inode:
                        waiting.add(int(fields[at + 4]))
            if waiting >= {worker.pid for worker in workers}:
                return
        time.sleep(0.2)
    if Path("/proc/locks").exists():
        pytest.fail("the workers did not queue on the new lock file")


def test_two_processes_that_need_one_checkpoint_build_it_once(tmp_path, tiny_llama):
    """The test holds the key's lock while two processes start quantizing the same variant into one cache: both
    must queue on it (and say so in their logs). Then it hands the lock over as a finishing holder does (removing
    the file while holding it) to a newcomer that takes the new file at once: who waited on the removed file must
    queue again on the new one, not build. Once that is let go, one builds and the other reuses its copy."""
    cache_root = tmp_path / "cache"
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    identity = checkpoint_identity(source, _variant(name="bf16", method="bf16"), CALIBRATION)
    target = cache.checkpoint_dir(cache_root, "bf16", cache.cache_key(identity))
    target.parent.mkdir(parents=True)
    logs = [tmp_path / f"worker{index}.log" for index in range(2)]
    with open(cache.lock_file(target), "a") as held:
        fcntl.lockf(held, fcntl.LOCK_EX)
        workers = [
            subprocess.Popen(
                [sys.executable, "-c", WORKER, str(tiny_llama.path), str(cache_root)],
                stdout=subprocess.PIPE,
                stderr=log.open("w"),
                text=True,
            )
            for log in logs
        ]
        deadline = time.monotonic() + 300
        while not all(WAITING in log.read_text() for log in logs):
            ended = [log.read_text() for worker, log in zip(workers, logs) if worker.poll() is not None]
            assert not ended, f"a worker ended without waiting for the lock: {ended}"
            assert time.monotonic() < deadline, [log.read_text() for log in logs]
            time.sleep(0.2)
        cache.lock_file(target).unlink()
        with open(cache.lock_file(target), "a") as newcomer:
            fcntl.lockf(newcomer, fcntl.LOCK_EX)
            held.close()  # releases the lock on the removed file
            _until_both_wait_on(os.fstat(newcomer.fileno()).st_ino, workers, target)
    made = []
    for worker, log in zip(workers, logs):
        stdout, _ = worker.communicate(timeout=300)
        assert worker.returncode == 0, log.read_text()
        made.append(json.loads(stdout.strip().splitlines()[-1]))
    assert sorted(m["reused"] for m in made) == [False, True]  # one build, one reuse
    assert {m["path"] for m in made} == {str(target)} and {m["inode"] for m in made} == {target.stat().st_ino}
    assert cache.is_complete(target) and cache.check_checkpoint(target, deep=True) == []
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # the lock file goes with its last holder


def test_a_file_system_without_locks_builds_anyway_and_says_so(tmp_path, tiny_llama, monkeypatch, caplog):
    """As on an NFS mount without lockd (`lockf` fails with ENOLCK): the checkpoint is built unlocked."""

    def no_locks(stream, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "lockf", no_locks)
    source = resolve_source(ModelSpec(source=str(tiny_llama.path)), Path.cwd())
    made = quantize_variant(source, _variant(name="bf16", method="bf16"), CALIBRATION, Path.cwd(), tmp_path, "cpu")
    assert not made.reused and cache.is_complete(made.path)
    assert "without the lock" in caplog.text
