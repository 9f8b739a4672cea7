"""What a variant pays for following the host's core share (quantlab.host_share.HostShare.follow): a forward
pre-hook on the model and on each decoder block, which checks the host's timing lock (a shared flock, released at
once) and counts the seats again at most once a second.

Loads the embedded SmolLM2-135M twice in one process (float32, CPU): once plain, once with the hooks (following
a seat of its own, alone on the host, so the thread count never changes and only the hooks' cost shows). Then
times both side by side, alternating rounds so that drift in the machine's speed hits both alike: a one-token
forward (the short ops a decode step is made of, where per-call overhead shows most) and a 128-token prefill.
Prints the median seconds per forward of each and their ratio (hooked / plain).

    .venv/bin/python benchmarks/follow_overhead.py [--rounds 15] [--cache-dir DIR]

Run it alone on the machine. The model's conversion comes from --cache-dir (default QUANTLAB_CACHE_DIR or
~/.cache/quantlab), made there first if it is missing (a minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny import EMBEDDED_GGUF  # noqa: E402

from quantlab.cache import default_root  # noqa: E402
from quantlab.host_share import TIMING_LOCK, HostShare  # noqa: E402
from quantlab.models import load_source_model, materialize, resolve_source  # noqa: E402
from quantlab.recipe import ModelSpec  # noqa: E402


def forward_seconds(model: torch.nn.Module, tokens: torch.Tensor, calls: int) -> float:
    with torch.inference_mode():
        started = time.perf_counter()
        for _ in range(calls):
            model(tokens)
        return (time.perf_counter() - started) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="alternating timed rounds per shape (default 15)")
    parser.add_argument("--cache-dir", type=Path, default=default_root())
    args = parser.parse_args()

    source = materialize(resolve_source(ModelSpec(source=EMBEDDED_GGUF), Path.cwd()), args.cache_dir)
    plain, _ = load_source_model(source, torch.float32, "cpu")
    seats = Path(tempfile.mkdtemp(prefix="quantlab-seats-"))  # a host of its own: always alone
    (seats / TIMING_LOCK).touch()  # as after any measure stage: each hook then checks the timing lock
    host = HostShare.seated(directory=seats)
    hooked, _ = load_source_model(source, torch.float32, "cpu")
    host.follow(hooked)
    hooks = sum(len(module._forward_pre_hooks) for module in hooked.modules())  # noqa: SLF001

    load = os.getloadavg()[0]
    print(
        f"SmolLM2-135M, float32, {torch.get_num_threads()} torch threads; {hooks} forward pre-hooks on the hooked copy"
    )
    for label, length, calls in (("1-token forward", 1, 20), ("128-token prefill", 128, 3)):
        tokens = torch.randint(100, 1000, (1, length))
        for model in (plain, hooked):  # warm-up
            forward_seconds(model, tokens, calls)
        times: dict[str, list[float]] = {"plain": [], "hooked": []}
        for _ in range(args.rounds):
            times["plain"].append(forward_seconds(plain, tokens, calls))
            times["hooked"].append(forward_seconds(hooked, tokens, calls))
        plain_s, hooked_s = statistics.median(times["plain"]), statistics.median(times["hooked"])
        print(
            f"{label:18} plain {plain_s * 1e3:8.3f} ms   hooked {hooked_s * 1e3:8.3f} ms   "
            f"hooked / plain {hooked_s / plain_s:.3f}   ({args.rounds} rounds x {calls} calls, medians)"
        )
    print(f"1-minute load average {load:.2f} before, {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
