"""Issue 11's faults tried by hand on a recipe (default: the embedded one), with real processes and files.

    .venv/bin/python benchmarks/fault_trials.py --work-dir /tmp/trials server corrupt disk enospc concurrent

Each trial prints its commands' wall times and what it checked:
- server:     a real `mlflow server` is SIGKILLed while the second variant is computed; the sweep ends with
              exit 1 and keeps the unlogged results in the cache; the server starts again on the same store
              and the same command logs them without recomputing (no checkpoint is rewritten).
- corrupt:    (after `server`) one checkpoint's weights truncated, another's with one bit flipped;
              `quantlab cache verify` sets the flipped one aside, the next sweep (a fresh store) sets the
              truncated one aside by itself, rebuilds both and reuses the untouched one.
- disk:       a cache on a 64 MiB tmpfs (needs root): the sweep refuses before any work, exit 2, no run.
- enospc:     a cache on a 2 GiB tmpfs (needs root) that another process fills while fp8's checkpoint is
              written: fp8 fails naming what to free, no partial directory stays, and once the space is
              freed the same command completes, reusing what was built.
- concurrent: two sweeps of the recipe at once on one fresh cache (separate stores): each checkpoint is
              built once, the other sweep waits for it and reuses it.
The GGUF conversion of the embedded model is copied from --sources (default: the user's cache) when there.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mlflow.tracking import MlflowClient

from quantlab.cache import default_root

REPO = Path(__file__).resolve().parents[1]
ROOT_CACHE = default_root()


def sweep_command(recipe: Path, uri: str, cache: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "quantlab",
        "sweep",
        str(recipe),
        "--tracking-uri",
        uri,
        "--cache-dir",
        str(cache),
        *extra,
    ]


def run(command: list[str], label: str, expect: int) -> float:
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.monotonic() - started
    print(f"  {label}: exit {done.returncode} in {seconds:.0f} s")
    tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-8:])
    print("    | " + tail.replace("\n", "\n    | "))
    if done.returncode != expect:
        sys.exit(f"{label}: expected exit {expect}")
    return seconds


def fresh_cache(path: Path, sources: Path) -> Path:
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    if (sources / "sources").is_dir():
        shutil.copytree(sources / "sources", path / "sources")
    return path


def checkpoints(cache: Path) -> dict[str, int]:
    """Complete checkpoint -> its directory's inode (a rebuilt one is a new directory renamed into place;
    the marker's mtime would not do: reuse touches it)."""
    return {p.parent.name: p.parent.stat().st_ino for p in cache.glob("checkpoints/*/quantlab-checkpoint.json")}


def variants_of_latest_sweep(uri: str, experiment: str) -> tuple[str, dict]:
    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    parents = client.search_runs([found.experiment_id], "tags.`quantlab.role` = 'sweep'", order_by=["start_time DESC"])
    children = client.search_runs([found.experiment_id], f"tags.`mlflow.parentRunId` = '{parents[0].info.run_id}'")
    return parents[0].info.status, {run.data.tags["quantlab.variant"]: run for run in children}


class Server:
    def __init__(self, directory: Path):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.directory, self.uri = directory, f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        store, artifacts = f"sqlite:///{self.directory / 'server.db'}", self.directory / "artifacts"
        command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store]
        command += ["--artifacts-destination", str(artifacts), "--port", str(self.port), "--workers", "1"]
        with (self.directory / "server.log").open("a") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            try:
                MlflowClient(self.uri).search_experiments()
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(1)

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


