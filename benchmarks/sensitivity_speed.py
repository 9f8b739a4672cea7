"""How long `quantlab sensitivity rank --by block` takes on the embedded model, and whether its quick approximation
(`--rounded`: round-to-nearest in the variant's format) ranks the blocks as the method itself does.

From a cache holding only the model source's conversion (as a sweep starts from a warm cache), one process each:

1. `quantlab sensitivity rank RECIPE --variant V`: builds the baseline, its reference pass and the variant's own
   checkpoint (AWQ's calibration included), then measures every block; the issue's budget is 3 minutes on 2 cores;
2. the same command again: nothing to measure (kept groups), only the ranking logged again;
3. `--rounded`: a round-to-nearest copy instead of the variant's checkpoint, every block measured again.

Then both rankings side by side: Spearman's rank correlation, and where each one's most damaging blocks fall in
the other. Run it alone on the machine:

    .venv/bin/python benchmarks/sensitivity_speed.py --source-cache ~/.cache/quantlab
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from concurrent_sweeps import add_folder_arguments, prime
from sweep_overhead import OFFLINE_ENV, REPO

from quantlab.sensitivity.groups import rank_correlation
from quantlab.sensitivity.probe import DAMAGE_FILE, GROUPS_FILE


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", type=Path, default=REPO / "recipes" / "smollm2-135m.yaml")
    parser.add_argument("--variant", default="awq-int4-g64")
    parser.add_argument("--top", type=int, default=3, help="how many of the most damaging blocks to compare")
    add_folder_arguments(parser)
    return parser.parse_args(argv)


def sensitivity(args: argparse.Namespace, cache: Path, store: str, *flags: str) -> tuple[float, dict]:
    """Seconds the command took, and its ranking (sensitivity.json as logged, read back from the cache)."""
    import os

    command = [sys.executable, "-m", "quantlab", "sensitivity", "rank", str(args.recipe), "--variant", args.variant]
    command += ["--tracking-uri", store, "--cache-dir", str(cache), *flags]
    started = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ | OFFLINE_ENV)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(
            f"{' '.join(command)} exited {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        )
    print(result.stdout, flush=True)
    return seconds, newest_ranking(store)


def newest_ranking(store: str) -> dict:
    from quantlab import tracking

    opened = tracking.open_store(store)
    runs = opened.search(list(opened.experiments()), {tracking.ROLE: "sensitivity"})
    return json.loads(opened.read_artifact(runs[0].run_id, "sensitivity.json")) | {"tags": runs[0].tags}


def ranks(ranking: dict) -> dict[str, int]:
    return {item["group"]: item["rank"] for item in ranking["ranking"]}


def agreement(fast: dict, calibrated: dict, top: int) -> list[str]:
    fast_ranks, calibrated_ranks = ranks(fast), ranks(calibrated)
    rho = rank_correlation(fast_ranks, calibrated_ranks)
    groups = fast_ranks
    first = lambda r: sorted(r, key=r.get)[:top]  # noqa: E731
    return [
        f"Spearman rank correlation, round-to-nearest vs calibrated: {rho:.3f} over {len(groups)} blocks",
        f"round-to-nearest's top {top}: {first(fast_ranks)}, ranked {[calibrated_ranks[g] for g in first(fast_ranks)]} by the calibrated method",
        f"calibrated top {top}: {first(calibrated_ranks)}, ranked {[fast_ranks[g] for g in first(calibrated_ranks)]} by round-to-nearest",
        f"KL of every block at once: round-to-nearest {fast['every_group']['quality/kld_mean']:.5f}, "
        f"calibrated {calibrated['every_group']['quality/kld_mean']:.5f}",
    ]


def main(argv: Sequence[str] | None = None) -> int:
    import tempfile

    args = parse_args(argv)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="quantlab-sensitivity-bench-"))
    cache = work / "cache"
    prime(args.recipe, args.source_cache, cache)
    store = f"sqlite:///{work}/mlflow.db"
    calibrated_seconds, calibrated = sensitivity(args, cache, store)
    again_seconds, again = sensitivity(args, cache, store)
    fast_seconds, fast = sensitivity(args, cache, store, "--rounded")
    references = list((cache / "references").iterdir())
    kept = [
        p.parent.name for p in (cache / "sensitivity").glob(f"*/{GROUPS_FILE}") if (p.parent / DAMAGE_FILE).is_file()
    ]
    lines = [
        f"sensitivity rank --by block of {args.variant} ({args.recipe.name}), {len(fast['ranking'])} blocks:",
        f"  from a cache with only the source's conversion (builds {args.variant}'s checkpoint): {calibrated_seconds:.1f} s",
        f"  the same again: {again_seconds:.1f} s, blocks measured: {again['tags']['quantlab.groups_computed']}",
        f"  --rounded (a round-to-nearest copy, every block): {fast_seconds:.1f} s",
        f"  baseline reference passes in the cache: {len(references)} (kept sensitivities: {len(kept)})",
        *(f"  {line}" for line in agreement(fast, calibrated, args.top)),
    ]
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
