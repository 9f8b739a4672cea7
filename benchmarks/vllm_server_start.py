"""How long vLLM's CPU servers take to start, the model in the engine-core process against a spawned worker.

A variant of the vLLM recipe starts two servers at once on CPU (the scoring one and the load's), beside its reference
stages. This starts two servers of one checkpoint at once, as quantlab launches them (`VLLM.command` and
`VLLM.environment`), and times each until GET /health answers, alternating:

- in-process: quantlab's launch (`--distributed-executor-backend uni`, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, the
  OpenMP threads bound by OMP_PLACES);
- spawned worker: the same without those, vLLM's CPU default (its multiprocessing executor spawns a worker process,
  binding its threads from VLLM_CPU_OMP_THREADS_BIND);

and prints each pair's time and the ratio of the medians. Needs `quantlab engine install vllm --cpu` and a checkpoint
(a sweep's cache holds them). Run it alone on the machine:

    .venv/bin/python benchmarks/vllm_server_start.py --checkpoint ~/.cache/quantlab/checkpoints/bf16-<key>
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

IN_PROCESS = ("--distributed-executor-backend", "uni")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True, help="a compressed-tensors or plain checkpoint")
    parser.add_argument("--pairs", type=int, default=3, help="starts of each kind (two servers each), alternating")
    parser.add_argument("--dtype", default="float32", help="the server's --dtype (quantlab's on a CPU without BF16)")
    return parser.parse_args(argv)


def spawned_command(command: list[str]) -> list[str]:
    """vLLM's CPU default: quantlab's command without the in-process executor."""
    at = command.index(IN_PROCESS[0])
    return command[:at] + command[at + 2 :]


def spawned_environment(environment: dict[str, str], cores: tuple[int, ...]) -> dict[str, str]:
    """vLLM's CPU default: its process manager binds the spawned worker's threads, from VLLM_CPU_OMP_THREADS_BIND."""
    ours = ("VLLM_ENABLE_V1_MULTIPROCESSING", "OMP_PLACES", "OMP_PROC_BIND")
    bind = ",".join(map(str, cores)) if cores else "nobind"
    return {k: v for k, v in environment.items() if k not in ours} | {"VLLM_CPU_OMP_THREADS_BIND": bind}


def two_at_once(python: Path, launch, spawned: bool, scratch: Path) -> float:
    """Seconds until both of two servers started together answer /health."""
    from quantlab.serving.engines import ENGINES
    from quantlab.serving.launcher import launched_server, wait_healthy

    vllm = ENGINES["vllm"]
    started = time.perf_counter()
    with contextlib.ExitStack() as servers:
        running = []
        for index in range(2):

            def command_for(port: int) -> list[str]:
                command = vllm.command(python, dataclasses.replace(launch, port=port))
                return spawned_command(command) if spawned else command

            environment = vllm.environment(launch)
            if spawned:
                environment = spawned_environment(environment, launch.bind_cpus)
            log = scratch / f"{'spawned' if spawned else 'in-process'}-{index}.log"
            server = servers.enter_context(
                launched_server(command_for, "vllm", log, {**os.environ, **environment, "HF_HUB_OFFLINE": "1"})
            )
            running.append(server)
        for server in running:
            wait_healthy(server, 600)
        return time.perf_counter() - started


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    from quantlab.serving.engines import ENGINES
    from quantlab.serving.engines.base import Launch
    from quantlab.serving.environments import engine_python

    vllm = ENGINES["vllm"]
    python = engine_python(vllm, None, Path.home() / ".cache" / "quantlab", "cpu")
    cores = tuple(sorted(os.sched_getaffinity(0)))
    launch = Launch(
        checkpoint=args.checkpoint.resolve(),
        port=0,
        device="cpu",
        dtype=args.dtype,
        threads=len(cores),
        bind_cpus=cores,
        gpus=0,
        kv_cache_tokens=8192,
        kv_bytes_per_token=46080,  # SmolLM2-135M in float32; the size only shapes the allocation
        batch_tokens=2048,
        max_model_len=2048,
        gpu_memory_utilization=None,
        top_logprobs=100,
        scoring=True,
    )
    seconds: dict[bool, list[float]] = {False: [], True: []}
    with tempfile.TemporaryDirectory(prefix="vllm-start-") as scratch:
        for pair in range(args.pairs):
            for spawned in (False, True):
                taken = two_at_once(python, launch, spawned, Path(scratch))
                seconds[spawned].append(taken)
                kind = "spawned worker" if spawned else "in-process"
                print(f"pair {pair + 1}: two servers at once, {kind:<14} healthy after {taken:6.1f} s", flush=True)
    in_process, spawned = statistics.median(seconds[False]), statistics.median(seconds[True])
    print(f"\nmedian: in-process {in_process:.1f} s, spawned worker {spawned:.1f} s: {in_process / spawned:.2f}x")


if __name__ == "__main__":
    main()