def trial_server(recipe: Path, experiment: str, work: Path, sources: Path) -> None:
    print("server: a tracking server killed mid-sweep")
    directory = work / "server"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    cache = fresh_cache(work / "cache", sources)
    server = Server(directory)
    server.start()
    command = sweep_command(recipe, server.uri, cache, "--log-retry-seconds", "60")
    started = time.monotonic()
    sweep = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"  # this script's own polling (not the sweep's): fail fast
    while True:
        try:
            _, runs = variants_of_latest_sweep(server.uri, experiment)
            if len(runs) >= 2:  # the baseline is logged and the next variant's run started
                break
        except Exception:  # noqa: BLE001 - no sweep yet
            pass
        time.sleep(1)
    server.kill()
    print(f"  server killed {time.monotonic() - started:.0f} s into the sweep, while {sorted(runs)} had runs")
    output, _ = sweep.communicate()
    print(f"  sweep during the outage: exit {sweep.returncode} in {time.monotonic() - started:.0f} s")
    print("    | " + "\n    | ".join(output.strip().splitlines()[-8:]))
    assert sweep.returncode == 1, "expected exit 1"
    kept = sorted(p.parent.name for p in cache.glob("results/*/result.json"))
    before = checkpoints(cache)
    print(f"  kept in the cache: {len(kept)} results; checkpoints: {sorted(before)}")
    server.start()
    run(sweep_command(recipe, server.uri, cache), "same command, server back", expect=0)
    status, runs = variants_of_latest_sweep(server.uri, experiment)
    from_cache = sorted(name for name, r in runs.items() if "quantlab.logged_from_cache" in r.data.tags)
    copied = sorted(name for name, r in runs.items() if "quantlab.reused_from" in r.data.tags)
    print(f"  latest sweep {status}; variants { ({n: r.info.status for n, r in runs.items()}) }")
    print(f"  logged from the cache: {from_cache}; copied from finished runs: {copied}")
    print(
        f"  checkpoints rewritten by the recovery: {sorted(k for k, t in checkpoints(cache).items() if before.get(k) != t)}"
    )
    print(f"  results still kept: {len(list(cache.glob('results/*/result.json')))}")
    server.kill()


def trial_corrupt(recipe: Path, experiment: str, work: Path, sources: Path) -> None:
    print("corrupt: a truncated and a bit-flipped checkpoint")
    cache = work / "cache"
    names = sorted(checkpoints(cache))
    assert len(names) >= 3, "run the server trial first: it fills the cache"
    truncated, flipped = (cache / "checkpoints" / names[1]), (cache / "checkpoints" / names[2])
    weights = next(truncated.glob("*.safetensors"))
    os.truncate(weights, weights.stat().st_size // 2)
    weights = next(flipped.glob("*.safetensors"))
    with weights.open("r+b") as stream:
        stream.seek(weights.stat().st_size // 2)
        byte = stream.read(1)[0]
        stream.seek(-1, os.SEEK_CUR)
        stream.write(bytes([byte ^ 0x10]))
    print(f"  truncated {truncated.name}, flipped one bit of {flipped.name}")
    run([sys.executable, "-m", "quantlab", "cache", "verify", "--cache-dir", str(cache)], "cache verify", expect=1)
    before = checkpoints(cache)
    uri = f"sqlite:///{work / 'corrupt-store.db'}"
    run(sweep_command(recipe, uri, cache), "sweep into a fresh store", expect=0)
    status, runs = variants_of_latest_sweep(uri, experiment)
    reused = {name: r.data.tags.get("quantlab.checkpoint_reused") for name, r in runs.items()}
    print(f"  sweep {status}; checkpoint reused per variant: {reused}")
    print(f"  set aside: {sorted(p.name for p in cache.glob('checkpoints/*.corrupt-*'))}")
    print(f"  untouched checkpoints kept: {sorted(k for k, t in checkpoints(cache).items() if before.get(k) == t)}")


@contextmanager
def tmpfs(mount: Path, size: str) -> Iterator[Path | None]:
    """A tmpfs of `size` mounted at `mount` for the block (None, said, where mounting needs root)."""
    mount.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)]).returncode:
        print("  skipped: mounting a tmpfs needs root")
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)])


def trial_disk(recipe: Path, experiment: str, work: Path, sources: Path) -> None:
    print("disk: a cache on a 64 MiB tmpfs")
    with tmpfs(work / "small-cache", "64m") as mount:
        if mount is None:
            return
        uri = f"sqlite:///{work / 'disk-store.db'}"
        run(sweep_command(recipe, uri, mount), "sweep", expect=2)
        client = MlflowClient(uri)
        found = client.get_experiment_by_name(experiment)
        runs = client.search_runs([found.experiment_id]) if found else []
        print(f"  MLflow runs started: {len(runs)}; files left in the cache: {sum(1 for _ in mount.rglob('*'))}")


def trial_concurrent(recipe: Path, experiment: str, work: Path, sources: Path) -> None:
    print("concurrent: two sweeps at once on one fresh cache")
    cache = fresh_cache(work / "shared-cache", sources)
    uris = [f"sqlite:///{work / f'concurrent-{i}.db'}" for i in (1, 2)]
    for uri in uris:
        Path(uri.removeprefix("sqlite:///")).unlink(missing_ok=True)
    started = time.monotonic()
    sweeps = [subprocess.Popen(sweep_command(recipe, uri, cache), stdout=subprocess.DEVNULL) for uri in uris]
    codes = [sweep.wait() for sweep in sweeps]
    print(f"  both done in {time.monotonic() - started:.0f} s, exits {codes}")
    for uri in uris:
        status, runs = variants_of_latest_sweep(uri, experiment)
        reused = {name: r.data.tags.get("quantlab.checkpoint_reused") for name, r in runs.items()}
        print(f"  {uri}: {status}, checkpoint reused: {reused}")
    print(f"  checkpoints in the cache: {len(checkpoints(cache))}")


def trial_enospc(recipe: Path, experiment: str, work: Path, sources: Path) -> None:
    """The cache's disk fills up while fp8's checkpoint is being written (another process takes the free space
    the moment its scratch directory appears, so the sweep's own estimate passed): fp8 fails saying what to
    free, nothing partial stays; once the space is freed the same command completes without recomputing."""
    print("enospc: the cache's 2 GiB tmpfs fills up while fp8's checkpoint is written")
    with tmpfs(work / "enospc-cache", "2g") as mount:
        if mount is None:
            return
        cache = fresh_cache(mount / "cache", sources)  # the mount point itself cannot be removed
        uri = f"sqlite:///{work / 'enospc-store.db'}"
        Path(uri.removeprefix("sqlite:///")).unlink(missing_ok=True)
        filler = mount / "filler"
        started = time.monotonic()
        log = work / "enospc-fault-run.log"
        with log.open("w") as output:  # a file, not a pipe: nobody reads a pipe while the loop polls
            sweep = subprocess.Popen(sweep_command(recipe, uri, cache), stdout=output, stderr=subprocess.STDOUT)
        while sweep.poll() is None and not any(cache.glob("checkpoints/fp8-*.partial-*")):
            time.sleep(0.002)
        free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
        with filler.open("wb") as taken:
            os.posix_fallocate(taken.fileno(), 0, max(free - (1 << 20), 1))
        print(f"  fp8's write began {time.monotonic() - started:.0f} s in; took {free:,} bytes but 1 MiB")
        sweep.wait()
        output = log.read_text(errors="replace")
        print(f"  fault run: exit {sweep.returncode} in {time.monotonic() - started:.0f} s (its output: {log})")
        print("    | " + "\n    | ".join(line for line in output.splitlines() if "fp8" in line and "fill" in line))
        partial = [p.name for p in cache.glob("checkpoints/*.partial-*")]
        print(f"  partial directories left: {partial}; complete checkpoints: {sorted(checkpoints(cache))}")
        before = checkpoints(cache)
        filler.unlink()
        run(sweep_command(recipe, uri, cache), "recovery run (space freed)", expect=0)
        status, runs = variants_of_latest_sweep(uri, experiment)
        print(f"  latest sweep {status}: {sorted(runs)}; checkpoints: {sorted(checkpoints(cache))}")
        print(f"  untouched checkpoints kept: {sorted(k for k, t in checkpoints(cache).items() if before.get(k) == t)}")


TRIALS = {
    "server": trial_server,
    "corrupt": trial_corrupt,
    "disk": trial_disk,
    "enospc": trial_enospc,
    "concurrent": trial_concurrent,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trials", nargs="+", choices=sorted(TRIALS))
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2-135m.yaml")
    parser.add_argument("--work-dir", type=Path, required=True)
    parser.add_argument("--sources", type=Path, default=ROOT_CACHE, help="a cache whose sources/ to copy")
    args = parser.parse_args()
    import yaml

    experiment = yaml.safe_load(args.recipe.read_text())["name"]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    for name in args.trials:
        TRIALS[name](args.recipe.resolve(), experiment, args.work_dir.resolve(), args.sources)


if __name__ == "__main__":
    main()
